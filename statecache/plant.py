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

Rows the step loop (statecache.step) does not take plant here, eagerly; the step loop plants through its own
batched runner.

Knows nothing of the cache, its index or its policy: statecache.plain runs it, statecache.engine plants the result.
"""

from __future__ import annotations

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
