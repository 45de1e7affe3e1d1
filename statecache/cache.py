"""The cross-request state cache: a row continues from the deepest saved model state its tokens share.

A row is [state | question]; p = state_len rounded down to `align`. The cache looks up the deepest checkpoint
whose tokens equal the row's up to it (statecache.index), restores it into the runner's static buffers, runs
the rest of the state as chunks ending at the planned checkpoint positions (every multiple of `stride`,
p - `tail`, p), snapshotting after each, then the question [p, n) as the last chunk, which gives the answer.
The checkpoints one row plants form a group sharing that row's attention K/V of [0, p), stored once.
An LRU bounded in bytes (states, conv tails and each group's K/V once) is enforced after every row. What the
device budget cannot keep moves to the host tier (statecache.index's two tiers; statecache.tiers.HostPool's buffer,
pinned on CUDA, `host_mb`), dropped from there by its own LRU; a row whose deepest checkpoint is on the host gets it
copied back into the device budget first (`bring`, evicting others to the host) and runs as a hit.
Fork points: where a row's state shares an aligned prefix [0, x) with a cached group but no checkpoint sits at x
(a new page after the same goal and steps), x joins the row's plan (`fork_point`), so the next change reuses [0, x);
the tokens that prefix held beyond the restored checkpoint count as `tokens_lost`.
With specialists (the runner's `spec`), a checkpoint also holds the router's feature sum over its tokens and is
planted under the route its adapter layers ran with; `row` guesses a route and reruns a misprediction.

Image rows (statecache.vision.RowImages) are known to the index by their key tokens: each image-pad token replaced
by a key derived from its image's sha256, so the same screenshot with a new question is a hit and a different one
at the same place never matches. A checkpoint after an image needs no stored rotary offset: the offset at a
position is a function of the tokens before it (the images' grids), which the lookup proved equal, so the row's
own positions (RowImages) continue it; chunks holding image tokens run eagerly with the image embeddings.

`row` returns None when the row must take the plain path instead: it is not eligible or a chunk shape cannot be
captured. A new state can also be planted from outside: `plan` gives its checkpoint positions, a packed forward
(statecache.plain with statecache.plant) computes them, and `plant_planted` stores them as one group, in the payload
format `row` plants (so later rows hit them through `row`; an image row's group under its key tokens). Whether a new
state is planted at all is not decided here (statecache.policy; statecache.engine asks it). This module knows
nothing of Redis, text, the memo or batching: statecache.engine decides which rows come here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .budget import MIB, host_available_bytes, host_budget
from .graphs import n_options
from .index import DEVICE, Checkpoint, CheckpointIndex, plan_chunks, state_end
from .runner import ChunkRunner
from .tiers import HostPool

log = logging.getLogger("statecache.cache")


@dataclass
class CacheSettings:
    mb: int = 1024  # LRU bound on everything held (MiB); 0 turns the cached path off
    stride: int = 2048  # a checkpoint at every multiple of this below the state end (0: none)
    tail: int = 16  # and one at state end - tail (0: none)
    align: int = 64  # checkpoint positions and chunk starts: multiples of this (fla's delta-rule chunk)
    min_prefix: int = 256  # shorter states take the plain path
    max_slots: int = 4  # answer slots a cached row may have
    host_mb: int | None = None  # the host tier's bound (MiB); None: from the host's memory (statecache.budget); 0: off


@dataclass
class Answer:
    probs: list[list[float]]
    path: str  # hit | partial | cold
    reused: int  # tokens restored from a checkpoint
    computed: int  # tokens run (both runs of a misprediction)
    route: int | None = None  # the specialists route the answer was computed with (None: no specialists)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class StateCache:
    def __init__(self, runner: ChunkRunner, settings: CacheSettings | None = None):
        self.runner = runner
        self.s = settings or CacheSettings()
        if self.s.max_slots > runner.max_slots:
            raise ValueError(f"max_slots {self.s.max_slots} > the runner's {runner.max_slots}")
        self.host_budget = host_budget(self.s.host_mb, host_available_bytes() if self.s.host_mb is None else None)
        host_bytes = self.host_budget.mb * MIB if self.s.mb > 0 else 0
        self.index = CheckpointIndex(self.s.mb * 2**20, align=self.s.align, host_budget_bytes=host_bytes)
        self.host = HostPool(host_bytes, runner.st.S.device) if host_bytes else None  # slabs as it fills
        self.index.tiers = self.host
        self.last_route = 0  # specialists: the route guessed for a row with no checkpoint
        self.batch = None  # a statecache.batch.BatchRunner: enables rows_batched (text rows, with or without specialists)
        self._serial = 0  # groups' serial numbers: the static K/V buffers' owner tag (see _restore)
        self.stats = {"rows": 0, "hits": 0, "partial": 0, "cold": 0, "tokens_reused": 0,
                      "tokens_computed": 0, "ckpts_made": 0, "evicted": 0, "mispredict": 0,
                      "restored_device": 0, "restored_host": 0, "tokens_lost": 0, "forks": 0}

    # ---- what may come here ---------------------------------------------------------------------------------------

    def state_end(self, state_len: int) -> int:
        """p: the state's end rounded down to `align`, where its deepest checkpoint sits (statecache.index.state_end)."""
        return state_end(state_len, self.s.align)

    def eligible(self, state_len: int, slots) -> bool:
        """May this row's state be cached: a long enough state, 1..max_slots slots, all at or after p (rows with
        images too: see the module docstring). Whether a runner can run it is the runner's to say: the step loop
        takes every length up to the longest row; `row` declines what the chunk runner's shapes cannot hold."""
        p = self.state_end(state_len)
        if self.s.mb <= 0 or p < self.s.min_prefix or not 0 < len(slots) <= self.s.max_slots:
            return False
        return min(slots) >= p

    def plan(self, state_len: int, start: int = 0, fork: int = 0) -> list[int]:
        """The checkpoint positions a state of state_len tokens plants, continuing from `start` (0: nothing
        restored), with the fork point `fork` (0: none; `fork_point`): the chunk ends of
        statecache.index.plan_chunks, as `row` runs them."""
        return plan_chunks(start, state_len, stride=self.s.stride, tail=self.s.tail, align=self.s.align,
                           max_chunk=self.runner.max_chunk, extra=(fork,) if fork else ())

    def fork_point(self, keys, p: int, c0: int) -> int:
        """The deepest aligned position x <= p to which a cached group shares the row's tokens (index.shared_depth)
        when it lies past the restored position c0 (else 0): the prefix [c0, x) is recomputed though it was cached,
        and counted as `tokens_lost`; planting a checkpoint at x lets the next row sharing it reuse it. Asked once per
        row that runs, before it plants."""
        x = self.index.shared_depth(keys, p) if len(self.index) else 0
        if x <= c0:
            return 0
        self.stats["tokens_lost"] += x - c0
        if x >= p:  # p itself is always planned
            return 0
        self.stats["forks"] += 1
        return x

    def bring(self, c: Checkpoint | None, keys, limit: int, route: int | None = None) -> Checkpoint | None:
        """The checkpoint a row will restore, on the device: one on the host tier is copied back (statecache.index
        promote, evicting others to the host); one that cannot fit the device budget at all gives way to the deepest
        device checkpoint. Counts the row's restore by tier."""
        if c is not None and c.tier != DEVICE:
            if self.index.promote(c):
                self.stats["restored_host"] += 1
                return c
            c = self.index.lookup(keys, limit=limit, route=route, host=False)
        if c is not None:
            self.stats["restored_device"] += 1
        return c

    def state_bytes(self, state_len: int) -> int:
        """Bytes a new state of state_len tokens takes here once planted: per checkpoint the GDN states and conv
        tails, and the group's attention K/V of [0, p) once."""
        st = self.runner.st
        p = self.state_end(state_len)
        per_pos = (st.K[:, :1].numel() * st.K.element_size()) * 2
        return len(self.plan(state_len)) * _nbytes(st.conv, st.S) + p * per_pos

    # ---- a row ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def row(self, ids, state_len: int, slots: list[int], nopts: list, images=None,
            known_route: int | None = None) -> Answer | None:
        """One eligible row (ids: a list of ints, as rows arrive, or an int64 array) -> its Answer, or None for the
        plain path. nopts: per slot its options, a count (the model's first letters) or the option token ids
        (statecache.graphs.fill_options). images: the row's statecache.vision.RowImages, or None; the index knows an image row by its
        key tokens (images.keys), not its ids. known_route (specialists): the route the row is known to take (a batched
        run's router has spoken), so it runs with it from the start instead of guessing.

        With specialists the route is known only after the last chunk (the router averages over the whole row), so
        the row runs with a guessed route (`guess`) from the deepest checkpoint of that route; when the router
        disagrees (a misprediction) it runs again with the router's route from that route's deepest checkpoint, and
        only the second run's checkpoints are planted. The layers below `split` do not depend on the route, so the
        router's decision is the same in both runs."""
        n, p = len(ids), self.state_end(state_len)
        if not self.eligible(state_len, slots) or self.runner.shape(p, n) is None:  # the chunk runner's limits
            return None
        spec = self.runner.spec
        keys = ids if images is None else images.keys  # what the index knows the state by
        best = self.index.lookup(keys, limit=p)
        guess = 0
        if spec is not None:
            guess = self.guess(best) if known_route is None else known_route
            if best is not None and best.route != guess:
                best = self.index.lookup(keys, limit=p, route=guess)
        best = self.bring(best, keys, p, guess if spec is not None else None)
        fork = self.fork_point(keys, p, best.pos if best is not None else 0)
        first = self._run_row(ids, state_len, p, n, slots, nopts, best, guess, images, fork)
        if first is None:
            return None
        probs, snaps, route, c0 = first
        computed, start, final = n - c0, best, first
        if spec is not None and route != guess:
            self.stats["mispredict"] += 1
            start = self.bring(self.index.lookup(keys, limit=p, route=route), keys, p, route)
            final = self._run_row(ids, state_len, p, n, slots, nopts, start, route, images, fork)
            if final is None:
                return None
            probs, snaps, _, c0 = final
            computed += n - c0
        if spec is not None:
            self.last_route = route
        path = "hit" if c0 == p else ("partial" if c0 > 0 else "cold")
        self.stats["rows"] += 1
        self.stats["hits" if path == "hit" else path] += 1
        self.stats["tokens_reused"] += c0
        self.stats["tokens_computed"] += computed
        if start is not None:
            self.index.touch(start)
        if snaps:
            self._plant(keys, p, snaps, route)
        self.stats["evicted"] += len(self.index.evict())
        return Answer([probs[j, : n_options(nopts[j])].tolist() for j in range(len(slots))], path, c0, computed,
                      route if spec is not None else None)

    def guess(self, best: Checkpoint | None) -> int:
        """The route a row runs with before its router has spoken: its deepest checkpoint's, else the last row's."""
        return best.route if best is not None else self.last_route

    def _run_row(self, ids, state_len: int, p: int, n: int, slots, nopts, best: Checkpoint | None, route: int,
                 images=None, fork: int = 0):
        """Restore `best` and run the row (images: its RowImages or None) with `route` -> (probabilities [slots,
        letters] on the host, snapshots to plant, the router's route (the given one without specialists), restored
        position); None when a chunk cannot be run (the row then takes the plain path)."""
        c0 = best.pos if best is not None else 0
        ends = self.plan(state_len, c0, fork if fork > c0 else 0)
        chunks = []  # (start, end, plant a checkpoint at end)
        s = c0
        for e in ends:
            pieces = self.runner.split(s, e)  # a padded chunk must not reach past the largest span
            if pieces is None:
                return None
            chunks += [(a, b, b == e) for a, b in zip([s] + pieces[:-1], pieces)]
            s = e
        if not self.runner.ensure([(a, b) for a, b, _ in chunks] + [(p, n)]):  # all captures before the restore
            return None
        self._restore(best)
        spec, fsum_buf = self.runner.spec, self.runner.fsum
        fsum = None
        if spec is not None:  # the router's feature sum over [0, position), carried by checkpoints
            # never changed in place (each chunk's sum is a new tensor): the checkpoint's needs no copy, and a
            # snapshot may keep the running sum itself
            fsum = best.payload[2] if best is not None else torch.zeros_like(fsum_buf)
        snaps = []
        for a, b, plant in chunks:
            self.runner.run(ids, a, b, route=route, images=images)
            if fsum is not None:
                fsum = fsum + fsum_buf
            if plant:
                snaps.append((b, self.runner.st.conv.clone(), self.runner.st.S.clone(), fsum))
        out = self.runner.run(ids, p, n, slots, nopts, route=route, images=images)
        if fsum is not None:
            route = spec.router.pick(fsum + fsum_buf, n)
        probs = self.runner.read(out, len(slots))  # waits for the GPU
        return probs, snaps, route, c0

    def _restore(self, c: Checkpoint | None) -> None:
        """Load checkpoint c into the runner's static buffers (None: the empty state). The attention K/V of [0, pos)
        are copied only when the buffers do not hold them already: `runner.kv_owner` is (group serial, length) of
        the K/V they hold, which rows never overwrite below their restore point and a graph capture clears."""
        st = self.runner.st
        if c is None:
            st.reset()
            self.runner.kv_owner = None
            return
        conv, S = c.payload[:2]
        K, V, serial = c.group.payload
        st.conv.copy_(conv)
        st.S.copy_(S)
        owner = self.runner.kv_owner
        if owner is None or owner[0] != serial or owner[1] < c.pos:
            st.K[:, : c.pos].copy_(K[:, : c.pos])
            st.V[:, : c.pos].copy_(V[:, : c.pos])
        self.runner.kv_owner = (serial, c.pos)

    def plant_planted(self, ids, n: int, snaps, K: torch.Tensor, V: torch.Tensor) -> None:
        """Store what a packed forward computed for a new state: snaps (pos, conv, S) at `plan`'s positions (the
        last is p), K, V [A, p, Hkv, D]; counted as a cold row of n tokens. ids: the row's tokens as the index
        knows them (an image row: its RowImages.keys). Evicts down to the budget. Trunk only:
        with specialists new states are planted by `row` (their checkpoints carry a route and a feature sum)."""
        p = snaps[-1][0]
        if K.shape[1] != p or V.shape[1] != p:
            raise ValueError(f"K/V of {K.shape[1]} positions for a state planted up to {p}")
        self.stats["rows"] += 1
        self.stats["cold"] += 1
        self.stats["tokens_computed"] += n
        self._plant(ids, p, [(pos, conv, S, None) for pos, conv, S in snaps], 0, (K, V))
        self.stats["evicted"] += len(self.index.evict())

    def _plant(self, ids, p: int, snaps, route: int, kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """A group over ids[:p] (index keys: an image row's RowImages.keys) with its checkpoints (pos, conv, S, feature sum | None), planted under `route`; its
        K/V from the runner's buffers (which then hold them) or given (`kv`)."""
        self._serial += 1
        if kv is None:
            st = self.runner.st
            K, V = st.K[:, :p].clone(), st.V[:, :p].clone()
            self.runner.kv_owner = (self._serial, p)
        else:
            K, V = kv
        group = self.index.add_group(ids[:p], (K, V, self._serial), _nbytes(K, V))
        for pos, conv, S, fsum in snaps:
            parts = (conv, S) if fsum is None else (conv, S, fsum)
            self.index.add_checkpoint(group, pos, parts, _nbytes(*parts), route=route)
            self.stats["ckpts_made"] += 1

    @torch.no_grad()
    def rows_batched(self, rows, found=None) -> list[Answer | None]:
        """Rows [(ids, state_len, slots, nopts)] that continue from saved states, their short chunks run together in
        packed forwards (statecache.batch) -> one Answer per row, or None for a row left to the caller (no checkpoint
        to continue from, a question longer than a batch piece, no batch runner, or it failed). Grown states
        plant their checkpoints as `row` does; the LRU is touched and enforced once at the end. found: per row None
        or (checkpoint, `index.version`) of the caller's `index.lookup(ids, limit=state_end(state_len))`, used instead
        of looking the row up again while the index's version is unchanged."""
        if self.batch is None or self.s.mb <= 0:
            return [None] * len(rows)
        return self.batch.rows_batched(self, rows, log, found)

    def clear(self) -> None:
        self.index.clear()

    def info(self) -> dict:
        """Counters: rows by path, tokens, checkpoints made; per tier its bytes, checkpoints and groups; restores by
        tier (restored_device, restored_host) and the host tier's copies (host: copies_up and up_ms are the copies
        back); evictions by tier and reason (tiers: demoted, dropped_device, dropped_host, replaced, promoted);
        tokens_lost (see fork_point)."""
        return {**self.stats, **self.runner.stats, "checkpoints": len(self.index), "groups": self.index.n_groups,
                "bytes": self.index.bytes, "mb": self.s.mb, "host_bytes": self.index.host_bytes,
                "host_mb": self.index.host_budget_bytes // MIB, **self.index.tier_counts(),
                "tiers": dict(self.index.counts), **({"host": self.host.info()} if self.host is not None else {}),
                **({"batch": dict(self.batch.stats, failed=self.batch.failures[:3])} if self.batch is not None else {})}
