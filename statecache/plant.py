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

`PlantGraphs` runs a lone planting row as pieces of CUDA graphs cut at the delta rules (experimental, off by
default: statecache.engine.Engine.plant_with_graphs), the delta rules eagerly in between, split as above.

Knows nothing of the cache, its index or its policy: statecache.plain runs it, statecache.engine plants the result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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


# ---- a lone planting row as pieces of CUDA graphs --------------------------------------------------------------------

M_BUCKETS = (4, 8, 16, 32, 64, 128)  # checkpoints a lone planting row's graph has room for


@dataclass
class _Pieces:
    inp: torch.Tensor  # [T + 2 * S] long: ids | slots | nopts (see statecache.graphs.pack_inputs)
    conv_idx: torch.Tensor  # [M * (W - 1)] long: the positions whose conv inputs each checkpoint keeps
    out: torch.Tensor | None = None  # [S, n_letters]
    graphs: list = field(default_factory=list)  # G + 1 graphs: before the first delta rule, between each, after


class _StageMixer(PackedMixer):
    """The forward of one padded row with its delta rules taken out: each GDN layer's q, k, v, g, beta go to the
    stage buffers, `between(j)` runs (the delta rule, eagerly, or the switch to the next captured graph), and the
    layer goes on from the stage's output buffer. Conv tails are gathered at `conv_idx` into `tails`, the attention
    keys and values copied into `K`, `V` (all static buffers, so a graph captured over them serves every row)."""

    def __init__(self, kernels, cu, T: int, bufs: dict, conv_idx: torch.Tensor, between):
        super().__init__(kernels, cu, T)
        self.T, self.b, self.conv_idx, self.between = T, bufs, conv_idx, between

    def conv(self, j, x, w):
        torch.index_select(x, 0, self.conv_idx, out=self.b["tails"][j, : self.conv_idx.shape[0]])
        return super().conv(j, x, w)

    def delta(self, j, q, k, v, g, beta):
        T, b = self.T, self.b
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            b[name][:T].copy_(t)
        self.between(j)
        return b["o"][:T]

    def attend(self, a, q, k, v, scale):
        self.b["K"][a, : self.T].copy_(k)
        self.b["V"][a, : self.T].copy_(v)
        return super().attend(a, q, k, v, scale)


class PlantGraphs:
    """A lone row that plants, on CUDA: its forward (zero-padded to T tokens, like the plain path's single-row graphs)
    captured as G + 1 CUDA graphs, cut at each GDN layer's delta rule, which runs eagerly between the replays,
    split at the row's own checkpoint positions (PlantMixer.delta over the stage buffers). Graphs are keyed by
    (T, slot bucket, checkpoint bucket) only: the positions are data (the conv-tail gather index, the eager
    split), so one set of graphs serves every state of that padded length. The stage buffers are shared by all
    keys (sized for max_tokens). A shape that fails to capture is remembered; its rows run packed instead.
    Experimental: not the default (PlainPath(plant_graphs=True)); bench/gpu_plant.py times it."""

    def __init__(self, model, kernels, pool, max_tokens: int, stats: dict, failures: list[str]):
        self.model, self.kernels, self.pool, self.max_tokens = model, kernels, pool, max_tokens
        self.stats, self.failures = stats, failures
        self.graphs: dict[tuple[int, int, int], _Pieces | None] = {}
        self._bufs: dict | None = None

    def bufs(self) -> dict:
        """The stage buffers (allocated on first use, sized for max_tokens)."""
        if self._bufs is None:
            cfg, dev, dt, T = self.model.cfg, self.model.device, self.model.dtype, self.max_tokens
            G, A = len(cfg.linear_layers), len(cfg.full_layers)
            Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim)
            W1 = cfg.linear_conv_kernel_dim - 1
            e = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)  # noqa: E731
            self._bufs = {"q": e(T, Hk, Dk), "k": e(T, Hk, Dk), "v": e(T, Hv, Dv), "g": e(T, Hv, d=torch.float32),
                          "beta": e(T, Hv), "o": e(T, Hv, Dv), "tails": e(G, M_BUCKETS[-1] * W1, cfg.conv_dim),
                          "K": e(A, T, cfg.num_key_value_heads, cfg.head_dim),
                          "V": e(A, T, cfg.num_key_value_heads, cfg.head_dim)}
        return self._bufs

    def _forward(self, p: _Pieces, T: int, S: int, between) -> torch.Tensor:
        ids, slots, nopts = torch.split(p.inp, [T, S, S])
        dev = p.inp.device
        cu = torch.arange(0, 2 * T, T, dtype=torch.int32, device=dev)
        mix = _StageMixer(self.kernels, cu, T, self.bufs(), p.conv_idx, between)
        h = self.model.body(ids, torch.arange(T, device=dev), mix)
        return self.model.letter_probs(h.index_select(0, slots), nopts)

    def _eager_delta(self, j: int, T: int, plan_mixer: "PlantMixer") -> None:
        b = self.bufs()
        o = plan_mixer.delta(j, b["q"][:T], b["k"][:T], b["v"][:T], b["g"][:T], b["beta"][:T])
        b["o"][:T].copy_(o)

    def _capture(self, key) -> _Pieces | None:
        from .graphs import pack_inputs

        T, S, M = key
        W1 = self.model.cfg.linear_conv_kernel_dim - 1
        dev = self.model.device
        p = _Pieces(inp=pack_inputs(T, S).to(dev), conv_idx=torch.zeros(M * W1, dtype=torch.long, device=dev))
        t0 = time.perf_counter()
        try:
            warm = self._plan_mixer(T, [T])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):  # compiling and autotuning happen here, never inside a capture
                    self._forward(p, T, S, lambda j: self._eager_delta(j, T, warm))
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            state = {"g": torch.cuda.CUDAGraph()}

            def switch(j):
                state["g"].capture_end()
                p.graphs.append(state["g"])
                state["g"] = torch.cuda.CUDAGraph()
                state["g"].capture_begin(pool=self.pool)

            stream = torch.cuda.Stream()
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

    def _plan_mixer(self, T: int, plan: list[int]) -> PlantMixer:
        """A PlantMixer over the one padded sequence [0, T), used only for its split delta rule."""
        cfg = self.model.cfg
        cu = torch.tensor([0, T], dtype=torch.int32, device=self.model.device)
        return PlantMixer(self.kernels, cu, [T], [plan], len(cfg.linear_layers), len(cfg.full_layers))

    def key(self, n: int, n_slots: int, n_ckpts: int, bucket: int, slot_buckets) -> tuple[int, int, int] | None:
        T = -(-n // bucket) * bucket
        S = next((b for b in slot_buckets if n_slots <= b), None)
        M = next((b for b in M_BUCKETS if n_ckpts <= b), None)
        if T > self.max_tokens or S is None or M is None:
            return None
        return T, S, M

    def run(self, key, ids, slots, nopts, plan: list[int], eager: bool = False):
        """-> (probs per slot, Planted), or None when the shape has no graph. eager: run the same pieces without
        graphs (the CPU tests' form of this path)."""
        from .graphs import fill_inputs

        T, S, M = key
        cfg = self.model.cfg
        W1 = cfg.linear_conv_kernel_dim - 1
        if plan[0] < W1:
            return None  # the tail gather assumes W - 1 inputs before every position (align >= W - 1)
        if eager:
            p = _Pieces(inp=torch.empty(T + 2 * S, dtype=torch.long, device=self.model.device),
                        conv_idx=torch.zeros(M * W1, dtype=torch.long, device=self.model.device))
        else:
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)
            p = self.graphs[key]
            if p is None:
                return None
        host = torch.empty(T + 2 * S, dtype=torch.long)
        fill_inputs(host.numpy(), T, S, ids, slots, nopts)
        idx = torch.zeros(M * W1, dtype=torch.long)
        idx[: len(plan) * W1] = torch.tensor([c - W1 + r for c in plan for r in range(W1)])
        p.inp.copy_(host)
        p.conv_idx.copy_(idx)
        pm = self._plan_mixer(T, plan)
        if eager:
            out = self._forward(p, T, S, lambda j: self._eager_delta(j, T, pm))
        else:
            for j, g in enumerate(p.graphs[:-1]):
                g.replay()
                self._eager_delta(j, T, pm)
            p.graphs[-1].replay()
            out = p.out
        b = self.bufs()
        pl = pm.planted[0]
        pl.conv = [b["tails"][:, i * W1 : (i + 1) * W1].clone() for i in range(len(plan))]
        pl.K, pl.V = b["K"][:, : plan[-1]].clone(), b["V"][:, : plan[-1]].clone()
        probs = out[: len(slots)].float().cpu()
        return [probs[k, : nopts[k]].tolist() for k in range(len(slots))], pl
