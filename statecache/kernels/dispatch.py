"""The token-mixing kernels behind one dispatch point: `kernels_for(device)`.

Two implementations of one small interface, chosen once per device:
- `TorchKernels`: plain torch, any device (the CPU reference). Its delta rule is the chunked form of the gated delta
  rule (64-token chunks, float32), tested against transformers' own torch implementation.
- `CudaKernels` (CUDA): statecache's own Triton kernels for chunks continuing from saved state: the whole delta rule
  of a chunk of <= 64 tokens in one kernel (statecache.kernels.gdn), the conv with its saved inputs
  (statecache.kernels.conv) and attention over the cached keys split over the keys (statecache.kernels.span);
  FlashAttention with native grouped heads (the aten op varlen attention wraps; self-checked at start-up, else
  varlen attention with repeated K/V heads, else SDPA). `conv` and `delta` over whole sequences are fla's chunked
  kernels where fla imports (imported on their first call), else the torch ones; `short_kernels=False` sends
  the short chunks there too. The step loop calls neither (statecache.run.batch runs its batched Triton kernels),
  so serving needs no fla.

Shapes (T = packed tokens, B = sequences, cu = int32 cumulative lengths [B+1]):
- conv(x [1, T, C], w [C, W], cu) -> silu(causal depthwise conv) [1, T, C]; every sequence starts from zeros
  (a continuation prepends its saved inputs itself).
- delta(q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta [1, T, Hv], init [B, Hv, Dk, Dv] f32 | None, cu)
  -> (o [1, T, Hv, Dv], final [B, Hv, Dk, Dv] f32); q and k are L2-normalised inside; GVA when Hv > Hk.
- attend_packed(q [T, Hq, D], k, v [T, Hkv, D], cu, max_len, scale) -> [T, Hq, D], causal within each sequence.
- conv_into(x [L, C], w, tail [W - 1, C], real (long scalar tensor)) -> [L, C]: one chunk of one sequence
  continuing from its saved inputs `tail`, which become the last W - 1 real inputs (in place).
- delta_into(q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv], S [Hv, Dk, Dv] f32) -> o [L, Hv, Dv]: one chunk of
  one sequence continuing from S, which it updates in place.
- attend_span(q [L, Hq, D], k, v [P, Hkv, D], start (long scalar tensor), scale) -> [L, Hq, D]: query i sits at
  position start + i and sees keys [0, start + i]. `start` stays on the device (graph-safe).
This module knows nothing of checkpoints, layers or weights.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque

import torch
import torch.nn.functional as F

log = logging.getLogger("statecache.kernels.dispatch")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_reference(q, k, v, g, beta, init=None, chunk: int = 64):
    """One sequence of the gated delta rule in chunked form, float32.

    q, k [T, H, Dk] (already repeated to the value heads), v [T, H, Dv], g, beta [T, H], init [H, Dk, Dv] | None
    -> o [T, H, Dv], final [H, Dk, Dv]. The state decays by exp(g_t), then takes the delta-rule write
    beta_t * (v_t - S^T k_t) k_t^T; the output reads q_t / sqrt(Dk) from the state after step t.
    """
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # [H, T, ...]
    q = _l2norm(q) * Dk**-0.5
    k = _l2norm(k)
    S = torch.zeros(H, Dk, Dv, dtype=torch.float32, device=q.device) if init is None else init.float().clone()
    out = torch.empty(H, T, Dv, dtype=torch.float32, device=q.device)
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]  # [H, n, *]
        cg = g[:, s:e].cumsum(-1)  # [H, n]: log decay from the chunk start to each step
        low = tri[:n, :n].tril()  # j <= i
        dec = (cg[:, :, None] - cg[:, None, :]).masked_fill(~low, float("-inf")).exp()  # [H, n, n]: decay j -> i
        # u_i = beta_i (v_i - S0^T k_i e^{cg_i} - sum_{j<i} dec_ij (k_i.k_j) u_j): a unit lower-triangular system
        A = ((kc @ kc.transpose(-1, -2)) * dec).masked_fill(low.logical_not() | torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        rhs = bc[..., None] * (vc - (kc * cg.exp()[..., None]) @ S)  # [H, n, Dv]
        Lmat = torch.eye(n, device=q.device) + bc[..., None] * A
        u = torch.linalg.solve_triangular(Lmat, rhs, upper=False, unitriangular=True)  # [H, n, Dv]
        att = (qc @ kc.transpose(-1, -2)) * dec  # [H, n, n], j <= i
        out[:, s:e] = (qc * cg.exp()[..., None]) @ S + att @ u
        last = cg[:, -1]  # [H]
        S = S * last.exp()[:, None, None] + (kc * (last[:, None] - cg).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(0, 1), S


class TorchKernels:
    """Plain torch kernels: the CPU reference (also runs on CUDA, slowly)."""

    name = "torch"

    def conv(self, x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor | None = None) -> torch.Tensor:
        W = w.shape[-1]
        outs = []
        bounds = cu.tolist() if cu is not None else [0, x.shape[1]]
        for s, e in zip(bounds[:-1], bounds[1:]):
            xs = x[0, s:e].transpose(0, 1)[None]  # [1, C, n]
            y = F.conv1d(F.pad(xs, (W - 1, 0)), w[:, None, :], groups=w.shape[0])  # [1, C, n]
            outs.append(y[0].transpose(0, 1))
        return F.silu(torch.cat(outs, 0))[None]

    def delta(self, q, k, v, g, beta, init=None, cu=None):
        rep = v.shape[2] // k.shape[2]
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        bounds = cu.tolist() if cu is not None else [0, q.shape[1]]
        outs, finals = [], []
        for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            o, S = delta_rule_reference(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], None if init is None else init[b])
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, 0)[None].to(v.dtype), torch.stack(finals)

    def conv_into(self, x, w, tail, real):
        """One sequence's chunk x [L, C] continuing from tail [W - 1, C] (its saved inputs) -> silu(conv) [L, C];
        tail becomes the last W - 1 real inputs of [tail | x[:real]] (real: a long scalar device tensor)."""
        W1 = tail.shape[0]
        xin = torch.cat([tail, x], 0)  # [W - 1 + L, C]
        y = self.conv(xin[None], w)[0, W1:]  # [L, C]
        torch.index_select(xin, 0, real + torch.arange(W1, device=x.device), out=tail)
        return y

    def delta_into(self, q, k, v, g, beta, S):
        """One sequence's chunk from state S [Hv, Dk, Dv] (float32, updated in place): q, k [L, Hk, Dk], v [L, Hv, Dv],
        g, beta [L, Hv] -> o [L, Hv, Dv]."""
        o, S1 = self.delta(q[None], k[None], v[None], g[None], beta[None], S[None], None)
        S.copy_(S1[0])
        return o[0]

    def attend_packed(self, q, k, v, cu, max_len: int, scale: float):
        bounds = cu.tolist()
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            o = _sdpa(q[s:e], k[s:e], v[s:e], scale, causal=True)
            outs.append(o)
        return torch.cat(outs, 0)

    def attend_span(self, q, k, v, start, scale: float):
        L, P = q.shape[0], k.shape[0]
        rows = torch.arange(L, device=q.device)[:, None]
        cols = torch.arange(P, device=q.device)[None]
        mask = cols <= start + rows  # [L, P]
        return _sdpa(q, k, v, scale, mask=mask)


def _sdpa(q, k, v, scale, causal=False, mask=None):
    """q [L, Hq, D], k, v [S, Hkv, D] -> [L, Hq, D] (grouped heads expanded)."""
    rep = q.shape[1] // k.shape[1]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if rep > 1:
        kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal, scale=scale)
    return o[0].transpose(0, 1)


def span_softmax(s: torch.Tensor, start: torch.Tensor, L: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Scores s [G, R * L, P] (float32; row r is query r % L at position start + r % L) -> probabilities in dtype,
    key j allowed iff j <= start + r % L."""
    rows = torch.arange(s.shape[1], device=s.device) % L
    cols = torch.arange(s.shape[2], device=s.device)
    s = (s * scale).masked_fill(cols[None, None] > (start + rows)[None, :, None], float("-inf"))
    return torch.softmax(s, -1).to(dtype)


def attend_grouped(q, k, v, start, scale: float, softmax=span_softmax, f32_scores: bool = False):
    """attend_span as batched matmuls: the queries sharing a KV head form one [R * L, D] matrix, so each cached
    key and value is read once (no head repeat); float32 scores over the whole span, masked past each query's
    position. For short chunks, where FlashAttention has too few blocks to fill the GPU.
    q [L, Hq, D], k, v [P, Hkv, D], start (long scalar tensor) -> [L, Hq, D]. f32_scores: bmm writes float32."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    R = Hq // Hkv
    qg = q.view(L, Hkv, R, D).permute(1, 2, 0, 3).reshape(Hkv, R * L, D)  # [Hkv, R*L, D]
    kt = k.permute(1, 2, 0)  # [Hkv, D, P] (a strided view)
    s = torch.bmm(qg, kt, out_dtype=torch.float32) if f32_scores else torch.bmm(qg, kt).float()  # [Hkv, R*L, P]
    p = softmax(s, start, L, scale, v.dtype)  # [Hkv, R*L, P]
    o = torch.bmm(p, v.permute(1, 0, 2))  # [Hkv, R*L, D]
    return o.view(Hkv, R, L, D).permute(2, 0, 1, 3).reshape(L, Hq, D)


SPAN_SPLIT_MAX_Q = 128  # statecache.kernels.span for chunks of at most this many queries


class CudaKernels(TorchKernels):
    """CUDA: statecache's Triton kernels for short chunks, FlashAttention (native GQA where it checks out) for
    attention, fla's chunked kernels for whole sequences where fla imports (see the module docstring).

    `grouped_max_q`: a span chunk of at most this many queries attends by batched matmuls (each cached key read
    once, no head repeat). Measured on an H200 at the 9B shape, 5120-key span (bench/gpu_bench.py --micro): 0.058 ms
    at 64 queries with the compiled softmax, against FlashAttention's 0.134 (native GQA) and 0.226 (repeated heads);
    still ahead at 128 (0.091 vs 0.138), not at 256; with the eager softmax only up to 64. fla's fused recurrent
    delta rule is not used: it beat the chunked one only at 16 tokens (0.026 vs 0.033 ms) and lost at 64."""

    name = "cuda"

    def __init__(self, compile: bool = False, short_kernels: bool = True):
        from statecache.kernels import conv as conv_k, gdn as gdn_k, span as span_k  # Triton: ImportError without it

        self._fla: tuple | None = None  # (causal_conv1d, chunk_gated_delta_rule), or () where fla does not import
        self._varlen_memo: deque = deque(maxlen=64)  # (offsets tensor, fla's varlen arguments): see _fla_varlen
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:  # older torch: SDPA paths of TorchKernels
            varlen_attn = None
        self._varlen = varlen_attn
        params = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
        self.varlen_gqa = "enable_gqa" in params  # torch 2.13 has it; 2.11 refuses it
        self.span_softmax, self.grouped_max_q = span_softmax, 64
        if compile:
            self.compile_elementwise()
        self.flash_gqa = self._check_flash_gqa()
        self.bmm_f32 = self._check_bmm_f32()
        self.short_kernels = short_kernels  # our Triton kernels for short chunks (see the module docstring)
        self._delta_chunk, self._span = gdn_k.delta_chunk, span_k.attend_span
        self._delta_max, self._delta_keys = gdn_k.MAX_TOKENS, gdn_k.WIDE_KEYS
        self._conv_chunk, self._conv_chunk_max = conv_k.conv_chunk, conv_k.MAX_ROWS

    def compile_elementwise(self) -> None:
        """The span softmax torch.compile'd, which makes grouped attention pay up to 128 queries."""
        from statecache.kernels.fuse import Fused

        self.span_softmax, self.grouped_max_q = Fused(span_softmax), 128

    def _flash_op(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        """The FlashAttention op under varlen attention, called with Hkv < Hq heads (FA2 groups them natively),
        causal aligned to the keys' end."""
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]

    def _check_flash_gqa(self) -> bool:
        """Does the flash op take grouped K/V heads directly and agree with repeated heads? (checked once)"""
        if self._varlen is None or not torch.cuda.is_available():
            return False
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(96, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(96, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
            a = self._flash_op(q, k, v, cu, cu, 56, 56, 0.125)
            kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
            b = self._varlen(q, kr, vr, cu, cu, 56, 56, scale=0.125, window_size=(-1, 0))
            return bool((a.float() - b.float()).abs().max() < 1e-2)
        except Exception:  # noqa: BLE001 - any refusal: repeat the heads instead
            return False

    @staticmethod
    def _check_bmm_f32() -> bool:
        """Can bf16 batched matmuls write float32 directly (torch.bmm(..., out_dtype=))?"""
        try:
            a = torch.ones(1, 2, 2, device="cuda", dtype=torch.bfloat16)
            return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except Exception:  # noqa: BLE001
            return False

    def _fla_varlen(self, cu: torch.Tensor | None) -> dict:
        """fla's variable-length arguments for `cu` (int32 or int64, on the device): the int64 offsets and the
        64-token chunk indices, made once per `cu` object and then reused by every layer. fla derives the chunk
        indices itself when not given them, reading the offsets on the host (a device synchronisation) in every
        call whose argument it has not cached: per layer, and per delta-rule call of a planting split, the GPU ran
        dry while the host waited and then re-queued (bench/README.md, session 5)."""
        if cu is None:
            return {}
        for ref, got in self._varlen_memo:
            if ref is cu:
                return got
        from fla.ops.utils.index import prepare_chunk_indices

        cu64 = cu if cu.dtype == torch.long else cu.long()
        host = cu64.cpu()  # one synchronisation per offsets tensor (a forward's first layer), not one per call
        got = {"cu_seqlens": cu64, "cu_seqlens_cpu": host, "chunk_indices": prepare_chunk_indices(cu64, 64, cu_seqlens_cpu=host)}
        self._varlen_memo.append((cu, got))  # holds `cu`, so its identity is not reused while remembered
        return got

    def _fla_ops(self) -> tuple:
        """fla's (causal_conv1d, chunk_gated_delta_rule), imported on the first call; () where fla does not import."""
        if self._fla is None:
            try:
                from fla.modules.convolution import causal_conv1d
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule

                self._fla = (causal_conv1d, chunk_gated_delta_rule)
            except ImportError as e:
                log.info("fla does not import (%s): whole sequences' conv and delta rule run on torch", e)
                self._fla = ()
        return self._fla

    def conv(self, x, w, cu=None):
        fla = self._fla_ops()
        if not fla:
            return super().conv(x, w, cu)
        y = fla[0](x, weight=w, bias=None, activation="silu", **self._fla_varlen(cu))
        return y[0] if isinstance(y, tuple) else y

    def delta(self, q, k, v, g, beta, init=None, cu=None):
        fla = self._fla_ops()
        if not fla:
            return super().delta(q, k, v, g, beta, init, cu)
        o, S = fla[1](q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **self._fla_varlen(cu))
        return o, S

    def conv_into(self, x, w, tail, real):
        if self.short_kernels and x.shape[0] <= self._conv_chunk_max and x.stride(1) == 1:
            return self._conv_chunk(x, w, tail, real)
        return super().conv_into(x, w, tail, real)

    def delta_into(self, q, k, v, g, beta, S):
        if self.short_kernels and q.shape[0] <= self._delta_max and q.shape[-1] >= self._delta_keys:
            return self._delta_chunk(q, k, v, g, beta, S)
        return super().delta_into(q, k, v, g, beta, S)

    def _heads(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        if rep > 1 and not self.varlen_gqa:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return k, v, ({"enable_gqa": True} if rep > 1 and self.varlen_gqa else {})

    def _attend(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        if self.flash_gqa:
            return self._flash_op(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        k, v, kw = self._heads(q, k, v)
        return self._varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **kw)


    def _flash(self, q) -> bool:
        return self._varlen is not None and q.dtype in (torch.float16, torch.bfloat16)  # FlashAttention: half only

    def attend_packed(self, q, k, v, cu, max_len: int, scale: float):
        if not self._flash(q):
            return super().attend_packed(q, k, v, cu, max_len, scale)
        return self._attend(q, k, v, cu, cu, max_len, max_len, scale)

    def attend_span(self, q, k, v, start, scale: float):
        if not self._flash(q):
            return super().attend_span(q, k, v, start, scale)
        L, P = q.shape[0], k.shape[0]
        if self.short_kernels and L <= SPAN_SPLIT_MAX_Q:
            return self._span(q, k, v, start, scale)
        if L <= self.grouped_max_q:
            return attend_grouped(q, k, v, start, scale, self.span_softmax, self.bmm_f32)
        zero = torch.zeros(1, dtype=torch.int32, device=q.device)
        cu_q = torch.cat([zero, zero + L])
        cu_k = torch.cat([zero, (start + L).to(torch.int32).reshape(1)])  # causal aligned to the keys' end
        return self._attend(q, k, v, cu_q, cu_k, L, P, scale)


def kernels_for(device: torch.device | str, compile: bool = False) -> TorchKernels:
    """CudaKernels on CUDA when Triton imports; the torch reference otherwise. compile: fuse the kernels' own
    elementwise pieces (the span softmax) with torch.compile."""
    if torch.device(device).type == "cuda":
        try:
            return CudaKernels(compile)
        except ImportError:
            return TorchKernels()
    return TorchKernels()
