"""Loading a Hugging Face Qwen3.5 checkpoint folder into fused weights on the target device and dtype.

Reads `config.json` (statecache.model.config), single or sharded safetensors (with `model.safetensors.index.json`),
and only the text model's weights: vision (`model.visual.*`, which statecache.model.vision loads into transformers'
own vision module) and multi-token-prediction (`mtp.*`) weights are never read here. Each tensor goes straight from the file to the device, cast there, so no float32 copy of the model
sits in host memory. Projections are fused at load: a GDN layer's in_proj_qkv/z/b/a into one matrix, attention's
q/k/v into one, the MLP's gate/up into one. The output head is kept whole (the embedding when tied): each slot gathers the rows of its own option tokens.
Knows nothing of rows, caches or kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from statecache.model.config import LINEAR, TextConfig, load_config


@dataclass
class GdnWeights:
    in_w: torch.Tensor  # [conv_dim + value_dim + 2 * Hv, H]: qkv | z | b | a
    conv_w: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor  # [Hv] float32
    dt_bias: torch.Tensor  # [Hv] float32
    norm_w: torch.Tensor  # [Dv] (plain weight, model dtype)
    out_w: torch.Tensor  # [H, value_dim]


@dataclass
class AttnWeights:
    qkv_w: torch.Tensor  # [2 * Hq * D + 2 * Hkv * D, H]: (q | gate interleaved per head) | k | v
    q_norm: torch.Tensor  # [D] float32, zero-centred: holds 1 + w
    k_norm: torch.Tensor  # [D] float32, 1 + w
    o_w: torch.Tensor  # [H, Hq * D]


@dataclass
class LayerWeights:
    kind: str
    in_norm: torch.Tensor  # [H] float32, 1 + w
    post_norm: torch.Tensor  # [H] float32, 1 + w
    mixer: GdnWeights | AttnWeights
    gate_up_w: torch.Tensor  # [2 * I, H]
    down_w: torch.Tensor  # [H, I]


@dataclass
class Weights:
    cfg: TextConfig
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H] float32, 1 + w
    head_w: torch.Tensor  # [V, H]: the output head (the embedding itself when tied); answers gather the asked rows
    letter_ids: torch.Tensor  # [n_letters] long: the option letters' ids (what a slot's option count reads)


class CheckpointError(ValueError):
    """The checkpoint folder is incomplete or does not match its config."""


class _Source:
    """name -> tensor on the device in the asked dtype; `fused` concatenates rows into one new tensor."""

    device: torch.device

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def fused(self, names: list[str], dtype: torch.dtype) -> torch.Tensor:
        """Concatenate rows of several matrices into one preallocated tensor (one copy on the device)."""
        parts = [self.get(n, dtype) for n in names]
        out = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=dtype, device=self.device)
        r = 0
        for p in parts:
            out[r : r + p.shape[0]].copy_(p)
            r += p.shape[0]
        return out


class _StateDict(_Source):
    """An in-memory state dict (e.g. transformers' own model's): tensors moved and cast on demand."""

    def __init__(self, sd: dict, device: torch.device):
        self.sd, self.device = sd, device

    def has(self, name: str) -> bool:
        return name in self.sd

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.sd:
            raise CheckpointError(f"weight {name!r} missing from the state dict")
        return self.sd[name].to(device=self.device, dtype=dtype)


class _Files(_Source):
    """name -> tensor across one or many safetensors files, each read once, straight to the device."""

    def __init__(self, model_dir: Path, device: torch.device):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            wmap = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}")
            wmap = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    wmap.update({k: f.name for k in h.keys()})
        self.wmap = wmap
        self.dir = model_dir
        self.device = device
        self._open: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.wmap

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.wmap:
            raise CheckpointError(f"weight {name!r} missing from {self.dir}")
        fname = self.wmap[name]
        h = self._open.get(fname)
        if h is None:
            h = safe_open(str(self.dir / fname), framework="pt", device=str(self.device))
            self._open[fname] = h
        return h.get_tensor(name).to(dtype)


def load_weights(model_dir: str | Path, letter_ids: list[int], device="cpu", dtype=torch.float32) -> Weights:
    """A checkpoint folder's text weights, fused, on `device` in `dtype`."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    return _build(load_config(model_dir), _Files(model_dir, device), letter_ids, dtype)


def weights_from_state_dict(cfg: TextConfig, sd: dict, letter_ids: list[int], device="cpu", dtype=torch.float32) -> Weights:
    """The same from an in-memory state dict named as in a checkpoint (benchmarks build it from transformers)."""
    return _build(cfg, _StateDict(sd, torch.device(device)), letter_ids, dtype)


def _build(cfg: TextConfig, files: _Source, letter_ids: list[int], dtype: torch.dtype) -> Weights:
    device = files.device
    pre = cfg.weight_prefix
    f32 = torch.float32

    def zc(name):  # zero-centred RMSNorm weight, kept as 1 + w in float32
        return 1.0 + files.get(name, f32)

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{pre}layers.{i}."
        if kind == LINEAR:
            la = p + "linear_attn."
            mixer = GdnWeights(
                in_w=files.fused([la + s + ".weight" for s in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")], dtype),
                conv_w=files.get(la + "conv1d.weight", dtype).reshape(cfg.conv_dim, -1).contiguous(),
                A_log=files.get(la + "A_log", f32),
                dt_bias=files.get(la + "dt_bias", f32),
                norm_w=files.get(la + "norm.weight", dtype),
                out_w=files.get(la + "out_proj.weight", dtype),
            )
        else:
            sa = p + "self_attn."
            mixer = AttnWeights(
                qkv_w=files.fused([sa + s + ".weight" for s in ("q_proj", "k_proj", "v_proj")], dtype),
                q_norm=zc(sa + "q_norm.weight"),
                k_norm=zc(sa + "k_norm.weight"),
                o_w=files.get(sa + "o_proj.weight", dtype),
            )
        layers.append(LayerWeights(
            kind=kind,
            in_norm=zc(p + "input_layernorm.weight"),
            post_norm=zc(p + "post_attention_layernorm.weight"),
            mixer=mixer,
            gate_up_w=files.fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], dtype),
            down_w=files.get(p + "mlp.down_proj.weight", dtype),
        ))
    embed = files.get(pre + "embed_tokens.weight", dtype)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"embed_tokens is {tuple(embed.shape)}, config says {(cfg.vocab_size, cfg.hidden_size)}")
    head_name = "lm_head.weight"
    if cfg.tie_word_embeddings or not files.has(head_name):
        if not cfg.tie_word_embeddings:
            raise CheckpointError(f"{head_name} missing and tie_word_embeddings is false")
        head = embed
    else:
        head = files.get(head_name, dtype)
    letters = torch.as_tensor(letter_ids, dtype=torch.long, device=device)
    return Weights(cfg=cfg, embed=embed, layers=layers, final_norm=zc(pre + "norm.weight"), head_w=head,
                   letter_ids=letters)
