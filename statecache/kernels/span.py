"""Span attention for a short chunk of queries over a long cached key span: flash decoding in Triton.

`attend_span(q, k, v, start, scale)` has the semantics of `TorchKernels.attend_span`: q [L, Hq, D] (query i at
position start + i), k, v [P, Hkv, D] (cached keys of positions [0, P), the chunk's own at [start, start + L)),
query i sees keys [0, start + i]; Hq = R * Hkv, query head h uses KV head h // R. Returns [L, Hq, D] in q's dtype.

Two kernels:
- split: grid (row blocks, splits, Hkv). The R * L query rows of one KV head (row = query * R + head in group) are
  the M dimension, so a key tile is read by one program per row block, not per query head. Each row block's visible
  keys [0, start + last query of the block] are cut into `n_splits` runs of whole BLOCK_N tiles, sized at run time
  from `start` (read on the device), so every split has work whatever the cached length; online softmax in float32
  (exp2, log2(e) folded into the scale), probabilities cast to v's dtype for the PV dot. Writes each split's
  normalised partial output (float32) and its log2-sum-exp (-inf for a split that saw no key; its output is then
  not written). With one split it writes o directly and the combine is skipped.
- combine: grid (R * L, Hkv); weights the splits by exp2(lse - max) and writes o.

The grid depends on shapes only (`start` is never read on the host), so the call is CUDA-graph capturable once
the kernels are compiled (warm up before capture). Keys past start + L (garbage in a bucketed cache) are never
loaded. Strides are passed, so q, k, v may be views (k, v: K[a, :P] of a bigger buffer).

Head dim: a power of two >= 16 (256 in the real models). A split gets at least `min_split_keys` keys, so a short
span uses fewer splits (the others see no key and cost one lse store).

`attend_batch` does the same for the packed sequences of a batch (statecache.run.batch): a grid axis over sequences
and KV heads; each sequence reads its cached keys from its own buffer (an element offset from the chunk's keys, so
a group's K/V are addressed where they are stored, never copied) and its own chunk's keys from the chunk.

It knows nothing of layers, caches or the other kernels; the block sizes, warps, stages and split rule are
arguments so a benchmark can pick them (bench/gpu_check_span.py). The defaults are the fastest of that sweep on an
H200 at the 9B shape, 64 queries over 5120 keys (bench/results/s3_run2/span_check.json): 27 us, against 41 us for
64 x 64 tiles with 8 warps, 104 us for two batched matmuls and 128 us for FlashAttention.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _span_split_kernel(
    Q, K, V, START, O, OP, LSE,
    stride_ql, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kd,
    stride_vp, stride_vh, stride_vd,
    stride_ol, stride_oh, stride_od,
    L, P, n_splits, min_tiles, qk_scale,
    R: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    n_kv = tl.num_programs(2)
    M = L * R
    start = tl.load(START).to(tl.int32)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row = query * R + head in group
    row_ok = rows < M
    qi = rows // R  # [BM] query index
    head = kvh * R + rows % R  # [BM] query head
    dd = tl.arange(0, D)  # [D]
    q = tl.load(Q + qi[:, None] * stride_ql + head[:, None] * stride_qh + dd[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BM, D]
    limit = start + qi  # [BM] last key each row sees

    # This block sees keys [0, end); its split owns tiles [split * tiles, (split + 1) * tiles), at least min_tiles
    # (with a short span the last splits get nothing).
    last_q = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // R, L - 1)
    end = tl.minimum(start + last_q + 1, P)
    tiles = tl.maximum(tl.cdiv(tl.cdiv(end, BLOCK_N), n_splits), min_tiles)
    lo = split * tiles * BLOCK_N
    hi = tl.minimum(lo + tiles * BLOCK_N, end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BM] running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BM] running sum
    acc = tl.zeros([BLOCK_M, D], tl.float32)  # [BM, D]
    cn = tl.arange(0, BLOCK_N)  # [BN]
    for n in range(lo, hi, BLOCK_N):
        cols = n + cn  # [BN]
        col_ok = cols < hi
        kt = tl.load(K + cols[:, None] * stride_kp + kvh * stride_kh + dd[None, :] * stride_kd,
                     mask=col_ok[:, None], other=0.0)  # [BN, D]
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
        s = tl.where((cols[None, :] <= limit[:, None]) & col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep p = 0, no NaN
        alpha = tl.exp2(m_i - m_use)  # [BM]
        p = tl.exp2(s - m_use[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(V + cols[:, None] * stride_vp + kvh * stride_vh + dd[None, :] * stride_vd,
                     mask=col_ok[:, None], other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new

    seen = l_i > 0.0  # [BM]
    l_use = tl.where(seen, l_i, 1.0)
    o = acc / l_use[:, None]  # [BM, D]
    if DIRECT:
        tl.store(O + qi[:, None] * stride_ol + head[:, None] * stride_oh + dd[None, :] * stride_od,
                 o.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (split * n_kv + kvh) * M + rows  # [BM] row of the [n_splits, Hkv, M] partials
        tl.store(LSE + part, tl.where(seen, m_i + tl.log2(l_use), float("-inf")), mask=row_ok)
        tl.store(OP + part[:, None] * D + dd[None, :], o, mask=(row_ok & seen)[:, None])


@triton.jit
def _span_combine_kernel(
    OP, LSE, O,
    stride_ol, stride_oh, stride_od,
    M, n_splits,
    R: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    n_kv = tl.num_programs(1)
    sp = tl.arange(0, BLOCK_S)  # [BS]
    part = (sp * n_kv + kvh) * M + row  # [BS]
    lse = tl.load(LSE + part, mask=sp < n_splits, other=float("-inf"))  # [BS]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BS], 0 for a split that saw no key (its partial is not read)
    dd = tl.arange(0, D)  # [D]
    op = tl.load(OP + part[:, None] * D + dd[None, :], mask=(w > 0.0)[:, None], other=0.0)  # [BS, D]
    tot = tl.sum(w, 0)
    o = tl.sum(op * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)  # [D]
    qi = row // R
    head = kvh * R + row % R
    tl.store(O + qi * stride_ol + head * stride_oh + dd * stride_od, o.to(O.dtype.element_ty))


@triton.jit
def _span_batch_kernel(
    Q, K, V, CU, START, OFF, O, OP, LSE,
    stride_ql, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kd,
    stride_ol, stride_oh, stride_od,
    Hkv, M_all, n_splits, min_tiles, qk_scale,
    R: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """_span_split_kernel for sequence b = program_id(2) // Hkv of a packed batch: its queries are rows
    [cu[b], cu[b + 1]) of Q at positions start[b] + i; its keys [0, start[b]) are read from its group's buffer at
    element offset OFF[b, 0] (keys) / OFF[b, 1] (values) from K / V, keys [start[b], start[b] + i] are its own
    chunk's rows of K / V (the same strides). Partials are indexed by global row (token * R + head in group)."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2) // Hkv
    kvh = tl.program_id(2) % Hkv
    bos = tl.load(CU + b)
    L = tl.load(CU + b + 1) - bos
    start = tl.load(START + b)
    # element offsets of a group's K[a] / V[a]: multiples of 16 (the allocator aligns every tensor to 512 bytes and
    # a layer of [p, Hkv, D] spans a multiple of D >= 16 elements); said so, the key and value loads are vectorised
    koff = tl.multiple_of(tl.load(OFF + 2 * b), 16)
    voff = tl.multiple_of(tl.load(OFF + 2 * b + 1), 16)
    M = L * R

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row = query * R + head in group
    row_ok = rows < M
    qi = rows // R  # [BM] query index within the sequence
    head = kvh * R + rows % R  # [BM] query head
    dd = tl.arange(0, D)  # [D]
    q = tl.load(Q + (bos + qi)[:, None] * stride_ql + head[:, None] * stride_qh + dd[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)  # [BM, D]
    limit = start + qi  # [BM] last key each row sees

    last_q = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // R, L - 1)
    end = start + last_q + 1  # this block sees keys [0, end) (<= start when it has no row)
    tiles = tl.maximum(tl.cdiv(tl.cdiv(end, BLOCK_N), n_splits), min_tiles)
    lo = split * tiles * BLOCK_N
    hi = tl.minimum(lo + tiles * BLOCK_N, end)
    hi = tl.where(pid_m * BLOCK_M < M, hi, lo)  # a row block past this sequence's rows: no work

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    cn = tl.arange(0, BLOCK_N)
    for n in range(lo, hi, BLOCK_N):
        cols = n + cn  # [BN] key positions
        col_ok = cols < hi
        cached = cols < start
        # the row of each key: in the group's buffer below start, in the chunk's rows from start on
        kr = tl.where(cached, koff + cols.to(tl.int64) * stride_kp, (bos + cols - start).to(tl.int64) * stride_kp)
        vr = tl.where(cached, voff + cols.to(tl.int64) * stride_kp, (bos + cols - start).to(tl.int64) * stride_kp)
        kt = tl.load(K + kr[:, None] + kvh * stride_kh + dd[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
        s = tl.where((cols[None, :] <= limit[:, None]) & col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(V + vr[:, None] + kvh * stride_kh + dd[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new

    seen = l_i > 0.0
    l_use = tl.where(seen, l_i, 1.0)
    o = acc / l_use[:, None]
    if DIRECT:
        tl.store(O + (bos + qi)[:, None] * stride_ol + head[:, None] * stride_oh + dd[None, :] * stride_od,
                 o.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (split * Hkv + kvh) * M_all + (bos * R + rows)  # [BM] global row of the [n_splits, Hkv, M_all] partials
        tl.store(LSE + part, tl.where(seen, m_i + tl.log2(l_use), float("-inf")), mask=row_ok)
        tl.store(OP + part[:, None] * D + dd[None, :], o, mask=(row_ok & seen)[:, None])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(P: int, Hkv: int, rows: int, block_m: int, block_n: int, min_tiles: int, sms: int,
                programs_per_sm: float = 2.0) -> int:
    """The default split rule: enough splits that Hkv * row blocks * splits programs fill programs_per_sm * sms,
    at most one per min_tiles key tiles of the span. Depends on shapes only (never on start)."""
    blocks = Hkv * triton.cdiv(rows, block_m)
    return max(1, min(triton.cdiv(triton.cdiv(P, block_n), min_tiles), int(programs_per_sm * sms) // blocks))


def _partials(o: torch.Tensor, n_splits: int, Hkv: int, M: int, D: int, lse_fill: float | None):
    """The per-split partial outputs [n_splits, Hkv, M, D] and log-sum-exps [n_splits, Hkv, M] (float32; lse filled
    with lse_fill unless None); (o, o), never touched, when there is one split (the kernel writes o directly)."""
    if n_splits == 1:
        return o, o
    op = torch.empty(n_splits, Hkv, M, D, device=o.device, dtype=torch.float32)
    lse = torch.empty(n_splits, Hkv, M, device=o.device, dtype=torch.float32)
    if lse_fill is not None:
        lse.fill_(lse_fill)
    return op, lse


def _combine(op: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, M: int, Hkv: int, n_splits: int, R: int, D: int):
    """Merge the splits' partial outputs into o (softmax-weighted by their log-sum-exps)."""
    _span_combine_kernel[(M, Hkv)](
        op, lse, o, o.stride(0), o.stride(1), o.stride(2), M, n_splits,
        R=R, D=D, BLOCK_S=triton.next_power_of_2(n_splits), num_warps=4,
    )


def attend_span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float, *,
                block_m: int = 64, block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
                n_splits: int | None = None, programs_per_sm: float = 2.0, min_split_keys: int = 256) -> torch.Tensor:
    """q [L, Hq, D], k, v [P, Hkv, D] (any strides; D a power of two >= 16), start (long scalar tensor on q's
    device), scale -> o [L, Hq, D] in q's dtype; query i sees keys [0, start + i].
    n_splits: None picks `split_count`; each used split gets at least min_split_keys keys (rounded up to tiles)."""
    L, Hq, D = q.shape
    P, Hkv = k.shape[0], k.shape[1]
    assert v.shape[:2] == (P, Hkv) and k.shape[2] == D and v.shape[2] == D and Hq % Hkv == 0
    assert D >= 16 and D & (D - 1) == 0, f"head dim {D}: a power of two >= 16 only"
    R = Hq // Hkv
    M = R * L  # rows per KV head: row = query * R + head in group
    min_tiles = max(1, triton.cdiv(min_split_keys, block_n))
    if n_splits is None:
        sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
        n_splits = split_count(P, Hkv, M, block_m, block_n, min_tiles, sms, programs_per_sm)
    o = torch.empty(L, Hq, D, device=q.device, dtype=q.dtype)
    direct = n_splits == 1
    op, lse = _partials(o, n_splits, Hkv, M, D, lse_fill=None)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 would round float32 inputs; half ignores it
    _span_split_kernel[(triton.cdiv(M, block_m), n_splits, Hkv)](
        q, k, v, start, o, op, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        L, P, n_splits, min_tiles, scale * LOG2E,
        R=R, D=D, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, DOT_PREC=prec,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _combine(op, lse, o, M, Hkv, n_splits, R, D)
    return o


def attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, starts: torch.Tensor,
                 off: torch.Tensor, lmax: int, scale: float, *, max_keys: int = 8192, block_m: int = 64,
                 block_n: int = 32, num_warps: int = 4, num_stages: int = 2, n_splits: int | None = None,
                 programs_per_sm: float = 2.0, min_split_keys: int = 256, split_lmax: int | None = None) -> torch.Tensor:
    """attend_span for B packed sequences. q [T, Hq, D]; k, v [T, Hkv, D] contiguous: the chunk's own keys and values
    (sequence b: rows [cu[b], cu[b + 1]), at most lmax, at positions starts[b] + i); off [B, 2] int64: element
    offsets from k / v of sequence b's cached keys / values of [0, starts[b]) (a buffer with k's row and head
    strides, anywhere in memory: a group's K[a]; every offset a multiple of 16, as any layer of a tensor the
    allocator made is: the kernel loads 16-element vectors); cu [B + 1], starts [B] long on the device -> o [T, Hq, D],
    zero for tokens of no sequence. max_keys (the longest span any sequence may have) and split_lmax (the sequence
    length to size the key splits for, default lmax: a graph built for long pieces but mostly replayed with short
    ones keeps the short ones' splits) size the split rule; graph-safe."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    B = starts.shape[0]
    assert k.shape == (T, Hkv, D) and v.shape == k.shape and k.is_contiguous() and v.is_contiguous()
    assert Hq % Hkv == 0 and D >= 16 and D & (D - 1) == 0 and off.shape == (B, 2) and cu.shape == (B + 1,)
    R = Hq // Hkv
    Mb = R * max(lmax, 1)  # rows of the longest sequence
    min_tiles = max(1, triton.cdiv(min_split_keys, block_n))
    if n_splits is None:
        sms = _sm_count(q.device.index or 0) if q.is_cuda else 132
        rows = Mb if split_lmax is None else R * max(min(split_lmax, lmax), 1)
        n_splits = split_count(max_keys, Hkv * B, rows, block_m, block_n, min_tiles, sms, programs_per_sm)
    o = torch.zeros(T, Hq, D, device=q.device, dtype=q.dtype)
    direct = n_splits == 1
    M_all = R * T
    op, lse = _partials(o, n_splits, Hkv, M_all, D, lse_fill=float("-inf"))  # a program may skip rows: -inf
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    off = off.contiguous()
    _span_batch_kernel[(triton.cdiv(Mb, block_m), n_splits, Hkv * B)](
        q, k, v, cu, starts, off, o, op, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        Hkv, M_all, n_splits, min_tiles, scale * LOG2E,
        R=R, D=D, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, DOT_PREC=prec,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _combine(op, lse, o, M_all, Hkv, n_splits, R, D)
    return o
