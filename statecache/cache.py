"""The cross-request state cache: a row continues from the deepest saved model state its tokens share.

A row is [state | question]; p = state_len rounded down to `align`. The cache looks up the deepest checkpoint
whose tokens equal the row's up to it (statecache.index), restores it into the runner's static buffers, runs
the rest of the state as chunks ending at the planned checkpoint positions (every multiple of `stride`,
p - `tail`, p), snapshotting after each, then the question [p, n) as the last chunk, which gives the answer.
The checkpoints one row plants form a group sharing that row's attention K/V of [0, p), stored once.
An LRU bounded in bytes (states, conv tails and each group's K/V once) is enforced after every row.

Image rows (statecache.vision.RowImages) are known to the index by their key tokens: each image-pad token replaced
by a key derived from its image's sha256, so the same screenshot with a new question is a hit and a different one
at the same place never matches. A checkpoint after an image needs no stored rotary offset: the offset at a
position is a function of the tokens before it (the images' grids), which the lookup proved equal, so the row's
own positions (RowImages) continue it; chunks holding image tokens run eagerly with the image embeddings.

`row` returns None when the row must take the plain path instead: it is not eligible, a chunk shape cannot be
captured, or it has nothing to reuse and `cold_ok()` says no (someone is waiting). This module knows nothing of
Redis, text, the memo or batching: statecache.engine decides which rows come here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .index import Checkpoint, CheckpointIndex, plan_chunks
from .runner import ChunkRunner


@dataclass
class CacheSettings:
    mb: int = 1024  # LRU bound on everything held (MiB); 0 turns the cached path off
    stride: int = 2048  # a checkpoint at every multiple of this below the state end (0: none)
    tail: int = 16  # and one at state end - tail (0: none)
    align: int = 64  # checkpoint positions and chunk starts: multiples of this (fla's delta-rule chunk)
    min_prefix: int = 256  # shorter states take the plain path
    max_slots: int = 4  # answer slots a cached row may have


@dataclass
class Answer:
    probs: list[list[float]]
    path: str  # hit | partial | cold
    reused: int  # tokens restored from a checkpoint
    computed: int  # tokens run


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class StateCache:
    def __init__(self, runner: ChunkRunner, settings: CacheSettings | None = None):
        self.runner = runner
        self.s = settings or CacheSettings()
        if self.s.max_slots > runner.max_slots:
            raise ValueError(f"max_slots {self.s.max_slots} > the runner's {runner.max_slots}")
        self.index = CheckpointIndex(self.s.mb * 2**20, align=self.s.align)
        self.cold_ok: Callable[[], bool] | None = None  # may a row with nothing to reuse take this path now?
        self._serial = 0  # groups' serial numbers: the static K/V buffers' owner tag (see _restore)
        self.stats = {"rows": 0, "hits": 0, "partial": 0, "cold": 0, "declined": 0, "tokens_reused": 0,
                      "tokens_computed": 0, "ckpts_made": 0, "evicted": 0}

    # ---- what may come here ---------------------------------------------------------------------------------------

    def _down(self, x: int) -> int:
        return x - x % self.s.align

    def eligible(self, ids, state_len: int, slots) -> bool:
        """Section 3's eligibility: a long enough state, 1..max_slots slots at or after p, a question that fits
        (rows with images too: see the module docstring)."""
        p, n = self._down(state_len), len(ids)
        if self.s.mb <= 0 or p < self.s.min_prefix or not 0 < len(slots) <= self.s.max_slots:
            return False
        return min(slots) >= p and self.runner.shape(p, n) is not None

    # ---- a row ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def row(self, ids, state_len: int, slots: list[int], nopts: list[int], plant_anyway: bool = False,
            images=None) -> Answer | None:
        """One eligible row (ids: a list of ints, as rows arrive, or an int64 array) -> its Answer, or None for the
        plain path. plant_anyway: skip `cold_ok` (other waiting rows share this state, so planting it pays).
        images: the row's statecache.vision.RowImages, or None."""
        if not self.eligible(ids, state_len, slots):
            return None
        n, p = len(ids), self._down(state_len)
        keys = ids if images is None else images.keys  # what the index knows the state by
        best = self.index.lookup(keys, limit=p)
        c0 = best.pos if best is not None else 0
        if best is None and not plant_anyway and self.cold_ok is not None and not self.cold_ok():
            self.stats["declined"] += 1
            return None
        ends = plan_chunks(c0, state_len, stride=self.s.stride, tail=self.s.tail, align=self.s.align,
                           max_chunk=self.runner.max_chunk)
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
        snaps = []
        for a, b, plant in chunks:
            self.runner.run(ids, a, b, images=images)
            if plant:
                snaps.append((b, self.runner.st.conv.clone(), self.runner.st.S.clone()))
        out = self.runner.run(ids, p, n, slots, nopts, images)
        probs = self.runner.read(out, len(slots))  # waits for the GPU
        path = "hit" if c0 == p else ("partial" if c0 > 0 else "cold")
        self.stats["rows"] += 1
        self.stats["hits" if path == "hit" else path] += 1
        self.stats["tokens_reused"] += c0
        self.stats["tokens_computed"] += n - c0
        if best is not None:
            self.index.touch(best)
        if snaps:
            self._plant(keys, p, snaps)
        self.stats["evicted"] += len(self.index.evict())
        return Answer([probs[j, : nopts[j]].tolist() for j in range(len(slots))], path, c0, n - c0)

    def _restore(self, c: Checkpoint | None) -> None:
        """Load checkpoint c into the runner's static buffers (None: the empty state). The attention K/V of [0, pos)
        are copied only when the buffers do not hold them already: `runner.kv_owner` is (group serial, length) of
        the K/V they hold, which rows never overwrite below their restore point and a graph capture clears."""
        st = self.runner.st
        if c is None:
            st.reset()
            self.runner.kv_owner = None
            return
        conv, S = c.payload
        K, V, serial = c.group.payload
        st.conv.copy_(conv)
        st.S.copy_(S)
        owner = self.runner.kv_owner
        if owner is None or owner[0] != serial or owner[1] < c.pos:
            st.K[:, : c.pos].copy_(K[:, : c.pos])
            st.V[:, : c.pos].copy_(V[:, : c.pos])
        self.runner.kv_owner = (serial, c.pos)

    def _plant(self, ids, p: int, snaps) -> None:
        st = self.runner.st
        K, V = st.K[:, :p].clone(), st.V[:, :p].clone()
        self._serial += 1
        self.runner.kv_owner = (self._serial, p)
        group = self.index.add_group(ids[:p], (K, V, self._serial), _nbytes(K, V))
        for pos, conv, S in snaps:
            self.index.add_checkpoint(group, pos, (conv, S), _nbytes(conv, S))
            self.stats["ckpts_made"] += 1

    def clear(self) -> None:
        self.index.clear()

    def info(self) -> dict:
        return {**self.stats, **self.runner.stats, "checkpoints": len(self.index), "groups": self.index.n_groups,
                "bytes": self.index.bytes, "mb": self.s.mb}
