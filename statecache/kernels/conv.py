"""The GDN layer's short causal conv for one short chunk continuing from saved inputs, as one Triton kernel.

`conv_chunk(x, w, tail, real)` computes silu(depthwise causal conv) over [tail | x] for the chunk's rows and then
overwrites `tail` with the last W - 1 *real* inputs of [tail | x[:real]] (padding rows past `real` never enter it).
It replaces, for chunks of at most `MAX_ROWS` tokens, the three kernels of the generic path (concatenate, fla's conv,
gather the new tail). One program owns a block of channels for every row, so the tail it overwrites is read by no
other program; a barrier orders its own reads of the old tail before the writes.

Shapes: x [L, C] (rows may be strided: a slice of the projection output), w [C, W], tail [W - 1, C] (contiguous),
real: a long scalar device tensor (graph-safe: read inside the kernel). Returns y [L, C] in x's dtype.
`conv_batch` runs the same kernel over the packed sequences of a batch (statecache.run.batch): a grid axis over the
sequences, each with its own rows (cu_seqlens, on the device) and its own tail.
This module knows nothing of layers, heads or the delta rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 128  # conv_chunk: one program holds all rows of its channel block
BLOCK_ROWS = 64  # conv_batch: a program runs its sequence's rows in blocks of this many (any length)


@triton.jit
def _conv_chunk_kernel(x, sx, w, tail, y, sy, real_ptr, L, C, cu_ptr, s_tail,
                       W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, VARLEN: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)  # [BC] channels
    cm = c < C
    if VARLEN:  # sequence b of a packed batch: rows [cu[b], cu[b + 1]), its own tail, no padding rows
        b = tl.program_id(1)
        bos = tl.load(cu_ptr + b)
        L = tl.load(cu_ptr + b + 1) - bos
        real = L
        x += bos * sx
        y += bos * sy
        tail += b * s_tail
    else:
        real = tl.load(real_ptr)
    for blk in range(0, tl.cdiv(L, BT)):  # blocks of BT rows, in order (only the first reads the old tail)
        t = blk * BT + tl.arange(0, BT)  # [BT] chunk rows
        tm = t < L
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(W):  # tap i reads ext[t + i], ext = [tail (W - 1 rows) | x]
            e = t + i  # [BT]
            in_tail = e < W - 1
            xt = tl.load(tail + e[:, None] * C + c[None, :], mask=(in_tail & tm)[:, None] & cm[None, :], other=0.0)
            xx = tl.load(x + (e - (W - 1))[:, None] * sx + c[None, :], mask=(~in_tail & tm)[:, None] & cm[None, :],
                         other=0.0)
            wi = tl.load(w + c * W + i, mask=cm, other=0.0).to(tl.float32)  # [BC]
            acc += (xt.to(tl.float32) + xx.to(tl.float32)) * wi[None, :]
        out = acc * tl.sigmoid(acc)  # SiLU, [BT, BC]
        tl.store(y + t[:, None] * sy + c[None, :], out.to(y.dtype.element_ty), mask=tm[:, None] & cm[None, :])
    # the new tail: ext[real + r] for r < W - 1
    r = tl.arange(0, BW)  # [BW]
    e = real + r
    rm = r < W - 1
    in_tail = e < W - 1
    nt = tl.load(tail + e[:, None] * C + c[None, :], mask=(rm & in_tail)[:, None] & cm[None, :], other=0.0)
    nx = tl.load(x + (e - (W - 1))[:, None] * sx + c[None, :], mask=(rm & ~in_tail)[:, None] & cm[None, :], other=0.0)
    tl.debug_barrier()  # every read of the old tail (above and in the taps) before it is overwritten
    tl.store(tail + r[:, None] * C + c[None, :], (nt + nx).to(tail.dtype.element_ty), mask=rm[:, None] & cm[None, :])


def conv_chunk(x: torch.Tensor, w: torch.Tensor, tail: torch.Tensor, real: torch.Tensor, block_c: int = 64) -> torch.Tensor:
    """silu(causal depthwise conv over [tail | x]) -> y [L, C]; tail [W - 1, C] becomes the last W - 1 real inputs."""
    L, C = x.shape
    W = w.shape[1]
    if L > MAX_ROWS:
        raise ValueError(f"conv_chunk takes at most {MAX_ROWS} rows, got {L}")
    if x.stride(1) != 1 or not tail.is_contiguous() or not w.is_contiguous():
        raise ValueError("conv_chunk needs unit channel stride in x and contiguous w and tail")
    y = torch.empty(L, C, dtype=x.dtype, device=x.device)
    BT = max(16, triton.next_power_of_2(L))
    grid = (triton.cdiv(C, block_c),)
    _conv_chunk_kernel[grid](x, x.stride(0), w, tail, y, y.stride(0), real, L, C, real, 0,
                             W=W, BT=BT, BC=block_c, BW=max(2, triton.next_power_of_2(W - 1)), VARLEN=False)
    return y


def conv_batch(x: torch.Tensor, w: torch.Tensor, tails: torch.Tensor, cu: torch.Tensor, lmax: int,
               block_c: int = 64) -> torch.Tensor:
    """conv_chunk for B packed sequences: x [T, C] (sequence b: rows [cu[b], cu[b + 1]), at most lmax of them, all
    real, run in blocks of BLOCK_ROWS), tails [B, W - 1, C] (sequence b's saved inputs, updated in place), cu [B + 1]
    (long, on the device) -> y [T, C]; rows of no sequence (past cu[B]) come out zero."""
    T, C = x.shape
    W = w.shape[1]
    B = tails.shape[0]
    if x.stride(1) != 1 or not tails.is_contiguous() or not w.is_contiguous():
        raise ValueError("conv_batch needs unit channel stride in x and contiguous w and tails")
    y = torch.zeros(T, C, dtype=x.dtype, device=x.device)
    BT = max(16, triton.next_power_of_2(min(max(lmax, 1), BLOCK_ROWS)))
    _conv_chunk_kernel[(triton.cdiv(C, block_c), B)](x, x.stride(0), w, tails, y, y.stride(0), cu, 0, C, cu,
                                                     tails.stride(0), W=W, BT=BT, BC=block_c,
                                                     BW=max(2, triton.next_power_of_2(W - 1)), VARLEN=True)
    return y
