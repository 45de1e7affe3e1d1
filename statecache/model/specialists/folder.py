"""A specialists folder: reading it, checking it against the model, and stacking its adapters.

Layout of ``DIR``:
- ``router.json``: ``{"router_layer": int, "eps": float, "routes": [name, ...]}``; route 0 (the first name) is
  the trunk, which has no adapter;
- ``router.safetensors``: ``weight`` [routes, hidden] and ``bias`` [routes];
- ``DIR/<name>/`` for every other route: a PEFT LoRA adapter as ``save_pretrained`` writes it
  (``adapter_config.json`` + ``adapter_model.safetensors``), keys
  ``base_model.model.model[.language_model].layers.<i>.<block>.<module>.lora_{A,B}.weight``.

The adapter config is read with peft's own ``LoraConfig`` and its per-module rank / alpha patterns resolved with
peft's own ``get_pattern_key``, so scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) exactly as peft
computes it. Everything is checked before anything goes to the device: a bad folder raises `SpecialistsError`
naming the file and what is wrong, so an engine never starts with part of its specialists.
Knows nothing of the forward beyond which fused projection each module's rows land in (statecache.model.loader).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from statecache.model.config import LINEAR, TextConfig
from statecache.model.specialists.lora import Site, StackedLora

ROUTER_JSON, ROUTER_WEIGHTS = "router.json", "router.safetensors"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

log = logging.getLogger("statecache.model.specialists")
_KEY = re.compile(r"^base_model\.model\.((?:model\.)(?:language_model\.)?layers\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight$")


class SpecialistsError(ValueError):
    """A specialists folder that cannot be served as it is."""


def site_modules(cfg: TextConfig, layer: int) -> dict[str, tuple[str, list[tuple[str, int]], int]]:
    """The fused projection sites of one layer: site name -> (block, [(module, output rows)], input features), in
    the row order statecache.model.loader fuses them (GDN in_w = qkv | z | b | a; attention qkv_w = q | k | v, q holding
    the output gate; MLP gate_up_w = gate | up)."""
    H = cfg.hidden_size
    if cfg.layer_types[layer] == LINEAR:
        Hv = cfg.linear_num_value_heads
        mix = {"in": ("linear_attn", [("in_proj_qkv", cfg.conv_dim), ("in_proj_z", cfg.value_dim), ("in_proj_b", Hv),
                                      ("in_proj_a", Hv)], H),
               "out": ("linear_attn", [("out_proj", H)], cfg.value_dim)}
    else:
        D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        mix = {"qkv": ("self_attn", [("q_proj", 2 * Hq * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)], H),
               "o": ("self_attn", [("o_proj", H)], Hq * D)}
    I = cfg.intermediate_size
    return {**mix, "gate_up": ("mlp", [("gate_proj", I), ("up_proj", I)], H), "down": ("mlp", [("down_proj", H)], I)}


@dataclass
class Router:
    """Picks a route from the mean over a row's tokens of the weightless-RMS-normalised hidden state entering
    `layer`: argmax(weight @ f + bias)."""

    layer: int
    eps: float
    weight: torch.Tensor  # [routes, H] float32
    bias: torch.Tensor  # [routes] float32

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> each token's vector normalised to unit RMS, no weight: [T, H] float32."""
        f = h.float()
        return f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)

    def logits(self, mean: torch.Tensor) -> torch.Tensor:
        """mean [..., H] (the tokens' mean feature) -> [..., routes]."""
        return mean.float() @ self.weight.T + self.bias

    def pick(self, fsum: torch.Tensor, n: int) -> int:
        """The route of a row whose features over its n tokens sum to fsum [H] (reads one number back)."""
        return int(self.logits(fsum / n).argmax())


@dataclass
class Specialists:
    """A loaded specialists folder: route names (0 the trunk), the router, all adapters stacked on the device."""

    path: str
    names: list[str]
    router: Router
    lora: StackedLora

    @property
    def split(self) -> int:
        """The first layer any adapter touches."""
        return self.lora.split

    def info(self) -> dict:
        return {"path": self.path, "routes": list(self.names), "router_layer": self.router.layer, "split": self.split,
                "adapter_mb": round(self.lora.nbytes / 2**20, 2)}


def _err(where, msg: str) -> SpecialistsError:
    return SpecialistsError(f"specialists {where}: {msg}")


def _read_router(d: Path, cfg: TextConfig) -> tuple[list[str], int, float, torch.Tensor, torch.Tensor]:
    rj = d / ROUTER_JSON
    if not rj.is_file():
        raise _err(d, f"no {ROUTER_JSON} (a specialists folder needs a router)")
    try:
        spec = json.loads(rj.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _err(rj, f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _err(rj, "must be a JSON object with router_layer, eps and routes")
    layer, eps, names = spec.get("router_layer"), spec.get("eps", 1e-6), spec.get("routes")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < cfg.num_layers:
        raise _err(rj, f"router_layer must be an integer in [0, {cfg.num_layers}), got {layer!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0 or not math.isfinite(eps):
        raise _err(rj, f"eps must be a positive number, got {eps!r}")
    if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
        raise _err(rj, f"routes must be a list of at least two names (the trunk first), got {names!r}")
    seen: dict[str, str] = {}
    for n in names:
        if not n or n in (".", "..") or "/" in n or "\\" in n or n != n.strip():
            raise _err(rj, f"route name {n!r} cannot name a folder")
        if n.casefold() in seen:
            raise _err(rj, f"route names clash: {seen[n.casefold()]!r} and {n!r}")
        seen[n.casefold()] = n
    rw = d / ROUTER_WEIGHTS
    if not rw.is_file():
        raise _err(d, f"no {ROUTER_WEIGHTS} (the router's weight and bias)")
    try:
        with safe_open(str(rw), framework="pt") as f:
            keys = set(f.keys())
            if not {"weight", "bias"} <= keys:
                raise _err(rw, f"needs tensors 'weight' and 'bias', has {sorted(keys)}")
            w, b = f.get_tensor("weight").float(), f.get_tensor("bias").float()
    except SpecialistsError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file
        raise _err(rw, f"cannot be read: {type(e).__name__}: {e}") from None
    R, H = len(names), cfg.hidden_size
    if tuple(w.shape) != (R, H):
        raise _err(rw, f"weight is {tuple(w.shape)}, expected ({R}, {H}) (routes, hidden size)")
    if tuple(b.shape) != (R,):
        raise _err(rw, f"bias is {tuple(b.shape)}, expected ({R},)")
    if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
        raise _err(rw, "weight or bias is not finite")
    return names, layer, float(eps), w, b


def _read_adapter(d: Path, name: str, cfg: TextConfig, router_layer: int) -> dict[tuple[int, str], dict[str, tuple]]:
    """One route's adapter -> {(layer, site): {module: (A [r, in] f32, B [out, r] f32, scaling)}}, all checked."""
    try:
        from peft import LoraConfig
        from peft.utils.other import get_pattern_key
    except ImportError as e:
        raise _err(d, f"reading LoRA adapters needs peft (pip install 'statecache[specialists]'): {e}") from None

    ad = d / name
    if not ad.is_dir():
        raise _err(d, f"route {name!r} has no adapter folder {ad}")
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (ad / f).is_file():
            raise _err(ad, f"missing {f} (expected a PEFT LoRA adapter as save_pretrained writes it)")
    try:
        raw = json.loads((ad / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _err(ad / ADAPTER_CONFIG, f"not valid JSON: {e}") from None
    if raw.get("peft_type") != "LORA":
        raise _err(ad / ADAPTER_CONFIG, f"peft_type {raw.get('peft_type')!r}: only LoRA adapters are served")
    try:
        lc = LoraConfig.from_pretrained(str(ad))
    except Exception as e:  # noqa: BLE001
        raise _err(ad / ADAPTER_CONFIG, f"peft cannot read it: {type(e).__name__}: {e}") from None
    unsupported = {"use_dora": lc.use_dora, "fan_in_fan_out": lc.fan_in_fan_out, "modules_to_save": lc.modules_to_save,
                   "lora_bias": getattr(lc, "lora_bias", False), "layer_replication": lc.layer_replication,
                   "trainable_token_indices": getattr(lc, "trainable_token_indices", None)}
    bad = {k: v for k, v in unsupported.items() if v}
    if lc.bias != "none":
        bad["bias"] = lc.bias
    if bad:
        raise _err(ad / ADAPTER_CONFIG, f"unsupported LoRA options {bad} (plain LoRA on linear projections only)")
    try:
        with safe_open(str(ad / ADAPTER_WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001
        raise _err(ad / ADAPTER_WEIGHTS, f"cannot be read: {type(e).__name__}: {e}") from None
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str, str], str] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _err(ad / ADAPTER_WEIGHTS, f"tensor {key!r} is not a LoRA weight of a text-model layer's projection")
        path, layer, block, module, ab = m.group(1), int(m.group(2)), m.group(3), m.group(4), m.group(5)
        pairs.setdefault((layer, block, module), {})[ab] = t
        paths[(layer, block, module)] = path
    if not pairs:
        raise _err(ad / ADAPTER_WEIGHTS, "holds no LoRA weights")
    out: dict[tuple[int, str], dict[str, tuple]] = {}
    for (layer, block, module), ab in sorted(pairs.items()):
        where = f"{ad / ADAPTER_WEIGHTS}: layers.{layer}.{block}.{module}"
        if layer >= cfg.num_layers:
            raise _err(where, f"layer {layer} does not exist (the model has {cfg.num_layers})")
        if layer < router_layer:
            raise _err(where, f"adapts layer {layer}, below router_layer {router_layer} (the router must read the "
                              "hidden state before any adapter acts)")
        sites = site_modules(cfg, layer)
        found = [(s, rows, fin) for s, (blk, mods, fin) in sites.items() if blk == block
                 for mod, rows in mods if mod == module]
        if not found:
            have = sorted(f"{blk}.{mod}" for blk, mods, _ in sites.values() for mod, _ in mods)
            raise _err(where, f"no such projection in layer {layer} ({cfg.layer_types[layer]}); it has {have}")
        site, rows, fin = found[0]
        if set(ab) != {"A", "B"}:
            raise _err(where, f"has lora_{''.join(ab)} without its pair")
        A, B = ab["A"].float(), ab["B"].float()
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != fin or B.shape[0] != rows or A.shape[0] != B.shape[1]:
            raise _err(where, f"lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not fit the projection "
                              f"({fin} -> {rows}): expected [r, {fin}] and [{rows}, r]")
        r = A.shape[0]
        mod_path = paths[(layer, block, module)]
        r_cfg = lc.rank_pattern.get(get_pattern_key(lc.rank_pattern.keys(), mod_path), lc.r)
        alpha = lc.alpha_pattern.get(get_pattern_key(lc.alpha_pattern.keys(), mod_path), lc.lora_alpha)
        if r != r_cfg:
            raise _err(where, f"rank {r} but adapter_config.json says r = {r_cfg}")
        scaling = alpha / math.sqrt(r) if lc.use_rslora else alpha / r
        if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
            raise _err(where, "weights are not finite")
        out.setdefault((layer, site), {})[module] = (A, B, float(scaling))
    return out


def load_specialists(folder, cfg: TextConfig, device="cpu", dtype=torch.float32) -> Specialists:
    """Read, check and stack a specialists folder for a model of config `cfg` (SpecialistsError when it is bad)."""
    d = Path(folder)
    if not d.is_dir():
        raise _err(d, "is not a folder")
    names, layer, eps, w, b = _read_router(d, cfg)
    if (d / names[0]).is_dir() and (d / names[0] / ADAPTER_CONFIG).exists():
        raise _err(d, f"route 0 ({names[0]!r}) is the trunk and must not have an adapter folder")
    adapters = [_read_adapter(d, n, cfg, layer) for n in names[1:]]
    stray = sorted(p.name for p in d.iterdir() if (p / ADAPTER_CONFIG).is_file() and p.name not in names)
    if stray:
        log.warning("specialists %s: adapter folders %s are not routes in %s and are not served", d, stray, ROUTER_JSON)
    sites: dict[tuple[int, str], Site] = {}
    for key in sorted({k for a in adapters for k in a}):
        i, site = key
        _, mods, fin = site_modules(cfg, i)[site]
        sites[key] = Site.stack(fin, mods, [a.get(key, {}) for a in adapters])
    dev = torch.device(device)
    lora = StackedLora(len(names), sites, dev, dtype)
    return Specialists(str(d), names, Router(layer, eps, w.to(dev), b.to(dev)), lora)
