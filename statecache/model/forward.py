"""The Qwen3.5 text forward over fused weights: embedding, decoder layers, final norm and the option head.

A layer's token mixer (GDN or gated attention) does its projections, norms, gates and rotary embedding here, and
hands the parts that carry state across tokens (the short conv, the delta rule, attention over keys) to a *mixer*:
statecache.run.batch's BatchMixer, packed sequences each continuing from its own saved state (or from nothing). Logits
are computed only at the answer slots and only
for each slot's option tokens (the output head's rows gathered per slot). This module knows nothing of checkpoints, graphs, rows or devices beyond its weights'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from statecache.kernels.fuse import Fused
from statecache.model.config import LINEAR
from statecache.model.loader import AttnWeights, GdnWeights, Weights

def rmsnorm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (w1 holds 1 + w, float32), computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w1).to(x.dtype)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN's output norm: plain weight w, normalised before the SiLU gate."""
    xf = x.float()
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rmsnorm(h: torch.Tensor, d: torch.Tensor, w1: torch.Tensor, eps: float):
    """The residual add and the next norm in one piece: (h + d, rmsnorm(h + d) in d's dtype)."""
    h = h + d
    return h, rmsnorm(h, w1, eps).to(d.dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, live: torch.Tensor | None):
    """a, b [T, Hv] -> log decay g (float32, <= 0) and write strength beta (model dtype). live [T] (bool) | None:
    padding tokens (live False) get g = 0 (no decay) and beta = 0 (no write), so the state stops at the real end."""
    g, beta = -A_log.exp() * F.softplus(a.float() + dt_bias), b.sigmoid()
    if live is not None:
        g, beta = g * live[:, None], beta * live[:, None].to(beta.dtype)
    return g, beta


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims of x [T, heads, D]; cos, sin [T, R] (halves repeated)."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    c, s = cos[:, None], sin[:, None]
    x1, x2 = xr[..., : R // 2], xr[..., R // 2 :]
    return torch.cat([xr * c + torch.cat([-x2, x1], -1) * s, xp], -1)


def norm_rotate(x: torch.Tensor, w1: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention's per-head q / k norm followed by the rotary embedding: x [T, heads, D]."""
    return rotate(rmsnorm(x, w1, eps), cos, sin)


def gate_output(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate: o, gate [T, Hq, D] -> o * sigmoid(gate) as [T, Hq * D]."""
    return (o * torch.sigmoid(gate)).flatten(1)


PIECES = (rmsnorm, add_rmsnorm, gated_rmsnorm, norm_rotate, silu_mul, gdn_gates, gate_output)
# each piece's arguments that hold a token per row (x [T, ...], cos / sin [T, R], live [T]); the rest are weights
TOKEN_ARGS = {rmsnorm: (0,), add_rmsnorm: (0, 1), gated_rmsnorm: (0, 1), norm_rotate: (0, 2, 3), silu_mul: (0,),
              gdn_gates: (0, 1, 4), gate_output: (0, 1)}


class Qwen35:
    """Fused-weight Qwen3.5 text model. `mix` objects supply the stateful parts (statecache.run.batch.BatchMixer)."""

    def __init__(self, weights: Weights, residual_fp32: bool = False):
        self.w = weights
        self.cfg = cfg = weights.cfg
        self.eps = cfg.rms_norm_eps
        self.dtype = weights.embed.dtype  # matmuls and activations
        # the residual stream in float32 (opt-in): on the CPU it moved a bf16 run of the 0.8B shape closer to float32
        # (max |dp| 0.0051 -> 0.0033) but not the 2B shape (0.0085 -> 0.0096); transformers keeps it 16-bit
        self.hdtype = torch.float32 if residual_fp32 else self.dtype
        self.device = weights.embed.device
        R = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float32, device=self.device) / R))
        # index of each layer among its kind: GDN state slot j, attention K/V slot a
        self.slot = {}
        for kind_layers in (cfg.linear_layers, cfg.full_layers):
            for j, i in enumerate(kind_layers):
                self.slot[i] = j
        # the elementwise pieces; `compile_elementwise` swaps in fused (torch.compile) versions on the GPU
        self.norm, self.add_norm, self.gnorm, self.qk_prep, self.act, self.gates, self.gate_out = PIECES

    def compile_elementwise(self, triton_pieces: bool = True) -> None:
        """Fuse the elementwise pieces with torch.compile (Triton on CUDA): one kernel each instead of several.
        Each falls back to its eager form, for good, if compiling it fails. On CUDA, triton_pieces: the residual
        add + norm, the MLP activation and GDN's gated norm take statecache.kernels.norm's kernels instead."""
        (self.norm, self.add_norm, self.gnorm, self.qk_prep, self.act, self.gates,
         self.gate_out) = (Fused(f, TOKEN_ARGS[f]) for f in PIECES)
        self.use_triton_pieces(triton_pieces)

    def use_triton_pieces(self, on: bool) -> None:
        """On CUDA: add_rmsnorm, silu_mul, gated_rmsnorm from statecache.kernels.norm (on) or torch.compile (off)."""
        if self.device.type != "cuda":
            return
        if on:
            from statecache.kernels import norm as norm_triton

            self.add_norm, self.act, self.gnorm = norm_triton.add_rmsnorm, norm_triton.silu_mul, norm_triton.gated_rmsnorm
        else:
            self.add_norm, self.act, self.gnorm = (Fused(f, TOKEN_ARGS[f])
                                                   for f in (add_rmsnorm, silu_mul, gated_rmsnorm))

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [T] (long), or [3, T] multimodal positions (temporal, height, width: image rows) -> cos, sin
        [T, rotary_dim] in the model dtype. [3, T] interleaves the sections as transformers' Qwen3.5 does: frequency
        j takes the height position when j % 3 == 1 and j < 3 * mrope_section[1], the width one likewise (% 3 == 2),
        else the temporal one; text tokens have all three equal, which is the 1-D rotary."""
        f = pos.float()[..., None] * self.inv_freq  # [T, R/2] or [3, T, R/2]
        if pos.dim() == 2:
            sec, f3 = self.cfg.mrope_section, f
            f = f3[0].clone()
            for d in (1, 2):
                f[:, d : 3 * sec[d] : 3] = f3[d][:, d : 3 * sec[d] : 3]
        f = torch.cat([f, f], -1)
        return f.cos().to(self.dtype), f.sin().to(self.dtype)

    @staticmethod
    def project(lora, i: int, site: str, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """x @ W.T, layer i's projection `site`; with specialists (`lora`) it does the projection, LoRA terms included."""
        return x @ W.T if lora is None else lora.project(i, site, x, W)

    def gdn(self, i: int, x: torch.Tensor, mix, lora=None) -> torch.Tensor:
        cfg, m = self.cfg, self.w.layers[i].mixer
        assert isinstance(m, GdnWeights)
        T = x.shape[0]
        C, vd, Hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
        y = self.project(lora, i, "in", x, m.in_w)
        qkv, z, b, a = torch.split(y, [C, vd, Hv, Hv], dim=-1)  # [T, C], [T, vd], [T, Hv] x2
        qkv = mix.conv(self.slot[i], qkv, m.conv_w)  # [T, C] after SiLU
        q, k, v = torch.split(qkv, [cfg.key_dim, cfg.key_dim, vd], dim=-1)
        q = q.reshape(T, -1, cfg.linear_key_head_dim)  # [T, Hk, Dk]
        k = k.reshape(T, -1, cfg.linear_key_head_dim)
        v = v.reshape(T, -1, cfg.linear_value_head_dim)  # [T, Hv, Dv]
        g, beta = self.gates(a, b, m.A_log, m.dt_bias, mix.live)  # [T, Hv] each: float32 log decay <= 0, model dtype
        o = mix.delta(self.slot[i], q, k, v, g, beta)  # [T, Hv, Dv]
        o = self.gnorm(o, z.reshape(T, Hv, -1), m.norm_w, self.eps)
        o = o.reshape(T, vd)
        return self.project(lora, i, "out", o, m.out_w)

    def attn(self, i: int, x: torch.Tensor, mix, rope, lora=None) -> torch.Tensor:
        cfg, m = self.cfg, self.w.layers[i].mixer
        assert isinstance(m, AttnWeights)
        T, Hq, Hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        y = self.project(lora, i, "qkv", x, m.qkv_w)
        qg, k, v = torch.split(y, [2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, gate = torch.chunk(qg.view(T, Hq, 2 * D), 2, dim=-1)  # [T, Hq, D] each
        cos, sin = rope
        q = self.qk_prep(q, m.q_norm, cos, sin, self.eps)
        k = self.qk_prep(k.view(T, Hkv, D), m.k_norm, cos, sin, self.eps)
        o = mix.attend(self.slot[i], q, k, v.view(T, Hkv, D), D**-0.5)  # [T, Hq, D]
        o = self.gate_out(o, gate)
        return self.project(lora, i, "o", o, m.o_w)

    def body(self, ids: torch.Tensor, pos: torch.Tensor, mix, lora=None, *, embeds=None) -> torch.Tensor:
        """ids [T], pos [T] or [3, T] (see rope) -> the last layer's hidden states [T, H] (before the final norm).
        embeds: None, or (index [k] long, values [k, H]): those tokens take these input embeddings instead of their
        ids' (image rows: the vision tower's output at the image-pad tokens).

        Each residual add is fused with the norm after it, so x is always the normed input of the next block.
        lora: None (the trunk), or a specialists binding (statecache.model.specialists.lora): it is attached to the weights
        (`attach`, a no-op once done), handed the hidden state entering its router's layer (`feature`) and does every
        projection, its routes' LoRA terms included (`project(i, site, x, W)` in place of x @ W.T)."""
        if lora is not None:
            lora.attach(self.w)
        layers = self.w.layers
        h = self.w.embed.index_select(0, ids).to(self.hdtype)  # [T, H]
        if embeds is not None:
            h.index_copy_(0, embeds[0], embeds[1].to(h.dtype))
        rope = self.rope(pos)
        x = self.norm(h, layers[0].in_norm, self.eps).to(self.dtype)
        for i, L in enumerate(layers):
            if lora is not None and i == lora.router_layer:
                lora.feature(h)
            d = self.gdn(i, x, mix, lora) if L.kind == LINEAR else self.attn(i, x, mix, rope, lora)  # [T, H]
            h, x = self.add_norm(h, d, L.post_norm, self.eps)
            d = self.project(lora, i, "down", self.act(self.project(lora, i, "gate_up", x, L.gate_up_w)), L.down_w)
            if i + 1 < len(layers):
                h, x = self.add_norm(h, d, layers[i + 1].in_norm, self.eps)
            else:
                h = h + d
            if (after := getattr(mix, "after_layer", None)) is not None:
                after(i)
        return h

    def option_probs(self, h: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """h [S, H] at the answer slots, options [S, K] long (statecache.run.graphs.fill_options: a token id, -2 - j for the
        j-th option letter, -1 past the slot's options) -> probabilities [S, K] over each slot's option tokens (zero
        past them). Gathers the K asked rows of the output head per slot: no full-vocabulary matmul."""
        letter = options <= -2
        tok = torch.where(letter, self.w.letter_ids[(-2 - options).clamp(0, self.w.letter_ids.numel() - 1)], options)
        w = self.w.head_w.index_select(0, tok.clamp(min=0).flatten()).view(*options.shape, -1)  # [S, K, H]
        x = self.norm(h, self.w.final_norm, self.eps).to(self.dtype)  # [S, H]
        logits = torch.bmm(w, x[:, :, None]).squeeze(-1).float()  # [S, K]
        return torch.softmax(logits.masked_fill(options == -1, float("-inf")), -1)
