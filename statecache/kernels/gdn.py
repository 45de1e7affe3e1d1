"""One chunk (at most 64 tokens) of the gated delta rule in a single Triton kernel, continuing a float32 state.

`delta_chunk(q, k, v, g, beta, S)` does what fla's chunked gated delta rule does for one sequence of L <= 64 tokens
(L2-normalising q and k, local cumsum of the gate, the WY solve, the state update and the output) in one launch,
instead of fla's chain of about seven kernels. The maths is `kernels.delta_rule_reference` for a single chunk:

    cg = cumsum(g)                                        # [T]  log decay from the chunk start
    A  = strictly-lower(kn kn^T * exp(cg_i - cg_j)) * beta_i   # [T, T]
    u  = (I + A)^-1 (beta * (v - (kn * exp(cg)) S))       # [T, Dv]
    o  = (qn * exp(cg)) S + lower(qn kn^T * exp(cg_i - cg_j)) u
    S' = S * exp(cg_last) + (kn * exp(cg_last - cg))^T u

Design:
- Grid (Hv, Dv // BV): a program owns one value head and a BV-wide slice of the value dim (and of the state).
  The triangular solve does not depend on v, so each program of a head recomputes it: duplicated work, but no
  chain across programs and no intermediate in global memory.
- The solve has no sequential loop: it inverts the unit lower-triangular I + A by recursive block doubling.
  D starts as the inverse of the 1x1 diagonal blocks (I); merging pairs of b-blocks into 2b-blocks is
  D <- D - D Lo_b D, where Lo_b keeps the entries of A in the lower-left b x b block of each 2b-block (the
  standard block formula [[X, 0], [-Y L21 X, Y]]). The first level is free (D = I - Lo_1), the top level is
  applied to the right-hand side instead of being formed (u = y - D (Lo y), y = D rhs): for T = 64 that is
  8 dots of 64x64x64 and 3 of 64x64xBV, all tl.dot. The cheaper product form (I - A)(I + A^2)(I + A^4)...
  was rejected: its powers of A blow up when keys are correlated (cosine ~0.5, weak decay: relative error
  1e+1 in float32, 1e+5 with tf32, where this form stays below 1e-3 with tf32); the tests include such keys.
- Float32 maths; the dots take raw q and k rows over BK-wide slices of the key dim, and the L2 norms (summed in
  float32 from the same loads) scale their results. On the GPU, q k^T and k k^T run on 16-bit rows as they come
  (exact products, float32 sums: RAW_QK); elsewhere on float32 copies (Triton's interpreter multiplies bf16
  operands' bit patterns as integers). Keys and the old state are read before the solve (A and the right-hand
  side); queries, keys again and the state after it (scores, output, state update), so that no [T, Dk] tile
  stays in registers through the solve. The slice loops are plain `range` loops, which Triton pipelines through
  shared memory. Compiled for sm_90 without a GPU (Triton 3.6, bf16 inputs, Dk = 128, T = 64, BV = 32): ptxas
  reports no spills with 8 warps, 80 bytes with 4, more for BV = 64 with 4 warps or BV = 128. Measured on an H200
  at the 9B shape, 64 tokens (bench/results/s3_run3/gdn_check.json): BV = 32 with 4 warps (the default) 16.3 us,
  with 8 warps 19.8 us, BV = 64 25.6 us, BV = 128 48.5 us; fla's chain of kernels took ~33 us in the hit's profile.
- `dot_precision` ("tf32" by default, "tf32x3" or "ieee" for more accuracy) sets the float32 dots' input
  precision (Triton's interpreter ignores it). The gate runs through exp2 of a cumsum scaled by log2(e), as in fla.
- T, the row block, is the next power of two >= L (16, 32 or 64): masked rows load as zero (g = beta = 0, zero
  k), so they neither decay nor write the state. Padding tokens inside L must come with g = 0 and beta = 0.
- Inputs may be strided views: the wrapper passes strides, never copies. Nothing is allocated but the output,
  there is no host sync: the call can be captured in a CUDA graph.

`delta_batch` runs the same kernel over the packed sequences of a batch (statecache.run.batch): a third grid axis over
the sequences, each with its own tokens (cu_seqlens, on the device) and its own state; a program runs its
sequence's chunks one after another (its slice of the state is its own throughout), and may also keep the state
at chunk ends inside the sequence (snapshots). A sequence's first chunk may read its state from anywhere (an
element offset from its slot: a checkpoint's own tensor, never copied) and its last chunk may leave the final
state unwritten (a question's, which nobody reads).

What it does not know: several chunks of one sequence in one `delta_chunk` call (chain calls for more),
initial-state-free starts (pass zeros), backward passes, gates > 0 (exp would overflow, as in the reference).
Its speed and its precision with tf32 are only known from the GPU check (bench/gpu_check_gdn.py); the CPU tests
run it in Triton's interpreter in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
MAX_TOKENS = 64  # one chunk: the most tokens a call takes
WIDE_KEYS = 64  # on CUDA, 33..MAX_TOKENS tokens need key slices at least this wide (see delta_chunk)


@triton.jit
def _lower_left(t, b: tl.constexpr):
    """[T, T] mask of the lower-left b x b block of every 2b x 2b diagonal block."""
    bi = t // b  # [T]
    return (bi[:, None] == bi[None, :] + 1) & (bi[None, :] % 2 == 0)


@triton.jit(do_not_specialize=["L"])
def _delta_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr,
    L,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
    sg_t, sg_h, sb_t, sb_h, ss_h, ss_k, ss_v, so_t, so_h, so_d,
    scale, cu_ptr, ss_b, snap_ptr, at_ptr, ss_n, soff_ptr, keep_ptr,
    GROUP: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr,
    BV: tl.constexpr, DOT: tl.constexpr, RAW_QK: tl.constexpr, STORE: tl.constexpr, VARLEN: tl.constexpr,
    NSNAP: tl.constexpr, SRC: tl.constexpr,
):
    if VARLEN:  # sequence b of a packed batch: its tokens [cu[b], cu[b + 1]) in chunks of BT, its own state
        b = tl.program_id(2)
        bos = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - bos  # 0 for an empty sequence (a graph's padding): nothing to do
        s_ptr += b * ss_b
        if SRC:  # the state to continue lies elsewhere (a checkpoint's own tensor): its element offset from slot b
            soff = tl.load(soff_ptr + b)
            keep = tl.load(keep_ptr + b)  # 1: the final state goes to slot b too (0: only the states before it)
        else:
            soff = 0
            keep = 1
        # snapshots (NSNAP > 0): the state after the sequence's first at[b, m, 0] tokens (any position inside it;
        # 0: none) also goes to slot at[b, m, 1] of snap; the chunks are cut there, so a chunk ends at each one
        at_b = at_ptr + b * 2 * NSNAP
        x0, snap0 = _snap_slot(at_b, 0, NSNAP, snap_ptr, ss_n)
        x1, snap1 = _snap_slot(at_b, 1, NSNAP, snap_ptr, ss_n)
        x2, snap2 = _snap_slot(at_b, 2, NSNAP, snap_ptr, ss_n)
        cur = n * 0  # the chunks in order, each at most BT tokens and none across a snapshot; this program owns
        while cur < n:  # its slice of the state throughout
            end = tl.minimum(cur + BT, n)
            if NSNAP > 0:
                end = tl.where((x0 > cur) & (x0 < end), x0, end)
                end = tl.where((x1 > cur) & (x1 < end), x1, end)
                end = tl.where((x2 > cur) & (x2 < end), x2, end)
            Lc = end - cur
            t0 = bos + cur
            if SRC:
                src = tl.multiple_of(tl.where(cur == 0, soff, 0), 16)  # the first chunk reads the source, later slot b
                write = ((keep != 0) | (end < n)).to(tl.int32)
            else:
                src = 0
                write = 1
            _delta_chunk(q_ptr + t0 * sq_t, k_ptr + t0 * sk_t, v_ptr + t0 * sv_t, g_ptr + t0 * sg_t, b_ptr + t0 * sb_t,
                         s_ptr, o_ptr + t0 * so_t, Lc, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
                         sg_t, sg_h, sb_t, sb_h, ss_h, ss_k, ss_v, so_t, so_h, so_d, scale,
                         snap0, x0 == end, snap1, x1 == end, snap2, x2 == end, src, write,
                         GROUP, DK, BK, BT, LOG_BT, BV, DOT, RAW_QK, STORE, NSNAP, SRC)
            tl.debug_barrier()  # this chunk's state writes before the next chunk's reads (other threads)
            cur = end
    else:
        no = L < 0
        _delta_chunk(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, L, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d,
                     sv_t, sv_h, sv_d, sg_t, sg_h, sb_t, sb_h, ss_h, ss_k, ss_v, so_t, so_h, so_d, scale,
                     s_ptr, no, s_ptr, no, s_ptr, no, 0, 1, GROUP, DK, BK, BT, LOG_BT, BV, DOT, RAW_QK, STORE, 0, False)


@triton.jit
def _snap_slot(at_b, m: tl.constexpr, NSNAP: tl.constexpr, snap_ptr, ss_n):
    """Snapshot m of a sequence (its row of `at` at at_b): (its position, -1 for none, its slot's address); a
    snapshot past NSNAP is none."""
    if m < NSNAP:
        x = tl.load(at_b + 2 * m)
        x = tl.where(x > 0, x, -1)
        ptr = snap_ptr + tl.maximum(tl.load(at_b + 2 * m + 1), 0) * ss_n
    else:
        x = -1
        ptr = snap_ptr
    return x, ptr


@triton.jit
def _delta_chunk(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, L,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
    sg_t, sg_h, sb_t, sb_h, ss_h, ss_k, ss_v, so_t, so_h, so_d, scale,
    snap0, hit0, snap1, hit1, snap2, hit2, src, write,
    GROUP: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr,
    BV: tl.constexpr, DOT: tl.constexpr, RAW_QK: tl.constexpr, STORE: tl.constexpr, NSNAP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One chunk of L <= BT tokens at q_ptr... continuing the state at s_ptr + src (elements), the new state written
    to s_ptr (with MASKED only where `write`, else always; see the module docstring); with NSNAP, the new state also
    goes to snapm where hitm."""
    h = tl.program_id(0)  # value head
    hk = h // GROUP  # its key head
    t = tl.arange(0, BT)  # [T] token rows
    ck = tl.arange(0, BK)  # [BK] key columns of one slice
    dv = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] this program's value columns
    real = t < L  # [T]
    q_ptrs = q_ptr + t[:, None] * sq_t + hk * sq_h + ck[None, :] * sq_d  # [T, BK], first slice
    k_ptrs = k_ptr + t[:, None] * sk_t + hk * sk_h + ck[None, :] * sk_d  # [T, BK]
    s_ptrs = s_ptr + h * ss_h + ck[:, None] * ss_k + dv[None, :] * ss_v  # [BK, BV] where the new state goes
    s_in = s_ptrs + src  # [BK, BV] the state continued from

    # gate and beta: masked rows load as 0, so they neither decay nor write
    g = tl.load(g_ptr + t * sg_t + h * sg_h, mask=real, other=0.0).to(tl.float32)  # [T]
    beta = tl.load(b_ptr + t * sb_t + h * sb_h, mask=real, other=0.0).to(tl.float32)  # [T]
    cg = tl.cumsum(g, 0) * LOG2E  # [T] log2 decay from the chunk start
    eg = tl.exp2(cg)  # [T]
    g_last = tl.sum(tl.where(t == L - 1, cg, 0.0), 0)  # scalar

    # keys against themselves and against the state before the chunk, over BK-wide slices of the key dim.
    # The dots take raw rows (bf16 ones exactly); the L2 norms scale their results.
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    kS = tl.zeros([BT, BV], dtype=tl.float32)
    k_ss = tl.zeros([BT], dtype=tl.float32)
    for c in range(DK // BK):
        kc = tl.load(k_ptrs + c * BK * sk_d, mask=real[:, None], other=0.0)  # [T, BK] k's dtype
        kf = kc.to(tl.float32)  # [T, BK]
        k_ss += tl.sum(kf * kf, 1)
        if RAW_QK:  # 16-bit rows: exact products, fp32 sums
            KK = tl.dot(kc, tl.trans(kc), KK)  # [T, T]
        else:
            KK = tl.dot(kf, tl.trans(kf), KK, input_precision=DOT)  # [T, T]
        kS = tl.dot(kf, tl.load(s_in + c * BK * ss_k), kS, input_precision=DOT)  # [T, BV]
    k_rs = tl.rsqrt(k_ss + 1e-6)  # [T]
    strict = t[:, None] > t[None, :]  # [T, T] j < i
    dec = tl.exp2(tl.where(strict, cg[:, None] - cg[None, :], float("-inf")))  # [T, T] decay j -> i, 0 on and above the diagonal
    A = KK * (beta * k_rs)[:, None] * k_rs[None, :] * dec  # [T, T] strictly lower
    vv = tl.load(v_ptr + t[:, None] * sv_t + h * sv_h + dv[None, :] * sv_d, mask=real[:, None], other=0.0).to(tl.float32)  # [T, BV]
    rhs = beta[:, None] * (vv - kS * (k_rs * eg)[:, None])  # [T, BV] of (I + A) u = rhs

    # (I + A)^-1 by recursive block doubling; D: inverse of the diagonal blocks so far
    eye = tl.where(t[:, None] == t[None, :], 1.0, 0.0)  # [T, T]
    D = eye - tl.where(_lower_left(t, 1), A, 0.0)  # [T, T] 2x2 blocks
    for lvl in tl.static_range(1, LOG_BT - 1):
        lo = tl.where(_lower_left(t, 1 << lvl), A, 0.0)  # [T, T]
        D = D - tl.dot(tl.dot(D, lo, input_precision=DOT), D, input_precision=DOT)  # [T, T] blocks of 2^(lvl+1)
    y = tl.dot(D, rhs, input_precision=DOT)  # [T, BV] right for the first half of the rows
    lo = tl.where(_lower_left(t, BT // 2), A, 0.0)  # [T, T] lower-left quadrant
    u = y - tl.dot(D, tl.dot(lo, y, input_precision=DOT), input_precision=DOT)  # [T, BV]

    # queries against the keys and the old state (read after the solve, to keep registers free during it),
    # then the state update, slice by slice
    QK = tl.zeros([BT, BT], dtype=tl.float32)
    qS = tl.zeros([BT, BV], dtype=tl.float32)
    q_ss = tl.zeros([BT], dtype=tl.float32)
    kw_scale = k_rs * tl.exp2(g_last - cg)  # [T] normalised keys decayed to the chunk end
    for c in range(DK // BK):
        qc = tl.load(q_ptrs + c * BK * sq_d, mask=real[:, None], other=0.0)  # [T, BK] q's dtype
        kc = tl.load(k_ptrs + c * BK * sk_d, mask=real[:, None], other=0.0)  # [T, BK]
        S = tl.load(s_in + c * BK * ss_k)  # [BK, BV] float32
        qf = qc.to(tl.float32)  # [T, BK]
        q_ss += tl.sum(qf * qf, 1)
        kf = kc.to(tl.float32)  # [T, BK]
        if RAW_QK:
            QK = tl.dot(qc, tl.trans(kc), QK)  # [T, T]
        else:
            QK = tl.dot(qf, tl.trans(kf), QK, input_precision=DOT)  # [T, T]
        qS = tl.dot(qf, S, qS, input_precision=DOT)  # [T, BV]
        if STORE:
            kw = kf * kw_scale[:, None]  # [T, BK]
            S = S * tl.exp2(g_last) + tl.dot(tl.trans(kw), u, input_precision=DOT)  # [BK, BV]
            if MASKED:  # a runtime choice as a mask, not a branch (a store under `if` broke the loop's pipelining)
                tl.store(s_ptrs + c * BK * ss_k, S, mask=(tl.zeros([BK, BV], dtype=tl.int32) + write) != 0)
            else:
                tl.store(s_ptrs + c * BK * ss_k, S)
            if NSNAP > 0:
                sn = h * ss_h + (c * BK + ck)[:, None] * ss_k + dv[None, :] * ss_v  # [BK, BV] within a slot
                if hit0:
                    tl.store(snap0 + sn, S)
                if hit1:
                    tl.store(snap1 + sn, S)
                if hit2:
                    tl.store(snap2 + sn, S)
    q_rs = tl.rsqrt(q_ss + 1e-6) * scale  # [T]
    low = t[:, None] >= t[None, :]  # [T, T] j <= i
    dec = tl.exp2(tl.where(low, cg[:, None] - cg[None, :], float("-inf")))  # [T, T] decay j -> i, 0 above the diagonal
    att = QK * q_rs[:, None] * k_rs[None, :] * dec  # [T, T] lower triangle
    o = qS * (q_rs * eg)[:, None] + tl.dot(att, u, input_precision=DOT)  # [T, BV]
    tl.store(o_ptr + t[:, None] * so_t + h * so_h + dv[None, :] * so_d, o.to(o_ptr.dtype.element_ty), mask=real[:, None])


def delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, store_state: bool = True, *, block_v: int = 32, block_k: int = 64,
                num_warps: int = 4, dot_precision: str = "tf32") -> torch.Tensor:
    """One chunk of the gated delta rule. q, k [L, Hk, Dk], v [L, Hv, Dv], g (float32 log decay, not cumulated)
    and beta [L, Hv], S [Hv, Dk, Dv] float32 updated in place (unless store_state is False) -> o [L, Hv, Dv] in
    v's dtype. q and k are L2-normalised here, q scaled by Dk**-0.5; value head h reads key head h // (Hv // Hk).
    block_v, block_k, num_warps, dot_precision: launch knobs (block sizes are clipped to Dv, Dk)."""
    L, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    assert 1 <= L <= MAX_TOKENS, f"one chunk holds 1..{MAX_TOKENS} tokens, got {L}"
    assert q.shape == k.shape and q.dtype == k.dtype and v.shape[0] == L and Hv % Hk == 0
    assert g.shape == (L, Hv) and beta.shape == (L, Hv) and S.shape == (Hv, Dk, Dv) and S.dtype == torch.float32
    assert Dk >= 16 and Dk & (Dk - 1) == 0 and Dv >= 16 and Dv & (Dv - 1) == 0, "Dk, Dv: powers of two >= 16"
    BV, BK = min(block_v, Dv), min(block_k, Dk)
    assert BV >= 16 and Dv % BV == 0 and BK >= 16 and Dk % BK == 0
    BT = max(16, triton.next_power_of_2(L))
    if q.is_cuda and BT == 64 and BK < WIDE_KEYS:
        # seen on an H200 (bench/README.md, s3_run3): 64-row blocks over key slices under 64 wide faulted (illegal
        # access) in the tests, while the real models' shape (Dk 128, BK 64) and all shorter blocks check out
        raise ValueError(f"delta_chunk on CUDA: 33..64 tokens need key slices of 64 (Dk >= 64, block_k >= 64), got {BK}")
    o = torch.empty((L, Hv, Dv), dtype=v.dtype, device=v.device)
    _delta_chunk_kernel[(Hv, Dv // BV)](
        q, k, v, g, beta, S, o, L,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *S.stride(), *o.stride(),
        Dk**-0.5, S, 0, S, S, 0, S, S,
        GROUP=Hv // Hk, DK=Dk, BK=BK, BT=BT, LOG_BT=BT.bit_length() - 1, BV=BV, DOT=dot_precision,
        RAW_QK=q.is_cuda and q.element_size() == 2, STORE=store_state, VARLEN=False, NSNAP=0, SRC=False,
        num_warps=num_warps,
    )
    return o


def delta_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, cu: torch.Tensor, lmax: int, *, snap: torch.Tensor | None = None,
                snap_at: torch.Tensor | None = None, src_off: torch.Tensor | None = None,
                keep: torch.Tensor | None = None, block_v: int = 32, block_k: int = 64,
                num_warps: int = 4, dot_precision: str = "tf32") -> torch.Tensor:
    """delta_chunk for B packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] (sequence b: tokens
    [cu[b], cu[b + 1]), at most lmax of them, all real), S [B, Hv, Dk, Dv] float32 (sequence b's state, updated in
    place), cu [B + 1] long on the device -> o [T, Hv, Dv] (zero for tokens of no sequence). A grid axis runs over
    the sequences; a program runs its sequence's MAX_TOKENS-token chunks in order, in one launch. Snapshots: with snap [N, Hv, Dk, Dv] float32 and snap_at [B, M, 2] long
    (M <= 3; sequence b's state after its first snap_at[b, m, 0] tokens, any count inside the sequence, is also
    written to snap[snap_at[b, m, 1]]: the sequence's chunks are cut there; 0, or an offset past the sequence,
    writes nothing). Sources: with src_off [B] long
    (device), sequence b continues from the state at element offset src_off[b] from S[b] (a checkpoint's own tensor
    with S[b]'s strides, anywhere in memory: nothing is copied into the slot first; every offset a multiple of 16),
    and keep [B] long says whether its final state is written to S[b] (0: only the states between its chunks, for a
    sequence whose end state nobody reads, e.g. a question's). Graph-safe: nothing per sequence is read on the
    host."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    B = S.shape[0]
    assert q.shape == k.shape and v.shape[0] == T and g.shape == (T, Hv) and beta.shape == (T, Hv)
    assert S.shape == (B, Hv, Dk, Dv) and S.dtype == torch.float32 and cu.shape == (B + 1,)
    assert Dk >= 16 and Dk & (Dk - 1) == 0 and Dv >= 16 and Dv & (Dv - 1) == 0, "Dk, Dv: powers of two >= 16"
    BV, BK = min(block_v, Dv), min(block_k, Dk)
    BT = max(16, triton.next_power_of_2(min(max(lmax, 1), MAX_TOKENS)))
    if q.is_cuda and BT == 64 and BK < WIDE_KEYS:  # see delta_chunk
        raise ValueError(f"delta_batch on CUDA: 33..64 tokens need key slices of 64 (Dk >= 64, block_k >= 64), got {BK}")
    nsnap = 0
    if snap is not None:
        nsnap = snap_at.shape[1]
        assert snap.dtype == torch.float32 and snap.shape[1:] == S.shape[1:] and snap.stride()[1:] == S.stride()[1:]
        assert snap_at.shape == (B, nsnap, 2) and 1 <= nsnap <= 3 and snap_at.is_contiguous()
    if src_off is not None:
        assert src_off.shape == (B,) and keep is not None and keep.shape == (B,), "src_off and keep: [B] each"
    o = torch.zeros((T, Hv, Dv), dtype=v.dtype, device=v.device)
    _delta_chunk_kernel[(Hv, Dv // BV, B)](
        q, k, v, g, beta, S, o, BT,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *S.stride()[1:], *o.stride(),
        Dk**-0.5, cu, S.stride(0), S if snap is None else snap, cu if snap_at is None else snap_at,
        0 if snap is None else snap.stride(0), cu if src_off is None else src_off, cu if keep is None else keep,
        GROUP=Hv // Hk, DK=Dk, BK=BK, BT=BT, LOG_BT=BT.bit_length() - 1, BV=BV, DOT=dot_precision,
        RAW_QK=q.is_cuda and q.element_size() == 2, STORE=True, VARLEN=True, NSNAP=nsnap, SRC=src_off is not None,
        num_warps=num_warps,
    )
    return o
