"""Batched continuations: the short chunks of many rows, each continuing from its own saved state, in one forward.

A *piece* is one chunk [s, e) of one row, continuing from that row's state at s: its conv tails, gathered into this
module's batch slots (row b of a forward uses slot b), its GDN states (float32), which the Triton delta kernel reads
where the checkpoint keeps them (element offsets from slot b; the eager kernels get them gathered into the slots
too) and whose state at e goes to slot b only for pieces that keep it (not after a question: nobody reads it), and
its attention K/V of [0, s), which stay where the cache stores them (one tensor per group, [A, p, Hkv, D]) and are
addressed per sequence: the eager kernels take the tensors, the Triton kernels element offsets of each group's layer
relative to this module's chunk K/V buffer (so no group's K/V is copied per row). The pieces of a forward are packed back to back
(cu_seqlens); rotary positions are s + i per sequence. Tokens past the last piece (a graph's padding) belong to no
sequence: no kernel that mixes tokens reads or writes them.

With specialists (statecache.model.specialists) every piece runs with its own route (the route of the checkpoint it
continues from: a per-token route index, so one graph serves any mix of routes) and the forward leaves each
sequence's router feature sum over its piece in `st.F` (statecache.step carries the sums on from the checkpoints',
plants checkpoints with them, and asks the router once the question has run).

`BatchRunner.forward(pieces)` runs one packed forward (on CUDA one replay of the graph of its (batch-size, total-token)
buckets, with or without snapshots, every per-sequence number in the graph's input buffer: the kernels loop over each
sequence's own length, so no graph depends on the longest piece; the same code eagerly elsewhere)
and returns the answers at each piece's slots; after it, the batch slots hold each row's state at its piece's end
(pieces that keep it) and `chunk_kv` its chunk's K/V (the cache snapshots and plants from them). `precapture` captures every bucket's graph
at start-up. A group's K/V must stay alive until the forward that reads them is done (the callers hold them).

A piece may also keep *snapshots*: its state at positions inside it (at least SNAP_GAP tokens from its start, at
most SNAPS_PER_PIECE; the delta rule's chunks are cut there), written to slots of `st.snap_S` / `st.snap_conv` (at
most `max_snaps` per forward) by the delta-rule kernel as its chunk ends there and by a gather of the conv inputs; `snapshot` reads them. Only forwards
that keep snapshots (graphs of their own, keyed so) run this (hits' questions alone never need it).

Who runs which piece, and what is kept of it, is statecache.step's (the step loop over statecache.sched's
scheduler). This module knows checkpoints' payload layout (conv, S[, feature sum]) and groups' (K, V, serial) as
statecache.cache.store stores them; nothing of Redis, the memo, the cache's index or the schedule.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from statecache.model.specialists.lora import TokenRoutes
from statecache.run.graphs import MAX_OPTIONS, Staging, fill_options, new_stats, try_capture, wait_for_gpu

BATCHES = (1, 2, 4, 8, 16, 32, 64)  # batch-size buckets (sequences per graph)
# packed-token buckets: a forward's matmuls run on its bucket's tokens, so past a few hundred tokens (where the
# weight reads stop dominating) padding costs time (~22 us a padded token at the 9B shape on an H100): steps of at
# most 1.5x, and 1.17-1.25x between 1024 and 2048 (the steps the worker runs most: its logged steps of s49 padded 5-6%
# with 1536 and 2048 alone, 4% with 1280 and 1792 too)
TOKENS = (64, 128, 192, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096, 6144, 8192)
CHUNK = 64  # the delta rule's chunk
SNAP_GAP = 16  # a snapshot lies at least this far inside its piece (its conv tail: the inputs before it, all the piece's)
MAX_PIECE = 512  # the most tokens one sequence of a batch may have
SNAPS_PER_PIECE = 3  # the most snapshots inside one piece (kernels.gdn.delta_batch's limit)
MAX_SNAPS = 16  # snapshot slots of a forward (each holds one GDN state of every layer: 48 MiB at the 9B shape)


def bucket(n: int, sizes) -> int | None:
    """The smallest of `sizes` (ascending) that holds n, or None."""
    for b in sizes:
        if n <= b:
            return b
    return None


@dataclass
class Piece:
    """One sequence of a batched forward: chunk [s, e) of `ids`, continuing from `conv`, `S` (its state at s) and
    K/V of [0, s) in `K`, `V` ([A, >= s, Hkv, D], contiguous); answers at `slots` (absolute, in [s, e))."""

    ids: object  # list of ints or int64 array (the whole row)
    s: int
    e: int
    conv: torch.Tensor  # [G, W - 1, C]
    S: torch.Tensor  # [G, Hv, Dk, Dv] float32
    K: torch.Tensor | None  # None when s == 0
    V: torch.Tensor | None
    slots: tuple = ()
    nopts: tuple = ()  # per slot its options: a count (the first letters) or token ids (statecache.run.graphs.fill_options)
    route: int = 0  # specialists: the route its adapter layers run with
    snaps: tuple = ()  # positions in [s + SNAP_GAP, e) where its state is also kept (`snapshot`)
    keep_state: bool = True  # leave its state at e in its slot (False: nobody reads it, e.g. after a question)
    images: object = None  # an image row's statecache.run.images.RowImages (its positions and embeddings), else None

    def has_image(self) -> bool:
        """Does [s, e) hold image tokens? (Such a piece runs in an eager forward: multimodal positions, the vision
        tower's embeddings; text pieces of an image row run as text, their positions shifted.)"""
        return self.images is not None and self.images.has_image(self.s, self.e)


class NotBatched(Exception):
    """A batch shape that cannot be run (too many sequences or tokens, a piece too long, a failed capture)."""


@dataclass
class BatchKV:
    """Where each sequence's cached K/V of [0, start) live: `tensors` (eager kernels: (K, V) per real sequence) and
    `off` [A, Bb, 2] int64 (Triton kernels: element offsets of a group's K[a] / V[a] relative to the chunk buffers'
    `ref_k[a]` / `ref_v[a]`, which the kernel is handed as the chunk's own keys and values)."""

    tensors: list
    off: torch.Tensor
    ref_k: torch.Tensor
    ref_v: torch.Tensor


class BatchState:
    """The static buffers of a batched forward: per-slot GDN states and conv tails, the chunk's K/V."""

    def __init__(self, cfg, max_batch: int, max_tokens: int, device, dtype, features: bool = False, snaps: int = 0):
        G, A = len(cfg.linear_layers), len(cfg.full_layers)
        W = cfg.linear_conv_kernel_dim
        # snapshot slots: the conv tails and GDN states at positions inside pieces (Piece.snaps)
        self.snap_conv = torch.zeros(G, snaps, W - 1, cfg.conv_dim, device=device, dtype=dtype) if snaps else None
        self.snap_S = torch.zeros(G, snaps, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, device=device, dtype=torch.float32) if snaps else None
        self.conv = torch.zeros(G, max_batch, W - 1, cfg.conv_dim, device=device, dtype=dtype)
        self.S = torch.zeros(G, max_batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim, device=device, dtype=torch.float32)
        self.K = torch.zeros(A, max_tokens, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
        self.V = torch.zeros_like(self.K)
        # specialists: each slot's router feature sum over its piece's tokens (float32)
        self.F = torch.zeros(max_batch, cfg.hidden_size, device=device, dtype=torch.float32) if features else None

    def checkpoint_bytes(self) -> int:
        """What one sequence's saved state takes (a checkpoint: every GDN layer's state and conv tail)."""
        return self.S[:, 0].nbytes + self.conv[:, 0].nbytes

    def position_bytes(self) -> int:
        """What one position of one sequence's attention K/V takes (K and V of every attention layer)."""
        return self.K[:, :1].nbytes + self.V[:, :1].nbytes


@dataclass
class Snaps:
    """Where a forward keeps states inside its pieces: `at` [Bb, SNAPS_PER_PIECE, 2] long (sequence b's offset from
    its start, at least SNAP_GAP, or 0 for none; the snapshot slot), `rows` [slots * (W - 1)] long (the packed tokens
    whose conv inputs make each slot's tail; unused slots read token 0), `host` (eager kernels: [(offset, slot)] per
    sequence)."""

    at: torch.Tensor
    rows: torch.Tensor
    host: list | None = None


class BatchMixer:
    """The stateful parts of a forward of Bb packed sequences (Tb tokens), each continuing from its slot."""

    def __init__(self, bk, st: BatchState, Bb: int, Tb: int, lmax: int, pos, cu, starts, kv: BatchKV, lens=None,
                 snaps: Snaps | None = None, src=None):
        self.bk, self.st, self.Bb, self.Tb, self.lmax = bk, st, Bb, Tb, lmax
        self.pos, self.cu, self.starts, self.kv, self.lens = pos, cu, starts, kv, lens
        self.snaps = snaps
        self.src = src  # (soff [G, Bb], keep [Bb]): where each sequence's GDN states lie (Triton kernels), or None
        self.live = torch.arange(Tb, device=pos.device) < cu[-1]  # [Tb]: tokens of some sequence

    def conv(self, j, x, w):
        if self.snaps is not None:  # each slot's tail: the W - 1 inputs before its position
            tails = self.st.snap_conv[j]
            tails.view(-1, tails.shape[-1]).copy_(x.index_select(0, self.snaps.rows))
        return self.bk.conv(x, w, self.st.conv[j, : self.Bb], self.cu, self.lmax, self.lens)

    def delta(self, j, q, k, v, g, beta):
        snap = None if self.snaps is None else (self.st.snap_S[j], self.snaps)
        src = None if self.src is None else (self.src[0][j], self.src[1])
        return self.bk.delta(q, k, v, g, beta, self.st.S[j, : self.Bb], self.cu, self.lmax, self.lens, snap, src)

    def attend(self, a, q, k, v, scale):
        Kc, Vc = self.st.K[a, : self.Tb], self.st.V[a, : self.Tb]
        Kc.copy_(k)
        Vc.copy_(v)
        return self.bk.attend(a, q, Kc, Vc, self.cu, self.starts, self.kv, self.lmax, scale, self.lens)


class BatchKernels:
    """The batched token mixing over a kernels object (statecache.kernels.dispatch): Triton kernels (graph-safe: every
    per-sequence number stays on the device) when `triton` and the shapes allow, else a loop over the sequences
    with the one-sequence kernels (host lengths `lens`; eager only)."""

    def __init__(self, kernels, triton: bool | None = None):
        self.k = kernels
        self.triton = getattr(kernels, "short_kernels", False) if triton is None else triton
        self.max_keys = 8192  # the longest span a sequence may have (sizes the span kernel's splits)
        self.span_kw: dict = {}  # launch knobs of kernels.span.attend_batch (block sizes, splits)
        self.delta_kw: dict = {}  # launch knobs of kernels.gdn.delta_batch (value block, warps); overrides `delta_knobs`
        if self.triton:
            from statecache.kernels import conv as conv_k, gdn as gdn_k, span as span_k

            self._conv = conv_k.conv_batch
            self._delta, self._span = gdn_k.delta_batch, span_k.attend_batch

    # each: x / q, k, v packed [T, ...]; cu [Bb + 1] long (device); lens: host lengths (eager) or None (graphs)
    def conv(self, x, w, tails, cu, lmax, lens):
        if self.triton and x.stride(1) == 1:
            return self._conv(x, w, tails, cu, lmax)
        y = torch.zeros_like(x)
        for b, (s, n) in enumerate(self._spans(lens)):
            if n:
                y[s : s + n] = self.k.conv_into(x[s : s + n], w, tails[b], torch.tensor(n, device=x.device))
        return y

    def delta(self, q, k, v, g, beta, S, cu, lmax, lens, snap=None, src=None):
        """snap: (slots [N, Hv, Dk, Dv], Snaps) to keep states inside the sequences too, or None. src: (soff [Bb],
        keep [Bb]) for the Triton kernel (each sequence's state read where it lies, see statecache.kernels.gdn.delta_batch), or
        None: the states are in S's slots (`BatchRunner.load`)."""
        if self.triton:
            kw = {**delta_knobs(S.shape[0]), **self.delta_kw}
            if src is not None:
                kw.update(src_off=src[0], keep=src[1])
            if snap is None:
                return self._delta(q, k, v, g, beta, S, cu, lmax, **kw)
            return self._delta(q, k, v, g, beta, S, cu, lmax, snap=snap[0], snap_at=snap[1].at, **kw)
        if snap is not None and snap[1].host is None:
            raise NotBatched("the eager batched kernels need the host snapshot positions")
        o = torch.zeros_like(v)
        for b, (s, n) in enumerate(self._spans(lens)):
            cuts = sorted((c, slot) for c, slot in (snap[1].host[b] if snap is not None and b < len(snap[1].host)
                                                      else ()) if 0 < c < n)
            a = 0
            for c, slot in cuts + [(n, None)]:  # the sequence in parts, its state kept at each cut
                if c > a:
                    o[s + a : s + c] = self.k.delta_into(q[s + a : s + c], k[s + a : s + c], v[s + a : s + c],
                                                         g[s + a : s + c], beta[s + a : s + c], S[b])
                if slot is not None:
                    snap[0][slot].copy_(S[b])
                a = c
        return o

    def attend(self, a, q, k, v, cu, starts, kv: BatchKV, lmax, scale, lens):
        if self.triton:
            kw = {"split_lmax": CHUNK, **self.span_kw}  # key splits sized for hits' questions, whatever the graph
            return self._span(q, k, v, cu, starts, kv.off[a], lmax, scale, max_keys=self.max_keys, **kw)
        o = torch.zeros_like(q)
        for b, (s, n) in enumerate(self._spans(lens)):
            if not n:
                continue
            st = int(starts[b])
            if st:
                K, V = kv.tensors[b]
                kk, vv = torch.cat([K[a, :st], k[s : s + n]]), torch.cat([V[a, :st], v[s : s + n]])
            else:
                kk, vv = k[s : s + n], v[s : s + n]
            o[s : s + n] = self.k.attend_span(q[s : s + n], kk, vv, torch.tensor(st, device=q.device), scale)
        return o

    @staticmethod
    def _spans(lens):
        if lens is None:
            raise NotBatched("the eager batched kernels need the host lengths (not graph-safe)")
        s = 0
        for n in lens:
            yield s, n
            s += n


def delta_knobs(batch: int) -> dict:
    """The batched delta rule's launch knobs for a forward of `batch` sequences: value blocks of 64 from 16 sequences
    on (measured on an H200 at the 9B shape, 64-token pieces: 180 against 196 us a layer at 16 sequences in
    s9_run1's kernel sweep; 16 hits' graph 30.18 against 30.36 ms in s10_run4), else statecache.kernels.gdn's default of 32 (one
    sequence: 16.3 us against 25.6 with 64, s3_run3)."""
    return {"block_v": 64} if batch >= 16 else {}


@dataclass
class _Graph:
    inp: torch.Tensor  # long [2 Tb + Bb S (1 + MAX_OPTIONS) + 2 Bb + 1 + 2 A Bb + G Bb + Bb (+ 2 Tb)]: ids | pos | slots | options | cu |
    # starts | kv offsets | state offsets | keep (| routes | seq: specialists) (| snapshot positions | tail rows: graphs
    # that keep snapshots)
    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor  # [Bb S] packed token index of each answer slot
    options: torch.Tensor  # [Bb S, MAX_OPTIONS] (statecache.run.graphs.fill_options)
    cu: torch.Tensor  # [Bb + 1]
    starts: torch.Tensor  # [Bb]
    off: torch.Tensor  # [A, Bb, 2]
    soff: torch.Tensor  # [G, Bb] element offset of sequence b's GDN state in layer j from slot b (BatchMixer.src)
    keep: torch.Tensor  # [Bb] 1: its state at the piece's end stays in slot b (Piece.keep_state)
    rtok: torch.Tensor | None = None  # [Tb] specialists: each token's route (padding: 0, the trunk)
    seq: torch.Tensor | None = None  # [Tb] specialists: each token's sequence (padding: Bb, counted nowhere)
    at: torch.Tensor | None = None  # [Bb, SNAPS_PER_PIECE, 2] snapshots (forwards that keep them): Snaps.at
    rows: torch.Tensor | None = None  # [max_snaps * (W - 1)]: Snaps.rows
    out: torch.Tensor | None = None  # [Bb S, MAX_OPTIONS]
    graph: "torch.cuda.CUDAGraph | None" = None
    staging: Staging | None = None


class BatchRunner:
    """Packed forwards of continuation pieces, from per-slot states (see the module docstring).

    max_batch: sequences per forward (its slots are allocated up front: max_batch GDN states); max_tokens: packed
    tokens per forward (default max_batch * max_piece); max_pos: the longest key span (sizes the span kernel's
    splits); graphs: CUDA graphs (default on CUDA; they need the Triton kernels); pad: bucket the shapes (always with
    graphs); pool: the graph memory pool to share; triton: the Triton batch kernels (default: where the kernels
    object has statecache's short kernels, i.e. CudaKernels); specialists: a statecache.model.specialists.Specialists, or
    None for the trunk; max_snaps: snapshot slots per forward (states kept inside pieces,
    `Piece.snaps`; 0: none; none with specialists, whose checkpoints also need the router's feature sum there)."""

    def __init__(self, model, kernels, *, max_slots: int = 4, max_batch: int = 64, max_tokens: int | None = None,
                 max_piece: int = MAX_PIECE, max_pos: int = 8192, graphs: bool | None = None, pad: bool | None = None,
                 pool=None, triton: bool | None = None, batches=BATCHES, tokens=TOKENS, specialists=None,
                 max_snaps: int = MAX_SNAPS):
        self.model, self.device = model, model.device
        self.spec = specialists
        self.use_graphs = (self.device.type == "cuda") if graphs is None else graphs
        self.pad = self.use_graphs if pad is None else (pad or self.use_graphs)
        self.bk = BatchKernels(kernels, triton)
        self.bk.max_keys = max_pos
        if self.use_graphs and not self.bk.triton:
            raise ValueError("batch graphs need the Triton batch kernels (the eager ones read host lengths)")
        if self.bk.triton and self.device.type == "cuda":
            from statecache.kernels.gdn import WIDE_KEYS

            if model.cfg.linear_key_head_dim < WIDE_KEYS:  # its 64-token blocks would be refused at every capture
                raise ValueError(f"the batched delta kernel needs GDN keys of at least {WIDE_KEYS} dims on CUDA; "
                                 f"this model's are {model.cfg.linear_key_head_dim}")
        self.max_slots, self.max_piece = max_slots, max_piece
        most = bucket(max_batch, batches) or batches[-1]  # 24 rows: graphs up to 32 (a 16-row forward would split them)
        self.batches = tuple(b for b in batches if b <= most)
        self.max_batch = self.batches[-1]
        top = max_tokens or self.max_batch * max_piece
        self.tokens = tuple(t for t in tokens if t <= top) or (top,)
        self.max_tokens = self.tokens[-1]
        self.max_snaps = 0 if specialists is not None else max_snaps
        self.st = BatchState(model.cfg, self.max_batch, self.max_tokens, self.device, model.dtype,
                             features=specialists is not None, snaps=self.max_snaps)
        self.n_attn, self.n_gdn = len(model.cfg.full_layers), len(model.cfg.linear_layers)
        self.tail_rows = model.cfg.linear_conv_kernel_dim - 1  # the inputs a conv tail holds
        self._gdn_layers = np.arange(self.n_gdn, dtype=np.int64)[:, None]  # _pack's per-layer steps
        self._attn_layers = np.arange(self.n_attn, dtype=np.int64)[:, None, None]
        self.graphs: dict[tuple[int, int, bool], _Graph | None] = {}
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.use_graphs else None
        self.stats = new_stats()
        # tokens: the pieces' own; padded_tokens: what the forwards ran (their token buckets: the matmuls' work);
        # buckets: token bucket -> [forwards, their own tokens] (where the padding is)
        self.stats.update(forwards=0, sequences=0, tokens=0, padded_tokens=0, buckets={})
        self.failures: list[str] = []
        self._out_host: torch.Tensor | None = None

    # ---- shapes ---------------------------------------------------------------------------------------------------

    def shape(self, B: int, T: int, snaps: bool = False) -> tuple[int, int, bool] | None:
        """(batch bucket, token bucket, keeps snapshots) of B sequences of T tokens in all; None when too many."""
        if not self.pad:
            return (B, T, snaps) if B <= self.max_batch and T <= self.max_tokens else None
        Bb, Tb = bucket(B, self.batches), bucket(T, self.tokens)
        return None if Bb is None or Tb is None else (Bb, Tb, snaps)

    def keys(self) -> list[tuple[int, int, bool]]:
        """Every (batch, tokens, snapshots) bucket a forward can take: at least a token per sequence, at most a
        longest piece each; snapshots where a piece can hold one (more than SNAP_GAP tokens)."""
        out = []
        for B in self.batches:
            top = max(bucket(B * self.max_piece, self.tokens) or self.max_tokens, self.tokens[0])
            for T in self.tokens:
                if B <= T <= top or T == self.tokens[0]:
                    out.append((B, T, False))
                    if self.max_snaps and T > SNAP_GAP and B <= T:
                        out.append((B, T, True))
        return out

    def _lmax(self, Tb: int) -> int:
        """The longest piece a graph of Tb tokens is built for (sizes the kernels' per-sequence blocks)."""
        return min(Tb, self.max_piece)

    # ---- the forward ----------------------------------------------------------------------------------------------

    def _sizes(self, Bb: int, Tb: int, snaps: bool) -> list[int]:
        """The parts of a forward's input buffer (see _Graph.inp)."""
        S, A = self.max_slots, self.n_attn
        kept = [Bb * SNAPS_PER_PIECE * 2, self.max_snaps * self.tail_rows] if snaps else []
        return [Tb, Tb, Bb * S, Bb * S * MAX_OPTIONS, Bb + 1, Bb, 2 * A * Bb, self.n_gdn * Bb, Bb] + ([Tb, Tb] if self.spec else []) + kept

    def _views(self, inp: torch.Tensor, Bb: int, Tb: int, snaps: bool) -> _Graph:
        ids, pos, slots, options, cu, starts, off, soff, keep, *rest = torch.split(inp, self._sizes(Bb, Tb, snaps))
        routed = rest[:2] if self.spec else [None, None]
        at, rows = (rest[-2].view(Bb, SNAPS_PER_PIECE, 2), rest[-1]) if snaps else (None, None)
        return _Graph(inp, ids, pos, slots, options.view(Bb * self.max_slots, MAX_OPTIONS), cu, starts, off.view(self.n_attn, Bb, 2), soff.view(self.n_gdn, Bb),
                      keep, *routed, at, rows)

    def _forward(self, g: _Graph, Bb: int, Tb: int, lmax: int, kv_tensors: list, lens, snap_host=None,
                 mm=None) -> torch.Tensor:
        kv = BatchKV(kv_tensors, g.off, self.st.K, self.st.V)
        snaps = None if g.at is None else Snaps(g.at, g.rows, snap_host)
        src = (g.soff, g.keep) if self.bk.triton else None  # eager kernels: the states were copied into the slots
        mix = BatchMixer(self.bk, self.st, Bb, Tb, lmax, g.pos, g.cu, g.starts, kv, lens, snaps, src)
        lora = None if self.spec is None else TokenRoutes(self.spec.lora, self.spec.router, g.rtok)
        pos, embeds = (g.pos, None) if mm is None else mm
        h = self.model.body(g.ids, pos, mix, lora, embeds=embeds)  # [Tb, H]
        if lora is not None:  # each sequence's feature sum over its tokens (padding goes to row Bb, dropped)
            sums = torch.zeros(Bb + 1, lora.f.shape[1], device=h.device, dtype=torch.float32)
            self.st.F[:Bb].copy_(sums.index_add_(0, g.seq, lora.f)[:Bb])
        return self.model.option_probs(h.index_select(0, g.slots), g.options)  # [Bb S, MAX_OPTIONS]

    def _pack(self, pieces: list[Piece], Bb: int, Tb: int, snaps: bool, buf: np.ndarray | None = None
              ) -> tuple[np.ndarray, list | None]:
        """The host input buffer of these pieces (see _Graph.inp) and the snapshots' host positions (Snaps.host; None
        when this shape keeps none). One Python pass gathers each piece's numbers into lists, then a fixed number of
        numpy operations fill the buffer (per-piece numpy calls cost ~1 us each). buf: the buffer to fill (a graph's
        staging copy; zeroed first), else a new one."""
        S, A, G, B = self.max_slots, self.n_attn, self.n_gdn, len(pieces)
        sizes = self._sizes(Bb, Tb, snaps)
        if buf is None:
            buf = np.zeros(sum(sizes), dtype=np.int64)
        else:
            buf.fill(0)
        o_pos, o_slots = Tb, 2 * Tb
        o_nopts = o_slots + Bb * S
        o_cu = o_nopts + Bb * S * MAX_OPTIONS
        o_st = o_cu + Bb + 1
        o_off = o_st + Bb
        o_soff = o_off + 2 * A * Bb
        o_keep = o_soff + G * Bb
        o_rt = o_keep + Bb  # specialists: routes, then sequence indices
        st = self.st
        es, fs = st.K.element_size(), st.S.element_size()
        S0, ls, bs = st.S.data_ptr(), st.S.stride(0) * fs, st.S.stride(1) * fs  # bytes between layers, between slots
        K0, V0, lk, lv = st.K.data_ptr(), st.V.data_ptr(), st.K.stride(0) * es, st.V.stride(0) * es
        starts, lens, cu, keep, chunks = [], [], [], [], []
        slot_at, slot_x, slot_k = [], [], []  # answer slots: buffer index (b S + j), packed token index, options
        s_base, s_step = [], []  # bytes: GDN state of layer 0 from slot b of layer 0, and per layer further
        kv_b, kv_base, kv_step = [], [], []  # pieces with cached K/V: K's and V's bytes from the chunk buffers'
        t = 0
        for b, pc in enumerate(pieces):
            s, e = pc.s, pc.e
            starts.append(s)
            lens.append(e - s)
            chunks.append(pc.ids[s:e])
            for j, (x, k) in enumerate(zip(pc.slots, pc.nopts)):
                slot_at.append(b * S + j)
                slot_x.append(t + x - s)
                slot_k.append(k)
            S_ = pc.S
            s_base.append(S_.data_ptr() - S0 - b * bs)
            s_step.append(S_.stride(0) * fs - ls)
            keep.append(1 if pc.keep_state else 0)
            if s:
                kv_b.append(b)
                kv_base.append((pc.K.data_ptr() - K0, pc.V.data_ptr() - V0))
                kv_step.append((pc.K.stride(0) * es - lk, pc.V.stride(0) * es - lv))
            t += e - s
            cu.append(t)
        buf[:t] = np.concatenate(chunks)
        # rotary positions s + i of each piece (an image row's text: shifted past its images, statecache.run.images)
        first = [s + (pc.images.shift(s) if pc.images is not None else 0) for s, pc in zip(starts, pieces)]
        buf[o_pos : o_pos + t] = np.arange(t) + np.repeat([f - c + n for f, c, n in zip(first, cu, lens)], lens)
        if slot_at:
            buf[o_slots:o_nopts][slot_at] = slot_x
        opts = buf[o_nopts:o_cu].reshape(Bb * S, MAX_OPTIONS)
        fill_options(opts, ())  # every slot padding (reads two letters), then the real slots' options
        if slot_at:
            real = np.empty((len(slot_k), MAX_OPTIONS), dtype=np.int64)
            fill_options(real, slot_k)
            opts[slot_at] = real
        buf[o_cu + 1 : o_cu + B + 1] = cu
        buf[o_cu + B + 1 : o_st] = t
        buf[o_st : o_st + B] = starts
        buf[o_keep : o_keep + B] = keep
        if self.spec is not None:
            buf[o_rt : o_rt + t] = np.repeat([pc.route for pc in pieces], lens)
            buf[o_rt + Tb : o_rt + Tb + t] = np.repeat(np.arange(B), lens)
            buf[o_rt + Tb + t : o_rt + 2 * Tb] = Bb
        # each GDN state of layer j relative to slot b of layer j (the Triton delta kernel reads it there)
        soff = buf[o_soff:o_keep].reshape(G, Bb)
        soff[:, :B] = (np.array(s_base) + self._gdn_layers * np.array(s_step)) // fs
        off = buf[o_off:o_soff].reshape(A, Bb, 2)
        if kv_b:  # each group's layer a relative to the chunk buffer's layer a (same dtype, any address)
            off[:, kv_b] = (np.array(kv_base) + self._attn_layers * np.array(kv_step)) // es  # [A, cached, 2]
        if (off % 16).any():  # the span kernel loads cached keys as 16-element vectors (kernels.span.attend_batch)
            raise NotBatched("a group's K/V is not aligned to 16 elements")
        if (soff % 16).any():  # so does the delta kernel a state (kernels.gdn.delta_batch)
            raise NotBatched("a piece's GDN states are not aligned to 16 elements")
        host = self._pack_snaps(pieces, buf, sizes, Bb) if snaps else None
        return buf, host

    def _pack_snaps(self, pieces: list[Piece], buf, sizes: list[int], Bb: int) -> list:
        """Each piece's snapshots into the buffer's last two parts (Snaps.at, Snaps.rows), slots in order."""
        wanted = sum(len(pc.snaps) for pc in pieces)
        if wanted > self.max_snaps:
            raise NotBatched(f"{wanted} snapshots exceed the {self.max_snaps} slots of a forward")
        o_rows = len(buf) - sizes[-1]
        at = buf[o_rows - sizes[-2] : o_rows].reshape(Bb, SNAPS_PER_PIECE, 2)
        at[:, :, 1] = -1
        host, slot, t, W1 = [], 0, 0, self.tail_rows
        for b, pc in enumerate(pieces):
            mine = []
            if len(pc.snaps) > SNAPS_PER_PIECE:
                raise NotBatched(f"a piece keeps at most {SNAPS_PER_PIECE} snapshots")
            for m, e in enumerate(pc.snaps):
                c = e - pc.s
                if not (max(SNAP_GAP, W1) <= c < pc.e - pc.s):
                    raise NotBatched(f"snapshot at {e} is not inside [{pc.s} + {max(SNAP_GAP, W1)}, {pc.e})")
                at[b, m] = (c, slot)
                buf[o_rows + slot * W1 : o_rows + (slot + 1) * W1] = np.arange(t + c - W1, t + c)
                mine.append((c, slot))
                slot += 1
            host.append(mine)
            t += pc.e - pc.s
        return host

    def _capture(self, Bb: int, Tb: int, snaps: bool) -> _Graph | None:
        inp = torch.zeros(sum(self._sizes(Bb, Tb, snaps)), dtype=torch.long)
        g = self._views(inp.to(self.device), Bb, Tb, snaps)  # all sequences empty: the warm-up runs touch no slot
        got = try_capture(lambda: self._forward(g, Bb, Tb, self._lmax(Tb), [], None), self.pool, self.stats,
                          self.failures, f"batch ({Bb}, {Tb}{', snapshots' if snaps else ''})")
        if got is None:
            return None
        g.graph, g.out = got
        g.staging = Staging(g.inp)
        return g

    def ensure(self, B: int, T: int, snaps: bool = False) -> tuple[int, int, bool]:
        """The shape of B sequences of T tokens (keeping snapshots or not), its graph captured (graphs); NotBatched
        if there is none."""
        key = self.shape(B, T, snaps)
        if key is None:
            raise NotBatched(f"{B} sequences of {T} tokens exceed the largest batch shape")
        if self.use_graphs and self._graph(key) is None:
            raise NotBatched(f"batch graph {key} failed to capture")
        return key

    def _graph(self, key: tuple[int, int, bool]) -> _Graph | None:
        """The graph of a (batch, tokens, snapshots) shape, captured on first use; None if its capture failed."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        return self.graphs[key]

    def ensure_pieces(self, pieces: list["Piece"]) -> tuple[int, int, bool]:
        """`ensure` for the forward of these pieces (call before `load`: a capture overwrites the slots)."""
        return self.ensure(len(pieces), sum(pc.e - pc.s for pc in pieces), any(pc.snaps for pc in pieces))

    def load(self, pieces: list[Piece]) -> None:
        """Gather each piece's conv tails into batch slot b (call after `ensure`: capture overwrites), and with the
        eager kernels its GDN states too (the Triton delta kernel reads them where they lie: `_pack`'s offsets)."""
        if len(pieces) == 1:
            self.st.conv[:, 0].copy_(pieces[0].conv)
        else:  # one gather, then one copy into the slots (two kernels on the GPU), not a copy per piece
            self.st.conv[:, : len(pieces)].copy_(torch.stack([pc.conv for pc in pieces], 1))
        if not self.bk.triton:
            for b, pc in enumerate(pieces):
                self.st.S[:, b].copy_(pc.S)

    def forward(self, pieces: list[Piece]) -> torch.Tensor:
        """One packed forward of `pieces` from the states `load` put in their slots -> probabilities
        [len(pieces), max_slots, MAX_OPTIONS] on the device (rows past a piece's slots are padding)."""
        if not pieces:
            raise ValueError("no pieces")
        S_shape, S_dtype = self.st.S.shape[:1] + self.st.S.shape[2:], self.st.S.dtype
        S_inner = self.st.S.stride()[2:]  # a contiguous layer's strides (the slots' own)
        slots_at = self.st.S.untyped_storage().data_ptr()
        lens = []
        for pc in pieces:
            n = pc.e - pc.s
            if not 0 < n <= self.max_piece or len(pc.slots) > self.max_slots:
                raise NotBatched(f"piece [{pc.s}, {pc.e}) with {len(pc.slots)} slots does not fit a batch")
            if pc.s and not (pc.K[0].is_contiguous() and pc.V[0].is_contiguous() and pc.K.shape[1] >= pc.s):
                raise NotBatched("a piece's K/V must be contiguous within each layer and hold [0, s)")
            if pc.S.shape != S_shape or pc.S.dtype != S_dtype or not (pc.S.stride()[1:] == S_inner
                                                                       or pc.S[0].is_contiguous()):
                raise NotBatched("a piece's GDN states must be float32 [G, Hv, Dk, Dv], each layer's contiguous")
            if pc.S.untyped_storage().data_ptr() == slots_at:  # read in place while other slots are written
                raise NotBatched("a piece's GDN states must not be a view of the batch slots")
            lens.append(n)
        B, T, L = len(pieces), sum(lens), max(lens)
        images, snapping = any(pc.has_image() for pc in pieces), any(pc.snaps for pc in pieces)
        # an eager forward needs no graph: only its shape (and a graph for a shape too large to have one: NotBatched)
        key = (self.shape(B, T, snapping) if images else None) or self.ensure(B, T, snapping)
        Bb, Tb, snaps = key
        if not self.use_graphs or images:  # eagerly (pieces holding image tokens: their positions and embeddings)
            inp, snap_host = self._pack(pieces, Bb, Tb, snaps)
            self._count(B, T, Tb)
            g = self._views(torch.from_numpy(inp).to(self.device), Bb, Tb, snaps)
            mm = self._multimodal(pieces, g.pos, Tb) if images else None
            with torch.no_grad():
                out = self._forward(g, Bb, Tb, L, [(pc.K, pc.V) for pc in pieces], lens + [0] * (Bb - B), snap_host,
                                    mm)
        else:  # packed straight into the graph's staging copy
            g = self._graph(key)
            self._send(g, lambda buf: self._pack(pieces, Bb, Tb, snaps, buf))
            self._count(B, T, Tb)
            g.graph.replay()
            out = g.out
        return out.view(Bb, self.max_slots, -1)[:B]

    def _multimodal(self, pieces: list[Piece], pos: torch.Tensor, Tb: int):
        """(positions [3, Tb], (index, embeddings) or None) of a forward holding image tokens: each text piece's
        positions as packed (equal in the three sections), each image piece's its row's multimodal positions and
        the vision tower's embeddings at its image tokens (statecache.run.images.RowImages.chunk)."""
        pos3 = pos.expand(3, Tb).clone()
        idx, vals, t = [], [], 0
        for pc in pieces:
            n = pc.e - pc.s
            if pc.has_image():
                p3, emb = pc.images.chunk(pc.s, pc.e, n)
                pos3[:, t : t + n] = p3
                if emb is not None:
                    idx.append(emb[0] + t)
                    vals.append(emb[1])
            t += n
        return pos3, ((torch.cat(idx), torch.cat(vals)) if idx else None)

    def _count(self, B: int, T: int, Tb: int) -> None:
        self.stats["forwards"] += 1
        self.stats["sequences"] += B
        self.stats["tokens"] += T
        self.stats["padded_tokens"] += Tb
        got = self.stats["buckets"].setdefault(str(Tb), [0, 0])  # str: the stats travel as JSON
        got[0] += 1
        got[1] += T

    @staticmethod
    def _send(g: _Graph, fill) -> None:
        """The graph's device input buffer filled through its pinned staging copy: fill(the staging copy's numpy
        view) once its previous copy has left, then one asynchronous copy."""
        st = g.staging
        if st.sent is None:  # a CPU stand-in graph (tests)
            fill(st.np)
            st.dev.copy_(st.host)
            return
        st.sent.synchronize()
        fill(st.np)
        st.dev.copy_(st.host, non_blocking=True)
        st.sent.record()

    def chunk_kv(self, pieces: list[Piece], b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of piece b's chunk K/V ([A, e - s, Hkv, D]) after a forward (valid until the next one)."""
        t = sum(pc.e - pc.s for pc in pieces[:b])
        n = pieces[b].e - pieces[b].s
        return self.st.K[:, t : t + n], self.st.V[:, t : t + n]

    def snapshot(self, pieces: list[Piece], b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of piece b's snapshots after a forward, in the order of its `snaps`: (conv tails [G, W - 1, C], GDN
        states [G, Hv, Dk, Dv]) each (valid until the next forward)."""
        slot = sum(len(pc.snaps) for pc in pieces[:b])
        return [(self.st.snap_conv[:, n], self.st.snap_S[:, n]) for n in range(slot, slot + len(pieces[b].snaps))]

    def read_later(self, out: torch.Tensor):
        """Start copying a forward's probabilities to the host behind it (before a later forward overwrites them) ->
        a function that waits for the copy and returns them (float32; its wait counted in stats["gpu_wait_s"])."""
        if out.device.type != "cuda":
            host = out.float().clone()
            return lambda: host
        host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> torch.Tensor:
            t0 = time.perf_counter()
            done.synchronize()
            self.stats["gpu_wait_s"] += time.perf_counter() - t0
            return host

        return wait

    def read(self, out: torch.Tensor) -> torch.Tensor:
        """A forward's probabilities on the host (float32), once the GPU is done."""
        if out.device.type != "cuda":
            return out.float()
        host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(out, non_blocking=True)
        wait_for_gpu(self.stats)
        return host

    def precapture(self, progress=sys.stderr) -> dict:
        """Capture every (batch, tokens) graph now, printing progress; returns the count and seconds spent."""
        t0 = time.perf_counter()
        keys = self.keys() if self.use_graphs else []
        for n, key in enumerate(keys, 1):
            self._graph(key)
            if progress is not None:
                print(f"\rbatch precapture {n}/{len(keys)} graphs ({time.perf_counter() - t0:.1f} s)", end="",
                      file=progress, flush=True)
        if progress is not None and keys:
            print(file=progress)
        return {"graphs": sum(g is not None for g in self.graphs.values()),
                "seconds": round(time.perf_counter() - t0, 2),
                "failed": self.failures[:3]}
