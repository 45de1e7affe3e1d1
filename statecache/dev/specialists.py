"""Random specialists folders in the real format, the adapters written by peft's own ``save_pretrained``.

For tests, the built-in tiny model (statecache.dev.tiny) and demos: the answers mean nothing, only their agreement
with transformers + peft does. Knows nothing of how the folder is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from statecache.model.specialists.folder import ROUTER_JSON, ROUTER_WEIGHTS

ALL_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj",
               "o_proj", "gate_proj", "up_proj", "down_proj")


def write_router(folder, routes: list[str], router_layer: int, weight: torch.Tensor, bias: torch.Tensor,
                 eps: float = 1e-6) -> None:
    """router.json and router.safetensors of a specialists folder."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    (d / ROUTER_JSON).write_text(json.dumps({"router_layer": router_layer, "eps": eps, "routes": list(routes)}, indent=1))
    save_file({"weight": weight.float().contiguous(), "bias": bias.float().contiguous()}, str(d / ROUTER_WEIGHTS))


def make_specialists(model_dir, out_dir, *, routes=("trunk", "alpha", "beta"), router_layer: int = 2,
                     adapters: dict[str, dict] | None = None, seed: int = 0, scale: float = 0.05,
                     router_scale: float = 30.0, bias=None) -> Path:
    """Write a specialists folder for the Qwen3.5 checkpoint in `model_dir` into `out_dir` and return it.

    adapters: per route name (routes[1:]), LoraConfig fields (r, lora_alpha, target_modules, layers_to_transform,
    rank_pattern, alpha_pattern, use_rslora, ...); by default every projection of the layers from router_layer + 1
    at rank 4. LoRA weights (A and B) are random normal of std `scale`. The router is random too, but centred on
    rows of random tokens (see `_router`) so that different rows pick different routes; `bias` replaces its bias
    (e.g. to force one route)."""
    from peft import LoraConfig, get_peft_model

    from statecache.dev.checkpoints import load_reference

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = load_reference(model_dir)
    n_layers = base.config.get_text_config().num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    adapters = adapters or {}
    for name in routes[1:]:
        fields = dict(r=4, lora_alpha=8, target_modules=list(ALL_MODULES),
                      layers_to_transform=list(range(router_layer + 1, n_layers)))
        fields.update(adapters.get(name, {}))
        pm = get_peft_model(base, LoraConfig(**fields))
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if ".lora_A." in pname or ".lora_B." in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
        pm.save_pretrained(str(out / name))
        base = pm.unload()
    w, b = _router(base, router_layer, len(routes), gen, router_scale)
    if bias is not None:
        b = torch.as_tensor(bias, dtype=torch.float32)
    write_router(out, list(routes), router_layer, w, b)
    return out


def _router(base, layer: int, n_routes: int, gen: torch.Generator, spread: float, eps: float = 1e-6):
    """A random router whose routes split rows of random tokens: the mean feature of such rows shares one large
    common direction, so the weight is made orthogonal to it, scaled so the logits spread by ~`spread` / 10 across
    those rows, and the bias centres them."""
    cfg = base.config.get_text_config()
    rows = torch.randint(0, cfg.vocab_size, (16, 96), generator=gen)
    with torch.no_grad():
        hs = base(input_ids=rows, output_hidden_states=True).hidden_states[layer].float()  # [16, 96, H]
    f = (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)).mean(1)  # [16, H]
    m = f.mean(0)
    w = torch.randn(n_routes, cfg.hidden_size, generator=gen)
    w = w - (w @ m)[:, None] * m[None] / m.dot(m)
    logits = f @ w.T
    w = w * (spread / 10) / logits.std(0).mean().clamp_min(1e-12)
    logits = f @ w.T
    return w, -logits.mean(0)
