"""Write a random Qwen3.5 checkpoint of a released model's shape (9B by default) in the Hugging Face layout, fast.

    python bench/random_checkpoint.py OUT_DIR [--shape 9B] [--layers N] [--shard-gb 5] [--seed 0] [--device cuda]

`statecache.dev.checkpoints.make_checkpoint` builds the model with transformers on the CPU and saves it in float32: right
for tests, minutes and 36 GB for the 9B. This writes the same layout (`Qwen3_5ForCausalLM`, `model_type`
`qwen3_5_text`, weights `model.*` + `lm_head.weight`) directly: every weight name and shape comes from a
transformers model built on the meta device (so nothing is missed or invented), values are generated with torch
(on CUDA when available) in bfloat16, and saved as shards of at most `--shard-gb` with
`model.safetensors.index.json`, as released checkpoints are. The tiny model's tokenizer files go alongside, so the
engine finds single tokens for the letters A-Z (token ids stay below its vocabulary; the model's vocabulary stays
the real one).

Values are scaled like an initialised model, then perturbed so no convention can hide: matrices and embeddings
normal(0, 0.02); decoder RMSNorm weights (zero-centred, 1 + w) 0.1 * normal; the gated norm inside GDN 1 + 0.1 *
normal; `A_log` log(uniform(1, 16)); `dt_bias` log(expm1(dt)) with dt log-uniform in [1e-3, 0.1]; conv weights
normal(0, 1/sqrt(kernel)); biases (if any) 0.02 * normal. Knows nothing of statecache's loader; tests check that
both it and transformers' `from_pretrained` read what this writes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from statecache.dev.checkpoints import copy_tokenizer, real_shape  # noqa: E402
from statecache.model.hf import hf_qwen3_5  # noqa: E402


def text_config(shape: str = "9B", layers: int | None = None, **overrides):
    """transformers' `Qwen3_5TextConfig` of a released shape, optionally with fewer layers or other fields."""
    from transformers import Qwen3_5TextConfig

    fields = real_shape(shape)
    if layers is not None:
        fields["num_hidden_layers"] = layers
        fields["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' `Qwen3_5ForCausalLM` saves, name -> shape (tied weights once), from a meta model."""
    hf = hf_qwen3_5(kernels=None)  # a meta model: no forward
    with torch.device("meta"):
        model = hf.Qwen3_5ForCausalLM(cfg)
    sd = model.state_dict()
    seen: set = set()
    shapes = {}
    for name, t in sd.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        shapes[name] = tuple(t.shape)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device, kernel: int) -> torch.Tensor:
    """One weight, float32 on `device`, scaled like an initialised model (see the module docstring)."""
    n = lambda: torch.randn(shape, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    u = lambda: torch.rand(shape, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(1 + 15 * u())
    if leaf == "dt_bias":
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * u())
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if "conv1d" in name and leaf == "weight":
        return n() / math.sqrt(kernel)
    if "norm" in name and leaf == "weight":
        # decoder norms are zero-centred (1 + w); GDN's gated norm (linear_attn.norm) is plain w
        return 1 + 0.1 * n() if ".linear_attn.norm." in name else 0.1 * n()
    if leaf == "bias":
        return 0.02 * n()
    return 0.02 * n()


def write_checkpoint(out_dir, cfg, *, seed: int = 0, shard_bytes: int = 5 * 2**30, device: str | None = None,
                     dtype: torch.dtype = torch.bfloat16, tokenizer_dir=None, progress=None) -> Path:
    """Write config.json, sharded safetensors and the index into `out_dir`; returns its path."""
    from safetensors.torch import save_file

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = weight_shapes(cfg)
    kernel = cfg.linear_conv_kernel_dim
    gen = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=dtype).element_size()
    # shard boundaries: in name order, each shard up to shard_bytes (one oversized tensor gets its own shard)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * elem
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    total = sum(math.prod(s) * elem for s in shapes.values())
    weight_map = {}
    for k, names in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {nm: random_tensor(nm, shapes[nm], gen, device, kernel).to(dtype).cpu().contiguous() for nm in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({nm: fname for nm in names})
        if progress:
            print(f"  wrote {fname} ({len(names)} tensors)", file=progress, flush=True)
        del tensors
    if device.type == "cuda":  # the allocator's blocks back to the driver: a worker started after this (load_bench's)
        torch.cuda.empty_cache()  # had 8 GB less for its cache while they stayed (s51_run2: 46,040 MiB against 53,580)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = cfg.to_dict()
    config["architectures"] = ["Qwen3_5ForCausalLM"]
    config["model_type"] = "qwen3_5_text"
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer_dir is None:
        from statecache.dev.tiny import tiny_model_dir

        tokenizer_dir = tiny_model_dir()
    copy_tokenizer(tokenizer_dir, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="checkpoint folder to write")
    ap.add_argument("--shape", default="9B", help="0.8B, 2B or 9B (statecache.dev.checkpoints.real_shape)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="where values are generated (default: cuda when available)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = text_config(args.shape, args.layers)
    out = write_checkpoint(args.out, cfg, seed=args.seed, shard_bytes=int(args.shard_gb * 2**30), device=args.device,
                           progress=sys.stderr)
    n = sum(math.prod(s) for s in weight_shapes(cfg).values())
    print(f"random {args.shape} checkpoint ({n / 1e9:.2f} B parameters) in {out}, {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
