"""Checkpoints out of a packed forward: the plain path's batch leaves the states the cache would have planted.

`PlantMixer` is the packed mixer (statecache.mixers.PackedMixer: B sequences from nothing, cu_seqlens) that also
keeps, for each sequence given checkpoint positions (`plans`), the model state after each of those positions:
- GDN recurrent state S, float32 and exact: the delta rule of the batch runs as successive calls split at the
  checkpoint positions, call k packing segment k of every sequence that has one (cu_seqlens), each starting from
  the previous call's final state of that sequence (`initial_state`), with `output_final_state`. Only the delta
  rule is split; the projections, conv, attention and MLP run once over all tokens. A call with one sequence takes
  its segment as a slice (no gather), and one of at most 64 tokens goes through `kernels.delta_into` (on CUDA the
  one-chunk Triton kernel) instead of a chunked call.
- conv tails: the last W - 1 conv inputs before each position (zeros before the sequence start), gathered from the
  conv's input;
- attention K/V of [0, p) (p: the sequence's last checkpoint position), copied out of the keys and values the
  packed attention computes anyway.
Each checkpoint's tensors are allocated on their own (no views into a shared buffer), so the cache's byte count
and eviction free what they say. The shapes match statecache.mixers.ChunkState: conv [G, W - 1, C] (model dtype),
S [G, Hv, Dk, Dv] float32, K, V [A, p, Hkv, D].

`PlantGraph` runs a lone planting row as CUDA graphs (one per padded length, in pieces of a few layers so that
short work can run in between), its checkpoints taken with their positions as data: the form a new page takes when
it has a graph; packs of rows, image rows and plans it cannot hold (with `unaligned` off, every plan with a position
off the 64-token chunks) take `PlantMixer`.

Knows nothing of the cache, its index or its policy: statecache.plain runs it, statecache.engine plants the result.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .graphs import MAX_OPTIONS, fill_inputs, input_size, n_options, side_stream, wait_for_gpu
from .mixers import PackedMixer


@dataclass
class Planted:
    """What one sequence of a planting forward left: checkpoints at `positions` (ascending, relative to the
    sequence), each (conv [G, W - 1, C], S [G, Hv, Dk, Dv] float32), and the attention K, V [A, p, Hkv, D] of
    [0, p) with p = positions[-1]."""

    positions: list[int]
    conv: list[torch.Tensor] = field(default_factory=list)
    S: list[torch.Tensor] = field(default_factory=list)
    K: torch.Tensor | None = None
    V: torch.Tensor | None = None

    @property
    def p(self) -> int:
        return self.positions[-1]

    def snaps(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(pos, conv, S) per checkpoint: the form StateCache plants."""
        return list(zip(self.positions, self.conv, self.S))


@dataclass
class _Call:
    """One delta-rule call of the split: segment k of each participating sequence."""

    idx: torch.Tensor  # [T_k] long (device): the packed tokens of the segments, in sequence order
    cu: torch.Tensor | None  # [N_k + 1] int32 (device), None for one sequence
    prev: torch.Tensor | None  # [N_k] long (device): each participant's row among the previous call's, None: all
    saves: list[tuple[int, int, int]]  # (row in this call, planted index, checkpoint index) for segments ending at one
    span: tuple[int, int] | None = None  # one member: its packed tokens [a, e) (sliced, not gathered)


def _check_plan(plan: list[int], n: int) -> list[int]:
    if not plan:
        raise ValueError("a plan needs at least one checkpoint position")
    if any(b <= a for a, b in zip(plan, plan[1:])) or plan[0] <= 0 or plan[-1] > n:
        raise ValueError(f"checkpoint positions {plan} must be ascending in (0, {n}]")
    return list(plan)


class PlantMixer(PackedMixer):
    """PackedMixer that leaves checkpoints. lens: each sequence's length; plans: per sequence its checkpoint
    positions (ascending, in (0, len]) or None (nothing to keep); n_gdn, n_attn: the model's GDN and attention
    layer counts. After the forward, `planted[b]` is sequence b's `Planted` (None where its plan was None)."""

    def __init__(self, kernels, cu: torch.Tensor, lens: list[int], plans: list[list[int] | None], n_gdn: int,
                 n_attn: int):
        super().__init__(kernels, cu, max(lens))
        if len(plans) != len(lens):
            raise ValueError(f"{len(plans)} plans for {len(lens)} sequences")
        dev = cu.device
        self.lens, self.n_gdn, self.n_attn = list(lens), n_gdn, n_attn
        self.starts = [0]
        for n in lens:
            self.starts.append(self.starts[-1] + n)
        self.plans = [None if pl is None else _check_plan(pl, n) for pl, n in zip(plans, lens)]
        self.planted: list[Planted | None] = [None if pl is None else Planted(pl) for pl in self.plans]
        self.calls = self._split(dev)
        self.short_max = 64  # segments of one sequence up to this many tokens take kernels.delta_into

    def _split(self, dev) -> list[_Call]:
        """The delta-rule calls: sequence b's segments are [0, c1), [c1, c2), ..., [cm, n_b) (the last dropped when
        empty); call k packs segment k of every sequence that has one."""
        bounds = []
        for b, n in enumerate(self.lens):
            cuts = [c for c in (self.plans[b] or []) if c < n]
            bounds.append([0, *cuts, n])
        calls: list[_Call] = []
        prev_members: list[int] | None = None
        for k in range(max(len(x) - 1 for x in bounds)):
            members = [b for b, x in enumerate(bounds) if len(x) - 1 > k]
            pieces, cu, saves = [], [0], []
            for r, b in enumerate(members):
                a, e = bounds[b][k], bounds[b][k + 1]
                pieces.append(torch.arange(self.starts[b] + a, self.starts[b] + e))
                cu.append(cu[-1] + e - a)
                plan = self.plans[b]
                if plan is not None and e in plan:
                    saves.append((r, b, plan.index(e)))
            prev = None
            if prev_members is not None and members != prev_members:
                prev = torch.tensor([prev_members.index(b) for b in members], dtype=torch.long, device=dev)
            one = len(members) == 1
            b0 = members[0]
            span = (self.starts[b0] + bounds[b0][k], self.starts[b0] + bounds[b0][k + 1])
            calls.append(_Call(idx=torch.cat(pieces).to(dev),
                               cu=None if one else torch.tensor(cu, dtype=torch.int32, device=dev),
                               prev=prev, saves=saves, span=span if one else None))
            prev_members = members
        return calls

    # ---- the stateful parts, keeping what the cache needs ---------------------------------------------------------

    def conv(self, j: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        W1 = w.shape[-1] - 1
        for b, pl in enumerate(self.planted):
            if pl is None:
                continue
            if j == 0:
                pl.conv = [torch.zeros(self.n_gdn, W1, x.shape[-1], dtype=x.dtype, device=x.device)
                           for _ in pl.positions]
            s = self.starts[b]
            for c, dst in zip(pl.positions, pl.conv):
                m = min(W1, c)  # inputs before the sequence start stay zero (the empty state's)
                dst[j, W1 - m :].copy_(x[s + c - m : s + c])
        return super().conv(j, x, w)

    def delta(self, j, q, k, v, g, beta):
        if len(self.calls) == 1 and not self.calls[0].saves:
            return super().delta(j, q, k, v, g, beta)
        one_seq = len(self.lens) == 1  # every call a slice, in order: the outputs joined by one cat
        outs, o, S = [], None, None
        for call in self.calls:
            init = None if S is None else (S if call.prev is None else S.index_select(0, call.prev))
            if call.span is not None:  # one sequence in this call: its segment is a slice
                a, e = call.span
                parts = [t[a:e] for t in (q, k, v, g, beta)]
                if e - a <= self.short_max:  # a short segment: the one-chunk kernel, from a copy of the state
                    S = self._S0(q, v) if init is None else init.clone()
                    out = self.k.delta_into(*parts, S[0])[None]
                else:
                    out, S = self.k.delta(*(t[None] for t in parts), init, None)
            else:
                parts = [t.index_select(0, call.idx)[None] for t in (q, k, v, g, beta)]
                out, S = self.k.delta(*parts, init, call.cu)
            if one_seq:
                outs.append(out[0])
            else:
                if o is None:
                    o = out.new_empty((q.shape[0],) + tuple(out.shape[2:]))
                if call.span is not None:
                    o[call.span[0] : call.span[1]].copy_(out[0])
                else:
                    o.index_copy_(0, call.idx, out[0])
            for r, b, i in call.saves:
                pl = self.planted[b]
                if j == 0 and i == 0:
                    pl.S = [torch.empty((self.n_gdn,) + tuple(S.shape[1:]), dtype=torch.float32, device=S.device)
                            for _ in pl.positions]
                pl.S[i][j].copy_(S[r])
        return torch.cat(outs) if one_seq else o

    def _S0(self, q, v) -> torch.Tensor:
        """An empty state [1, Hv, Dk, Dv] float32 (a short first segment's start)."""
        return torch.zeros(1, v.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float32, device=q.device)

    def attend(self, a, q, k, v, scale):
        for b, pl in enumerate(self.planted):
            if pl is None:
                continue
            s, p = self.starts[b], pl.p
            if a == 0:
                pl.K = k.new_empty((self.n_attn, p) + tuple(k.shape[1:]))
                pl.V = v.new_empty((self.n_attn, p) + tuple(v.shape[1:]))
            pl.K[a].copy_(k[s : s + p])
            pl.V[a].copy_(v[s : s + p])
        return super().attend(a, q, k, v, scale)


# ---- a lone planting row as CUDA graphs ----------------------------------------------------------------------------

SNAP_SLOTS = 8  # checkpoints a planting graph keeps: chunk-aligned ones in slots 0.. (with `unaligned`, the last one
# kept for one unaligned position)
CHUNK = 64  # the delta rule's chunk: states at multiples of this come from the chunked kernels as they run


@dataclass
class _Pieces:
    inp: torch.Tensor  # [input_size(T, S, 0)] long: ids | slots | options (statecache.graphs.fill_inputs)
    idx: torch.Tensor  # [M * (W - 1) + M + CHUNK + 1] long: conv-tail positions | chunk per slot | the last slot's
    # chunk tokens | how many of them count (0 unless it holds an unaligned checkpoint; see PlantGraph.layout). The
    # same layout with `unaligned` off, whose forward never reads the last two parts
    out: torch.Tensor | None = None  # [S, MAX_OPTIONS]
    graphs: list = field(default_factory=list)  # one per piece of layers (cut every `every` layers)


class _GraphPlantMixer(PackedMixer):
    """The packed mixer of one padded row that also keeps what a planting needs, all in static buffers and with the
    positions as data (so one graph serves every row of its padded length): each GDN layer's conv inputs at the
    checkpoints' tails (gathered), its delta-rule states at the checkpoints' chunk starts (`delta_states`), and the
    attention K/V. With `advance` the last slot is then advanced through its checkpoint's tokens past its chunk
    start (the one-chunk kernel, the other tokens of that chunk masked out with g = 0 and beta = 0; none count when
    that checkpoint is aligned): an unaligned checkpoint's state. Without it no layer runs that kernel, and the last
    slot is a chunk start like the others. `cut(i)` runs after every `every` layers but the last (a graph piece ends
    there; eagerly, the caller's `between`)."""

    def __init__(self, kernels, cu, T: int, bufs: dict, idx: torch.Tensor, W1: int, n_layers: int, every: int, cut,
                 advance: bool):
        super().__init__(kernels, cu, T)
        M = SNAP_SLOTS
        self.T, self.b, self.n_layers, self.every, self.cut = T, bufs, n_layers, every, cut
        self.conv_idx, self.at, self.adv_idx, adv_len = torch.split(idx, [M * W1, M, CHUNK, 1])
        self.advance = advance
        if advance:
            self.adv_live = (torch.arange(CHUNK, device=idx.device) < adv_len)[:, None]  # [CHUNK, 1]

    def after_layer(self, i: int) -> None:
        if self.every > 0 and (i + 1) % self.every == 0 and i + 1 < self.n_layers:
            self.cut(i)

    def conv(self, j, x, w):
        torch.index_select(x, 0, self.conv_idx, out=self.b["tails"][j])
        return super().conv(j, x, w)

    def delta(self, j, q, k, v, g, beta):
        o, states = self.k.delta_states(q[None], k[None], v[None], g[None], beta[None], self.at)
        S = self.b["S"][j]
        S.copy_(states)
        if self.advance:
            q1, k1, v1 = (t.index_select(0, self.adv_idx) for t in (q, k, v))
            g1 = g.index_select(0, self.adv_idx) * self.adv_live
            b1 = beta.index_select(0, self.adv_idx) * self.adv_live.to(beta.dtype)
            self.k.delta_into(q1, k1, v1, g1, b1, S[-1])
        return o[0]

    def attend(self, a, q, k, v, scale):
        self.b["K"][a, : self.T].copy_(k)
        self.b["V"][a, : self.T].copy_(v)
        return super().attend(a, q, k, v, scale)


class PlantGraph:
    """A lone row that plants, as CUDA graphs: its whole forward zero-padded to T tokens (`pad`: a multiple of
    `bucket // 2` up to `fine_tokens`, as the plain path's lone graphs pad, then of `bucket`), captured once per
    (T, slot bucket) and cut into pieces every `every` layers, so that a caller's `between` (short
    work that arrived meanwhile) runs between the pieces, as it does between the layers of an eager packed forward.
    The checkpoints come out of that same forward with their positions as data: chunk-aligned positions take the
    delta rule's own per-chunk states (`kernels.delta_states`). With `unaligned`, at most one position off the chunks
    (a cache aligned to less than 64 tokens) takes its chunk start's state advanced by the one-chunk kernel, which
    then runs in every GDN layer of every row whatever its plan (a kernel and a few gathers per layer); so it is off
    by default, since at the cache's default alignment of 64 every position is a chunk start. Conv tails are
    gathered, K/V copied out of static buffers. So a new state costs its plain forward plus those copies, with no
    Python per delta-rule call and no capture while serving (`precapture`). A plan this layout cannot hold (more
    aligned positions than SNAP_SLOTS, or SNAP_SLOTS - 1 with `unaligned`; an unaligned position without
    `unaligned`, two with it; a first position inside the conv window) or a shape with no graph gives None: the
    caller runs the row packed (PlantMixer). On CUDA the states at chunk starts are fla's, kept in the model dtype
    and widened to float32 (the chunked path's are float32 throughout); on the CPU they are the reference's float32
    states, so the packed planting forward's checkpoints are matched exactly.
    graphs=False runs the same forward eagerly (the CPU tests' form; `between` then runs between the pieces too)."""

    def __init__(self, model, kernels, pool, max_tokens: int, stats: dict, failures: list[str], *, bucket: int = 128,
                 fine_tokens: int = 4608, every: int = 4, graphs: bool = True, unaligned: bool = False):
        self.model, self.kernels, self.pool = model, kernels, pool
        self.unaligned = unaligned  # the graphs advance the last slot to an unaligned position (the caller decides)
        self.bucket, self.max_tokens, self.every = bucket, max_tokens - max_tokens % bucket, every
        # new pages of up to fine_tokens pad to half a bucket: on an H200 at the 9B shape a 2432 + 64-token row padded
        # to 2560 took 1.068x its plain graph (padded to 2496), one of 4096 + 64 tokens 1.017x (bench/README.md,
        # session 9); 4608: a 4096-token state and its question; the finer steps cost ~34 more graphs at start-up
        self.fine_tokens = fine_tokens - fine_tokens % (bucket // 2)
        self.stats, self.failures, self.use_graphs = stats, failures, graphs
        self.W1 = model.cfg.linear_conv_kernel_dim - 1
        self.graphs: dict[tuple[int, int], _Pieces | None] = {}
        self._bufs: dict | None = None
        # the planter's own stream: every capture records on it (so its graphs have a cuBLAS workspace of their own);
        # the pieces replay on the caller's stream, a stop after the piece before it
        self._stream = torch.cuda.Stream(device=model.device) if graphs and model.device.type == "cuda" else None

    def bufs(self) -> dict:
        """The static buffers, shared by every shape (allocated on first use, sized for max_tokens)."""
        if self._bufs is None:
            cfg, dev, dt, T, M = self.model.cfg, self.model.device, self.model.dtype, self.max_tokens, SNAP_SLOTS
            G, A = len(cfg.linear_layers), len(cfg.full_layers)
            e = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)  # noqa: E731
            self._bufs = {"tails": e(G, M * self.W1, cfg.conv_dim),
                          "S": e(G, M, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                 d=torch.float32),
                          "K": e(A, T, cfg.num_key_value_heads, cfg.head_dim),
                          "V": e(A, T, cfg.num_key_value_heads, cfg.head_dim)}
        return self._bufs

    def key(self, n: int, n_slots: int, slot_buckets) -> tuple[int, int] | None:
        """(padded length, slot bucket) of a row of n tokens, or None when it is longer than max_tokens."""
        T = self.pad(n)
        S = next((b for b in slot_buckets if n_slots <= b), None)
        if T > self.max_tokens or S is None:
            return None
        return T, S

    def layout(self, plan: list[int], T: int) -> tuple[list[int], list[int]] | None:
        """plan (ascending positions) -> (the idx buffer's values, each position's slot), or None when the layout
        cannot hold it (see the class docstring; also a position at or past the padded end T). Unused slots gather
        the conv inputs at position 0 and the state at chunk 0; they are never planted. With `unaligned` the last
        slot is kept for an unaligned position; without it every slot can take an aligned one."""
        M, W1 = SNAP_SLOTS, self.W1
        aligned = [c for c in plan if c % CHUNK == 0]
        odd = [c for c in plan if c % CHUNK]
        n_aligned = M - 1 if self.unaligned else M
        if (not plan or len(odd) > (1 if self.unaligned else 0) or len(aligned) > n_aligned or plan[0] < W1
                or plan[-1] >= T):
            return None
        at_slot = aligned + [0] * (n_aligned - len(aligned)) + ([odd[0] if odd else 0] if self.unaligned else [])
        conv = [max(c - W1 + r, 0) for c in at_slot for r in range(W1)]
        chunk = [c // CHUNK for c in at_slot]
        a = at_slot[-1] - at_slot[-1] % CHUNK
        adv = [min(a + r, T - 1) for r in range(CHUNK)]
        slot = {c: m for m, c in enumerate(aligned)}
        if odd:
            slot[odd[0]] = M - 1
        return conv + chunk + adv + [at_slot[-1] - a], [slot[c] for c in plan]

    def _forward(self, p: _Pieces, T: int, S: int, cut) -> torch.Tensor:
        ids, slots, options = torch.split(p.inp, [T, S, S * MAX_OPTIONS])
        dev = p.inp.device
        cu = torch.arange(0, 2 * T, T, dtype=torch.int32, device=dev)
        mix = _GraphPlantMixer(self.kernels, cu, T, self.bufs(), p.idx, self.W1, len(self.model.w.layers),
                               self.every, cut, self.unaligned)
        h = self.model.body(ids, torch.arange(T, device=dev), mix)
        return self.model.option_probs(h.index_select(0, slots), options.view(S, MAX_OPTIONS))

    def _new(self, T: int, S: int) -> _Pieces:
        dev = self.model.device
        n_idx = SNAP_SLOTS * self.W1 + SNAP_SLOTS + CHUNK + 1
        p = _Pieces(inp=torch.zeros(input_size(T, S, 0), dtype=torch.long, device=dev),
                    idx=torch.zeros(n_idx, dtype=torch.long, device=dev))
        p.idx[SNAP_SLOTS * self.W1 + SNAP_SLOTS :][:CHUNK].copy_(torch.arange(CHUNK))  # a valid warm-up layout
        return p

    def _capture(self, key: tuple[int, int]) -> _Pieces | None:
        T, S = key
        p = self._new(T, S)
        t0 = time.perf_counter()
        try:
            side = side_stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                # compiling and autotuning happen here, never inside a capture (after the first shape, one pass: the
                # kernels have met every class of length a multiple of 64 can be)
                for _ in range(2 if not any(self.graphs.values()) else 1):
                    self._forward(p, T, S, lambda i: None)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            state = {"g": torch.cuda.CUDAGraph()}

            def switch(i):
                state["g"].capture_end()
                p.graphs.append(state["g"])
                state["g"] = torch.cuda.CUDAGraph()
                state["g"].capture_begin(pool=self.pool)

            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                state["g"].capture_begin(pool=self.pool)
                try:
                    p.out = self._forward(p, T, S, switch)
                finally:
                    state["g"].capture_end()
                p.graphs.append(state["g"])
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            return p
        except Exception as e:  # noqa: BLE001 - rows of this shape run packed
            torch.cuda.synchronize()
            self.failures.append(f"plant {key}: {type(e).__name__}: {str(e)[:200]}")
            self.stats["capture_failed"] += 1
            return None
        finally:
            self.stats["captures"] += 1
            self.stats["capture_s"] += time.perf_counter() - t0

    def pad(self, n: int) -> int:
        """The padded length of a row of n tokens (at least one step)."""
        step = self.bucket // 2 if n <= self.fine_tokens else self.bucket
        return max(step, -(-n // step) * step)

    def lengths(self, min_tokens: int = 1) -> list[int]:
        """Every padded length from that of min_tokens up to max_tokens."""
        out, T = [], self.pad(max(1, min_tokens))
        while T <= self.max_tokens:
            out.append(T)
            T = self.pad(T + 1)
        return out

    def keys(self, min_tokens: int, slot_bucket: int) -> list[tuple[int, int]]:
        return [(T, slot_bucket) for T in self.lengths(min_tokens)]

    def precapture(self, min_tokens: int, slot_bucket: int, progress=sys.stderr) -> dict:
        """Capture the graphs of every padded length from min_tokens to max_tokens (one slot bucket) now."""
        t0 = time.perf_counter()
        keys = self.keys(min_tokens, slot_bucket) if self.use_graphs else []
        for n, key in enumerate(keys, 1):
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)
            if progress is not None:
                print(f"\rplanting precapture {n}/{len(keys)} graphs ({time.perf_counter() - t0:.1f} s)", end="",
                      file=progress, flush=True)
        if progress is not None and keys:
            print(file=progress)
        return {"graphs": sum(g is not None for g in self.graphs.values()), "seconds": round(time.perf_counter() - t0, 2)}

    def capture(self, n: int, n_slots: int, slot_buckets) -> bool:
        """Capture the graph a row of n tokens and n_slots answer slots needs, if it has none yet; whether it has
        one now (benchmarks; the engine captures everything up front with `precapture`)."""
        key = self.key(n, n_slots, slot_buckets)
        if key is None or not self.use_graphs:
            return False
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        return self.graphs[key] is not None

    def _fit(self, n: int, n_slots: int, plan: list[int], slot_buckets):
        """(key, layout) of a row `run` can take (a layout for its plan, a graph for its shape, or eager mode), or
        None."""
        key = self.key(n, n_slots, slot_buckets)
        if key is None or (self.use_graphs and self.graphs.get(key) is None):
            return None
        lay = self.layout(plan, key[0])
        return None if lay is None else (key, lay)

    def can(self, n: int, n_slots: int, plan: list[int], slot_buckets) -> bool:
        """Would `run` take this row?"""
        return self._fit(n, n_slots, plan, slot_buckets) is not None

    def run(self, ids, slots, options, plan: list[int], slot_buckets, between=None):
        """-> (probs per slot, Planted), or None when the row cannot run here (see `can`). Never captures: a shape
        without a graph gives None."""
        plan = _check_plan(plan, len(ids))
        fit = self._fit(len(ids), len(slots), plan, slot_buckets)
        if fit is None:
            return None
        (T, S), (idx, slot_of) = fit
        p = self._new(T, S) if not self.use_graphs else self.graphs[(T, S)]
        host = torch.empty(input_size(T, S, 0), dtype=torch.long)
        fill_inputs(host.numpy(), T, S, ids, slots, options)
        p.inp.copy_(host)
        p.idx.copy_(torch.tensor(idx, dtype=torch.long))
        if not self.use_graphs:
            with torch.no_grad():
                out = self._forward(p, T, S, lambda i: between() if between is not None else None)
        else:
            for k, g in enumerate(p.graphs):
                g.replay()
                if between is not None and k + 1 < len(p.graphs):
                    between()
            out = p.out
        b, W1 = self.bufs(), self.W1
        pl = Planted(list(plan))
        pl.conv = [b["tails"][:, m * W1 : (m + 1) * W1].clone() for m in slot_of]
        pl.S = [b["S"][:, m].clone() for m in slot_of]
        pl.K, pl.V = b["K"][:, : plan[-1]].clone(), b["V"][:, : plan[-1]].clone()
        if out.device.type == "cuda":
            wait_for_gpu(self.stats)
        probs = out[: len(slots)].float().cpu()
        return [probs[k, : n_options(options[k])].tolist() for k in range(len(slots))], pl
