"""Checkpoint bookkeeping for the state cache: which saved model states exist, and which to evict.

A *group* is what one row planted: its state tokens ``ids[0:p)`` and one payload all its checkpoints share
(the attention K/V of ``[0, p)``). A *checkpoint* is the model state after the group's tokens ``[0, pos)``,
with its own payload (recurrent states, conv tails, ...). The index answers "the deepest checkpoint whose
tokens equal this row's tokens", keeps an LRU order over checkpoints, counts bytes (every checkpoint, plus
each live group once) and evicts least recently used checkpoints down to a budget; a group goes with its
last checkpoint.

Lookup is token-exact: a fingerprint of the prefix (a Python hash of its last 32 tokens and of every 61st token,
with the position) finds candidates, and comparing the tokens decides, so a fingerprint collision can cost a
comparison but never give a state of other tokens. A row given as an int64 array (the engine's rows: statecache.rows
with `as_array`) is sampled with numpy and compared with the group's array (~10 us for a 4096-token hit here); groups
keep their tokens as a Python list too, so a row given as a list (in-process callers, image rows' key tokens) is
looked up without converting it (~40 us; converting it to int64 first took ~75 us more).

What this module does NOT know: tensors, devices, dtypes, the model, how a payload is made, restored or freed.
Payloads are opaque; the index only holds references to them and drops those references on eviction (the
memory goes once the caller drops its own). No torch import, no locking (it is driven from one thread).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False, slots=True, repr=False)
class Group:
    """The checkpoints planted by one row: its state tokens ``ids[0:p)`` and the payload (K/V of [0, p)) they share."""

    ids: np.ndarray  # int64, read-only
    tokens: list[int]  # the same, as Python ints (compared against rows that arrive as lists)
    payload: object
    nbytes: int  # bytes of payload, counted once while the group is live
    ckpts: list[Checkpoint] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Group(len={len(self.ids)}, nbytes={self.nbytes}, ckpts={[c.pos for c in self.ckpts]})"


@dataclass(eq=False, slots=True, repr=False)
class Checkpoint:
    """The model state after tokens ``[0, pos)`` of its group, made with specialist ``route`` (0 = trunk)."""

    group: Group
    pos: int
    payload: object
    nbytes: int
    route: int = 0
    used: int = field(default=0, init=False)  # recency tick (larger = more recent); the index sets it

    def __repr__(self) -> str:
        return f"Checkpoint(pos={self.pos}, route={self.route}, nbytes={self.nbytes})"


def _head(tokens: list[int], k: int) -> list[int]:
    """tokens[:k], without the copy when that is all of them."""
    return tokens if len(tokens) == k else tokens[:k]


def as_ids(ids: object) -> np.ndarray:
    """The tokens as a 1-D contiguous int64 array (no copy when they already are one; a list goes through
    np.fromiter, about twice as fast as np.asarray for 4096 tokens)."""
    if isinstance(ids, list):
        return np.fromiter(ids, dtype=np.int64, count=len(ids))
    a = np.asarray(ids)
    if a.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


class CheckpointIndex:
    """Checkpoints by (position, tokens), an LRU order over them, and a byte budget.

    ``bytes`` counts every live checkpoint and every live group once. A group is live from ``add_group`` until
    its last checkpoint is dropped (evicted or replaced), or until ``evict`` finds it without checkpoints.
    ``digest_size`` (bytes of the fingerprint kept, 1..8) exists for tests: a tiny one makes candidates collide, and
    0 keys by position alone (every checkpoint at a position is a candidate; the tokens decide).
    """

    def __init__(self, budget_bytes: int, align: int = 64, *, digest_size: int = 8) -> None:
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if not 0 <= digest_size <= 8:
            raise ValueError(f"digest_size must be in 0..8, got {digest_size}")
        self.budget_bytes = int(budget_bytes)
        self.align = int(align)
        self._digest_mask = (1 << (8 * int(digest_size))) - 1
        self._clock = 0
        self._bytes = 0
        self.version = 0  # bumped by every change that can change what `lookup` returns (see `lookup`)
        self._groups: dict[Group, None] = {}  # live groups, insertion-ordered
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()  # least recent first
        self._buckets: dict[tuple[int, int], list[Checkpoint]] = {}  # (pos, fingerprint of ids[:pos]) -> candidates
        self._pos_count: dict[int, int] = {}  # live checkpoints per position
        self._positions: list[int] = []  # sorted keys of _pos_count
        # observer(event, checkpoint), event plant | hit | evict: told of every checkpoint added, touched or dropped
        # (the worker advertises what it holds: statecache.routing.FingerprintLedger); None: nobody listens
        self.observer = None

    # ---- reading ---------------------------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def n_groups(self) -> int:
        return len(self._groups)

    def __len__(self) -> int:
        return len(self._lru)

    def lru_order(self) -> list[Checkpoint]:
        """The live checkpoints, least recently used first."""
        return list(self._lru)

    def lookup(self, ids: object, limit: int, route: int | None = None) -> Checkpoint | None:
        """The deepest checkpoint with ``pos <= limit`` whose group's tokens equal ``ids[:pos]`` (and of ``route``
        when given); among several at that depth (other routes), the most recently used. Does not touch the LRU.
        The answer holds while ``version`` is unchanged (a caller may keep it that long instead of looking again)."""
        if isinstance(ids, list):  # sampled and compared as Python lists (no conversion)
            row, same = ids, lambda c, k, head: _head(c.group.tokens, k) == head
        else:  # an int64 array: sampled with numpy, compared with the group's array (a memcmp)
            row, same = as_ids(ids), lambda c, k, head: np.array_equal(c.group.ids[:k], head)
        top = min(int(limit), len(row))
        end = bisect.bisect_right(self._positions, top)
        for k in reversed(self._positions[:end]):
            cands = self._buckets.get((k, self._fingerprint(row, k)))
            if not cands:
                continue
            head = row[:k]
            best: Checkpoint | None = None
            for c in cands:
                if route is not None and c.route != route:
                    continue
                if (best is None or c.used > best.used) and same(c, k, head):
                    best = c
            if best is not None:
                return best
        return None

    # ---- writing ---------------------------------------------------------------------------------------------------

    def add_group(self, ids: object, payload: object, nbytes: int) -> Group:
        """A new live group over a copy of ``ids``; its ``nbytes`` count from now on."""
        a = as_ids(ids).copy()
        a.setflags(write=False)
        g = Group(a, a.tolist(), payload, int(nbytes))
        self._groups[g] = None
        self._bytes += g.nbytes
        return g

    def add_checkpoint(self, group: Group, pos: int, payload: object, nbytes: int, route: int = 0) -> Checkpoint:
        """A checkpoint at ``pos`` of a live group, most recently used. One already present with the same
        (pos, tokens, route) is replaced: dropped, its bytes (and its group's, if that was its last) freed."""
        if group not in self._groups:
            raise ValueError("group is not live (evicted, replaced away or cleared)")
        pos = int(pos)
        if pos <= 0 or pos > len(group.ids) or pos % self.align:
            raise ValueError(f"pos {pos} must be a multiple of {self.align} in (0, {len(group.ids)}]")
        head = group.tokens[:pos]
        bucket = self._buckets.setdefault((pos, self._fingerprint(group.tokens, pos)), [])
        old = next((c for c in bucket if c.route == route and _head(c.group.tokens, pos) == head), None)
        c = Checkpoint(group, pos, payload, int(nbytes), int(route))
        self.version += 1
        bucket.append(c)
        group.ckpts.append(c)
        self._lru[c] = None
        self._stamp(c)
        self._bytes += c.nbytes
        n = self._pos_count.get(pos, 0)
        if n == 0:
            bisect.insort(self._positions, pos)
        self._pos_count[pos] = n + 1
        if self.observer is not None:
            self.observer("plant", c)
        if old is not None:  # after adding, so a group replacing its own checkpoint is never emptied
            self._drop(old)
        return c

    def touch(self, ckpt: Checkpoint) -> None:
        """Mark a checkpoint most recently used; a checkpoint no longer live is ignored."""
        if ckpt in self._lru:
            self.version += 1  # recency decides between checkpoints of other routes at one depth
            self._lru.move_to_end(ckpt)
            self._stamp(ckpt)
            if self.observer is not None:
                self.observer("hit", ckpt)

    def evict(self) -> list[Checkpoint]:
        """Drop groups without checkpoints, then least recently used checkpoints until ``bytes <= budget_bytes``
        (a group goes with its last one). Returns the evicted checkpoints, least recent first."""
        for g in [g for g in self._groups if not g.ckpts]:
            self._drop_group(g)
        out: list[Checkpoint] = []
        while self._lru and self._bytes > self.budget_bytes:
            c = next(iter(self._lru))
            self._drop(c)
            out.append(c)
        return out

    def clear(self) -> None:
        """Forget everything (groups and checkpoints become not live)."""
        self.version += 1
        if self.observer is not None:
            for c in self._lru:
                self.observer("evict", c)
        self._groups.clear()
        self._lru.clear()
        self._buckets.clear()
        self._pos_count.clear()
        self._positions.clear()
        self._bytes = 0

    # ---- internals -------------------------------------------------------------------------------------------------

    def _fingerprint(self, tokens: list[int] | np.ndarray, k: int) -> int:
        """A hash of tokens[:k] from a sample of them: the last 32 and every 61st (0 with digest_size 0); the same
        for a list and an int64 array of the same tokens (both sampled as tuples of Python ints)."""
        if not self._digest_mask:
            return 0
        last, every = tokens[max(0, k - 32) : k], tokens[0:k:61]
        if isinstance(tokens, np.ndarray):
            last, every = last.tolist(), every.tolist()
        return hash((k, tuple(last), tuple(every))) & self._digest_mask

    def _stamp(self, c: Checkpoint) -> None:
        self._clock += 1
        c.used = self._clock

    def _drop(self, c: Checkpoint) -> None:
        self.version += 1
        if self.observer is not None:
            self.observer("evict", c)
        del self._lru[c]
        key = (c.pos, self._fingerprint(c.group.tokens, c.pos))
        bucket = self._buckets[key]
        bucket.remove(c)  # identity (eq=False)
        if not bucket:
            del self._buckets[key]
        n = self._pos_count[c.pos] - 1
        if n:
            self._pos_count[c.pos] = n
        else:
            del self._pos_count[c.pos]
            del self._positions[bisect.bisect_left(self._positions, c.pos)]
        self._bytes -= c.nbytes
        g = c.group
        g.ckpts.remove(c)
        if not g.ckpts:
            self._drop_group(g)

    def _drop_group(self, g: Group) -> None:
        del self._groups[g]
        self._bytes -= g.nbytes


def plan_chunks(start: int, state_len: int, *, stride: int, tail: int, align: int, max_chunk: int) -> list[int]:
    """The chunk ends of a row's state computed from a restored position ``start`` (0 = nothing restored), which
    are also the checkpoint positions to plant.

    With ``p = state_len`` rounded down to ``align``: every multiple of ``stride`` below ``p``, ``p - tail`` and
    ``p``, each rounded down to ``align``, only those ``> start``, sorted; then a chunk longer than ``max_chunk``
    is split at ``a + k * max_chunk`` from its own start ``a`` (those ends are planted too). ``stride`` 0 or
    ``tail`` 0 disable those positions. ``[]`` when ``p <= start``.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if max_chunk < align or max_chunk % align:
        raise ValueError(f"max_chunk {max_chunk} must be a positive multiple of align {align}")
    if start < 0 or start % align:
        raise ValueError(f"start {start} must be a non-negative multiple of align {align}")
    if stride < 0 or tail < 0:
        raise ValueError("stride and tail must be >= 0")

    def down(v: int) -> int:
        return v - v % align

    p = down(state_len)
    if p <= start:
        return []
    ends = {p}
    if stride:
        ends.update(down(k) for k in range(stride, p, stride))
    if tail:
        ends.add(down(p - tail))
    out: list[int] = []
    s = start
    for e in sorted(v for v in ends if v > start):
        while e - s > max_chunk:
            s += max_chunk
            out.append(s)
        out.append(e)
        s = e
    return out
