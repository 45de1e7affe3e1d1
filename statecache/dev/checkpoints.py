"""Random Hugging Face Qwen3.5 checkpoints, made by transformers itself, and the transformers model that reads them.

Tests and the built-in tiny model use this: a checkpoint made here has exactly the file layout, weight names and
config fields of a real one, because transformers wrote it. ``load_reference`` loads it back with transformers:
the oracle that statecache's own forward is compared against.

Two layouts, as published checkpoints come:
- ``causal``: ``Qwen3_5ForCausalLM``, config ``model_type`` ``qwen3_5_text``, weights ``model.*`` and ``lm_head.weight``;
- ``conditional``: ``Qwen3_5ForConditionalGeneration`` (the layout of the released Qwen3.5 models), config
  ``model_type`` ``qwen3_5`` with a ``text_config``, weights ``model.language_model.*``, ``model.visual.*`` and
  ``lm_head.weight``. Its word embeddings are tied by the *top-level* ``tie_word_embeddings``; transformers ignores
  the one inside ``text_config`` (the released configs set both).

With ``image_tokens`` (ids of ``<|image_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` in the tokenizer) a conditional
checkpoint also gets those ids in its config and an image processor config (``preprocessor_config.json``) as the
released ones have, sized to its vision tower: image rows can then be answered from it.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from statecache.model.hf import hf_qwen3_5

_LAYOUTS = {"qwen3_5_text": "causal", "qwen3_5": "conditional"}
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")


def _tiny_vision_config(out_hidden_size: int) -> dict:
    """The smallest vision tower transformers builds: only there so the conditional layout has its ``model.visual``."""
    return dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
                spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=out_hidden_size)


def preprocessor_config(vision: dict, max_pixels: int, min_pixels: int) -> dict:
    """``preprocessor_config.json`` in the released Qwen3.5 form (Qwen2-VL image processor) for a vision tower."""
    return {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"], "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "resample": 3}


def _perturb(model, scale: float, seed: int) -> None:
    """Add ``scale * randn`` to every parameter (tied ones once), seeded: transformers starts RMSNorm weights at 0,
    the gated norm at 1, ``dt_bias`` at 1; noise on all of them makes a wrong convention show in any comparison."""
    import torch

    if scale == 0:
        return
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)


def make_checkpoint(out_dir, *, layout: str = "causal", seed: int = 0, perturb: float = 0.1,
                    max_shard_bytes: int | None = None, tokenizer_dir=None, vision_config: dict | None = None,
                    image_tokens: dict | None = None, max_pixels: int = 32 * 32, min_pixels: int = 8 * 8,
                    **text_config) -> Path:
    """Write a random Qwen3.5 checkpoint (float32 safetensors) into ``out_dir`` and return its path.

    ``text_config`` are ``Qwen3_5TextConfig`` fields (hidden_size, num_hidden_layers, layer_types, head_dim,
    linear_*, vocab_size, rope_parameters, tie_word_embeddings, rms_norm_eps, ...); unset ones take transformers'
    defaults (the 9B shape; ``rope_parameters`` ``{"rope_type": "default", "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25}``). Weights are transformers' initialisation under ``seed``, plus noise of scale
    ``perturb`` on every parameter. A ``max_shard_bytes`` below the model's size gives a sharded checkpoint with
    ``model.safetensors.index.json``. ``tokenizer_dir``: its tokenizer files are copied alongside.
    Conditional layout: ``vision_config`` (``Qwen3_5VisionConfig`` fields; default the smallest tower) and
    ``image_tokens`` (``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id``); with the latter an image
    processor config is written too (images resized to ``min_pixels``..``max_pixels``).
    """
    import torch

    if layout not in ("causal", "conditional"):
        raise ValueError(f"layout must be 'causal' or 'conditional', not {layout!r}")
    hf = hf_qwen3_5(kernels=None)  # built and saved on the CPU, no forward
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    fields = copy.deepcopy(text_config)  # transformers fills rope_parameters in place
    text_cfg = Qwen3_5TextConfig(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if layout == "causal":
            model = hf.Qwen3_5ForCausalLM(text_cfg)
        else:
            vision = dict(vision_config or _tiny_vision_config(text_cfg.hidden_size), out_hidden_size=text_cfg.hidden_size)
            config = Qwen3_5Config(text_config=text_cfg, vision_config=vision,
                                   tie_word_embeddings=text_cfg.tie_word_embeddings, **(image_tokens or {}))
            model = hf.Qwen3_5ForConditionalGeneration(config)
    model = model.to(torch.float32)
    _perturb(model, perturb, seed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_bytes if max_shard_bytes is not None else "50GB")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    if layout == "conditional" and image_tokens:
        full = {**model.config.vision_config.to_dict()}
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(full, max_pixels, min_pixels), indent=2))
    return out


def copy_tokenizer(src_dir, dst_dir) -> None:
    """Copy a Hugging Face tokenizer's files (tokenizer*, chat_template*, vocab/merges, special token maps)."""
    for f in Path(src_dir).iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "chat_template")) or f.name in _TOKENIZER_FILES):
            shutil.copy2(f, Path(dst_dir) / f.name)


def checkpoint_layout(model_dir) -> str:
    """``"causal"`` or ``"conditional"``, from the checkpoint's ``config.json``."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type not in _LAYOUTS:
        raise ValueError(f"{model_dir}: model_type {model_type!r} is not a Qwen3.5 checkpoint (qwen3_5 or qwen3_5_text)")
    return _LAYOUTS[model_type]


def load_reference(model_dir):
    """The checkpoint loaded by transformers' ``from_pretrained`` in its own layout, float32, in eval mode (CPU),
    through transformers' torch code (``hf_qwen3_5()``): it runs on CPU tensors."""
    import torch

    hf = hf_qwen3_5()
    cls = hf.Qwen3_5ForConditionalGeneration if checkpoint_layout(model_dir) == "conditional" else hf.Qwen3_5ForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def _pattern(n_layers: int) -> list[str]:
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]


# Text configs of the released models (Hugging Face Qwen/Qwen3.5-0.8B, -2B, -9B config.json, text_config).
_REAL = {
    "0.8B": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_value_heads=16, tie_word_embeddings=True),
    "2B": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
               linear_num_value_heads=16, tie_word_embeddings=True),
    "9B": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
               linear_num_value_heads=32, tie_word_embeddings=False, num_hidden_layers=32),
}


def real_shape(name: str) -> dict:
    """``text_config`` fields of a released Qwen3.5 model: ``"0.8B"``, ``"2B"`` or ``"9B"`` (``"Qwen3.5-9B"`` too)."""
    key = name.removeprefix("Qwen/").removeprefix("Qwen3.5-").upper()
    if key not in _REAL:
        raise KeyError(f"unknown Qwen3.5 shape {name!r}; known: {', '.join(_REAL)}")
    shape = dict(num_hidden_layers=24, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6,
                 max_position_embeddings=262144, eos_token_id=248044,
                 rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                      mrope_section=[11, 11, 10], mrope_interleaved=True))
    shape.update(copy.deepcopy(_REAL[key]))
    shape["layer_types"] = _pattern(shape["num_hidden_layers"])
    return shape
