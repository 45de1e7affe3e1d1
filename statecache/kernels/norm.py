"""Two of the model's elementwise pieces as single-pass Triton kernels, one program per token row.

- `add_rmsnorm(h, d, w1, eps)`: the residual add and the next zero-centred RMSNorm (statecache.model.forward.add_rmsnorm):
  h + d rounded to h's dtype, then normalised in float32 and scaled by w1 (float32, 1 + w), in d's dtype.
- `silu_mul(gate_up)`: the MLP's activation, [T, 2I] (gate | up) -> silu(gate) * up [T, I].
- `gated_rmsnorm(x, gate, w, eps)`: GDN's output norm per head (plain weight w) times silu(gate)
  (statecache.model.forward.gated_rmsnorm); one program per token, all heads.

torch.compile's versions of these loop over each 4096-wide row twice with few programs; at the 64 rows of a short
chunk they took ~4.3 us each on an H200 (bench/README.md), most of it latency. Here a row is read once, held in
registers, and written once. Same arithmetic as the eager pieces (float32 inside, rounding at the same points).
This module knows nothing of layers or weights beyond the vectors it is handed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(h, d, w1, h_out, x_out, sh, sd, sho, sxo, N, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)  # [BLOCK] features
    m = c < N
    hs = tl.load(h + r * sh + c, mask=m, other=0.0).to(tl.float32) + tl.load(d + r * sd + c, mask=m, other=0.0).to(tl.float32)
    hs = hs.to(h_out.dtype.element_ty)  # the residual stream keeps h's dtype
    tl.store(h_out + r * sho + c, hs, mask=m)
    xf = hs.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w1 + c, mask=m, other=0.0)
    tl.store(x_out + r * sxo + c, (xf * inv * w).to(x_out.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(gu, out, sg, so, I, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] features of the half
    m = c < I
    g = tl.load(gu + r * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + r * sg + I + c, mask=m, other=0.0).to(tl.float32)
    # eager rounds silu(gate) to the model dtype before the product; so do we
    s = (g * tl.sigmoid(g)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + r * so + c, (s * u).to(out.dtype.element_ty), mask=m)


@triton.jit
def _gated_rmsnorm_kernel(x, gate, w, out, sx, sg, so, H, D, eps, BH: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BH)  # [BH] heads
    dd = tl.arange(0, BD)  # [BD] head dims
    m = (hh < H)[:, None] & (dd < D)[None, :]
    off = hh[:, None] * D + dd[None, :]  # [BH, BD] within a token row (heads contiguous)
    xv = tl.load(x + r * sx + off, mask=m, other=0.0)
    xf = xv.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)  # [BH]
    n = (xf * inv[:, None]).to(xv.dtype)  # normalised, rounded to the model dtype as in eager
    wv = tl.load(w + dd, mask=dd < D, other=0.0)
    y = (wv[None, :] * n).to(xv.dtype).to(tl.float32)
    gf = tl.load(gate + r * sg + off, mask=m, other=0.0).to(tl.float32)
    tl.store(out + r * so + off, (y * (gf * tl.sigmoid(gf))).to(out.dtype.element_ty), mask=m)


def _heads_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with heads and dims contiguous within a token row (any row stride)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [T, H, D], w [D] (model dtype) -> [T, H, D] in x's dtype, as statecache.model.forward.gated_rmsnorm."""
    x, gate = _heads_rows(x), _heads_rows(gate)
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    BH, BD = triton.next_power_of_2(H), triton.next_power_of_2(D)
    _gated_rmsnorm_kernel[(T,)](x, gate, w, out, x.stride(0), gate.stride(0), out.stride(0), H, D, eps, BH=BH, BD=BD,
                                num_warps=min(16, max(1, BH * BD // 512)))
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rmsnorm(h: torch.Tensor, d: torch.Tensor, w1: torch.Tensor, eps: float):
    """h, d [T, N] -> (h + d in h's dtype, rmsnorm(h + d) * w1 in d's dtype), as statecache.model.forward.add_rmsnorm."""
    h, d = _rows(h), _rows(d)
    T, N = h.shape
    h_out = torch.empty_like(h, dtype=torch.result_type(h, d))
    x_out = torch.empty(T, N, dtype=d.dtype, device=d.device)
    BLOCK = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(T,)](h, d, w1, h_out, x_out, h.stride(0), d.stride(0), h_out.stride(0), x_out.stride(0),
                              N, eps, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 512)))
    return h_out, x_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I], as statecache.model.forward.silu_mul."""
    gate_up = _rows(gate_up)
    T, I2 = gate_up.shape
    I = I2 // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = min(4096, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), I, BLOCK=BLOCK,
                                                 num_warps=min(8, max(1, BLOCK // 512)))
    return out
