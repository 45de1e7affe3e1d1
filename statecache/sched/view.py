"""What the scheduler asks of the cache: the deepest usable checkpoint for a row's tokens, and what it planted.

`CacheView` is the interface (a Protocol): `lookup(ids, limit)` gives the deepest checkpoint (anything with a
`pos`) whose tokens equal `ids[:pos]` with `pos <= limit`, or None; `touch` marks one used; `planted` records the
checkpoints a state's pieces passed; `state_bytes`, `budget_bytes`, `used_bytes` are what the `cold_ok` policy reads
(statecache.cache.policy.ColdContext). `OverIndex` holds the members that read a
`statecache.cache.index.CheckpointIndex` as it is (token-exact lookup, LRU over checkpoints, bytes counted, evicted
to a byte budget); `IndexView` builds the interface on it with payloads of None and sizes from a byte model handed
in: the scheduler's tests and `bench/step_sim.py` use it; the engine's view (statecache.step.CacheView) builds on it
too, over the index whose payloads are its tensors.

Knows nothing of tensors, the model or the worker; no torch import.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

from statecache.cache.index import CheckpointIndex
from statecache.sched.layout import Layout


class Found(Protocol):
    pos: int


class CacheView(Protocol):
    budget_bytes: int

    @property
    def used_bytes(self) -> int: ...

    @property
    def version(self) -> int:
        """Changes whenever a lookup's answer can change (a lookup may be kept while it is unchanged)."""

    def lookup(self, ids: Sequence[int], limit: int, route: int | None = None) -> Found | None:
        """route: only that route's checkpoints (specialists); the scheduler passes it only for rows that name one."""

    def touch(self, found: Found) -> None: ...

    def retire(self, found: Found) -> None:
        """A row restored `found` and has planted its own longer state along the same tokens
        (statecache.cache.index.CheckpointIndex.retire decides what that changes)."""

    def planted(self, state: Hashable, ids: Sequence[int], p: int, positions: Sequence[int], last: bool,
                route: int | None = None, forks: Sequence[int] = ()) -> None:
        """Checkpoints at `positions` of the state `ids[:p]` that `state` (a row id) is computing now exist; `last`:
        its final ones (no more will come for this state); `route`: the route it runs with (specialists); `forks`:
        the row's fork points (those of `positions` among them are planted as such)."""

    def state_bytes(self, state_len: int) -> int: ...


class OverIndex:
    """The members of a `CacheView` that read a `CheckpointIndex` (`self.index`, set by the subclass) as it is."""

    index: CheckpointIndex

    @property
    def budget_bytes(self) -> int:
        return self.index.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self.index.bytes

    @property
    def version(self) -> int:
        return self.index.version

    def lookup(self, ids, limit: int, route: int | None = None):
        return self.index.lookup(ids, limit, route)

    def touch(self, found) -> None:
        self.index.touch(found)

    def retire(self, found) -> None:
        self.index.retire(found)


class IndexView(OverIndex):
    """A `CacheView` over a `CheckpointIndex` of payload-less checkpoints: `ckpt_bytes` per checkpoint (GDN states and
    conv tails) and `kv_bytes_per_token` per position of a group's K/V (statecache.cache.budget gives both for a shape).
    One group per computing state, opened at its first planted checkpoint and sized for K/V of [0, p)."""

    def __init__(self, budget_bytes: int, ckpt_bytes: int, kv_bytes_per_token: int, layout: Layout):
        self.index = CheckpointIndex(budget_bytes, align=layout.align)
        self.ckpt_bytes, self.kv_bytes_per_token = int(ckpt_bytes), int(kv_bytes_per_token)
        self.layout = layout
        self._open: dict = {}  # state -> its group while it plants
        self.evicted = 0

    def planted(self, state, ids, p: int, positions, last: bool, route: int | None = None, forks=()) -> None:
        group = self._open.get(state)
        if group is None or group not in self.index._groups:  # new, or evicted whole while it was still planting
            group = self.index.add_group(list(ids[:p]), None, p * self.kv_bytes_per_token)
            self._open[state] = group
        for pos in positions:
            self.index.add_checkpoint(group, pos, None, self.ckpt_bytes, route=route or 0, fork=pos in forks)
        if last:
            self._open.pop(state, None)
        self.evicted += len(self.index.evict())

    def state_bytes(self, state_len: int) -> int:
        """Checkpoints and K/V a new state of `state_len` tokens would take (what `cold_ok` weighs)."""
        n = len(self.layout.positions(0, state_len))
        return n * self.ckpt_bytes + self.layout.end(state_len) * self.kv_bytes_per_token
