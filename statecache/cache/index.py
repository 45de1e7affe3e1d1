"""Checkpoint bookkeeping for the state cache: which saved model states exist, and which to evict.

A *group* is what one row planted: its state tokens ``ids[0:p)`` and one payload all its checkpoints share
(the attention K/V of ``[0, p)``). A *checkpoint* is the model state after the group's tokens ``[0, pos)``,
with its own payload (recurrent states, conv tails, ...). The index answers "the deepest checkpoint whose
tokens equal this row's tokens", keeps an LRU order over checkpoints, counts bytes (every checkpoint, plus
each live group once) and evicts least recently used checkpoints down to a budget; a group goes with its
last checkpoint. Two corrections to plain recency, both measured on the agent trace (bench/step_sim.py, bench/README
"What the cache keeps"): a state's end that a row grew past is `retire`d to the eviction end, and a checkpoint planted
at a fork point gets one more lap of the LRU (`add_checkpoint(fork=True)`).

Two tiers: the device (``budget_bytes``) and the host (``host_budget_bytes``; 0: none). A checkpoint the device
budget cannot keep moves to the host (``demoted``) when it fits there, else it is dropped; the host drops by its own
LRU. A group's shared payload is on the device while any of its checkpoints is, and follows the last one to the host.
``promote`` brings a host checkpoint (and its group) back to the device, evicting others to the host. Lookup sees
both tiers (token-exact either way). Moving a payload is the ``tiers`` object's business (``down(payload)`` -> the
host copy, None when it has no room, False when the copy cannot be made at all (the device's memory ran out);
``up(host payload)`` -> the device copy, ``free(host payload)``); without one a payload moves as it is (the
bookkeeping alone, for tests and simulations). ``pin``/``unpin``: a checkpoint a row already taken will read; eviction passes over pinned checkpoints while unpinned ones remain (a preference: the
budgets are never exceeded). ``shared_depth``: the deepest aligned position to which some live group's tokens equal
a row's, checkpoint or not (aligned prefix hashes find candidates; tokens decide).

Lookup is token-exact: a fingerprint of the prefix (a Python hash of its last 32 tokens and of every 61st token,
with the position) finds candidates, and comparing the tokens decides, so a fingerprint collision can cost a
comparison but never give a state of other tokens. A row given as an int64 array (the engine's rows: statecache.rows.check
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


SCAN_BEFORE_BOUND = 16  # lookup: positions tried from the deepest down before bounding them by the shared depth


@dataclass(eq=False, slots=True, repr=False)
class Group:
    """The checkpoints planted by one row: its state tokens ``ids[0:p)`` and the payload (K/V of [0, p)) they share."""

    ids: np.ndarray  # int64, read-only
    tokens: list[int]  # the same, as Python ints (compared against rows that arrive as lists)
    payload: object
    nbytes: int  # bytes of payload, counted once while the group is live
    ckpts: list[Checkpoint] = field(default_factory=list)
    tier: int = 0  # DEVICE or HOST: where its payload is
    hashes: tuple = ()  # prefix hashes at every aligned position (shared_depth)

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
    tier: int = field(default=0, init=False)  # DEVICE or HOST: where its payload is
    spare: bool = field(default=False, init=False)  # a fork point's: eviction passes over it once (`add_checkpoint`)

    def __repr__(self) -> str:
        return f"Checkpoint(pos={self.pos}, route={self.route}, nbytes={self.nbytes}, tier={TIERS[self.tier]})"


DEVICE, HOST = 0, 1
TIERS = ("device", "host")


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


def fork_at(x: int, p: int, c0: int) -> int:
    """The fork point of a row whose state ends at p, restoring c0, that shares [0, x) with a cached group
    (`CheckpointIndex.shared_depth`): x when c0 < x < p, else 0 (p is planted anyway). [c0, x) is recomputed though it
    was cached; a checkpoint planted at x lets the next row sharing it (a new page after the same goal and steps)
    reuse it (`CheckpointIndex.fork_point` asks it)."""
    return x if c0 < x < p else 0


class CheckpointIndex:
    """Checkpoints by (position, tokens), an LRU order over them, and a byte budget.

    ``bytes`` counts every live checkpoint and every live group once. A group is live from ``add_group`` until
    its last checkpoint is dropped (evicted or replaced), or until ``evict`` finds it without checkpoints.
    ``digest_size`` (bytes of the fingerprint kept, 1..8) exists for tests: a tiny one makes candidates collide, and
    0 keys by position alone (every checkpoint at a position is a candidate; the tokens decide).
    """

    def __init__(self, budget_bytes: int, align: int = 64, *, digest_size: int = 8, host_budget_bytes: int = 0) -> None:
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if not 0 <= digest_size <= 8:
            raise ValueError(f"digest_size must be in 0..8, got {digest_size}")
        self.budget_bytes = int(budget_bytes)
        self.host_budget_bytes = int(host_budget_bytes)
        self.tiers = None  # moves payloads between the tiers (see the module docstring); None: as they are
        # device bytes held outside the index that its budget covers too (the step loop's rows in the schedule:
        # statecache.step.Steps.held_bytes, set before each eviction): `evict` makes room for them as well
        self.held_bytes = 0
        self.align = int(align)
        self._digest_mask = (1 << (8 * int(digest_size))) - 1
        self._clock = 0
        self._low = 0  # below every stamp: `retire` counts down from here
        self._bytes = 0
        self._host_bytes = 0
        self._host_lru: OrderedDict[Checkpoint, None] = OrderedDict()  # host tier, least recent first
        self._pins: dict[Checkpoint, int] = {}
        self._prefix: dict[int, list[Group]] = {}  # prefix hash (shared_depth) -> live groups having it
        # evictions by tier and reason: demoted (device -> host), dropped_device (no host room, or no host tier),
        # dropped_host (host LRU), replaced (a new checkpoint of the same tokens); promoted (host -> device);
        # retired (a grown-past state's end sent to the eviction end), spared (a fork point's extra lap)
        self.counts = {"demoted": 0, "dropped_device": 0, "dropped_host": 0, "replaced": 0, "promoted": 0,
                       "pinned_passed": 0, "retired": 0, "spared": 0, "unmovable": 0}
        self.version = 0  # bumped by every change that can change what `lookup` returns (see `lookup`)
        self._groups: dict[Group, None] = {}  # live groups, insertion-ordered
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()  # least recent first
        self._buckets: dict[tuple[int, int], list[Checkpoint]] = {}  # (pos, fingerprint of ids[:pos]) -> candidates
        self._pos_count: dict[int, int] = {}  # live checkpoints per position
        self._positions: list[int] = []  # sorted keys of _pos_count
        # observer(event, checkpoint), event plant | hit | evict: told of every checkpoint added, touched or dropped
        # (the worker advertises what it holds: statecache.cache.routing.FingerprintLedger); None: nobody listens
        self.observer = None

    # ---- reading ---------------------------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        """Bytes held on the device tier."""
        return self._bytes

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    def host_order(self) -> list[Checkpoint]:
        """The host tier's checkpoints, least recently used first."""
        return list(self._host_lru)

    def tier_counts(self) -> dict:
        """Checkpoints and groups per tier."""
        groups = [0, 0]
        for g in self._groups:
            groups[g.tier] += 1
        return {"device_checkpoints": len(self._lru), "host_checkpoints": len(self._host_lru),
                "device_groups": groups[DEVICE], "host_groups": groups[HOST]}

    @property
    def n_groups(self) -> int:
        return len(self._groups)

    def __len__(self) -> int:
        return len(self._lru) + len(self._host_lru)

    def lru_order(self) -> list[Checkpoint]:
        """The device tier's checkpoints, least recently used first."""
        return list(self._lru)

    def lookup(self, ids: object, limit: int, route: int | None = None, host: bool = True) -> Checkpoint | None:
        """The deepest checkpoint with ``pos <= limit`` whose group's tokens equal ``ids[:pos]`` (and of ``route``
        when given), on either tier (``host`` False: the device tier only); among several at that depth (other
        routes), the most recently used. Does not touch the LRU.
        The answer holds while ``version`` is unchanged (a caller may keep it that long instead of looking again)."""
        if isinstance(ids, list):  # sampled and compared as Python lists (no conversion)
            row, same = ids, lambda c, k, head: _head(c.group.tokens, k) == head
        else:  # an int64 array: sampled with numpy, compared with the group's array (a memcmp)
            row, same = as_ids(ids), lambda c, k, head: np.array_equal(c.group.ids[:k], head)
        top = min(int(limit), len(row))
        j, tried = bisect.bisect_right(self._positions, top) - 1, 0
        while j >= 0:
            k = self._positions[j]
            j -= 1
            tried += 1
            if tried == SCAN_BEFORE_BOUND:  # other states' positions in the way: skip those this row cannot match
                bound = self.shared_depth(ids, top) + self.align - 1  # its tokens equal a live group's to at most this
                if k > bound:
                    j = min(j, bisect.bisect_right(self._positions, bound) - 1)
                    continue
            cands = self._buckets.get((k, self._fingerprint(row, k)))
            if not cands:
                continue
            head = row[:k]
            best: Checkpoint | None = None
            for c in cands:
                if (route is not None and c.route != route) or (not host and c.tier == HOST):
                    continue
                if (best is None or c.used > best.used) and same(c, k, head):
                    best = c
            if best is not None:
                return best
        return None

    # ---- writing ---------------------------------------------------------------------------------------------------

    def shared_depth(self, ids: object, limit: int) -> int:
        """The deepest multiple of ``align`` (<= ``limit``) to which some live group's tokens equal ``ids``, whether
        or not a checkpoint sits there (0: none): the state a row shares with what is cached."""
        row = as_ids(ids)
        hs = self._hashes(row, min(int(limit), len(row)))
        for j in range(len(hs) - 1, -1, -1):
            k = (j + 1) * self.align
            for g in self._prefix.get(hs[j], ()):
                if np.array_equal(g.ids[:k], row[:k]):
                    return k
        return 0

    def fork_point(self, ids: object, p: int, c0: int) -> tuple[int, int]:
        """(x, fork) for a row whose state ends at p, restoring c0: x its `shared_depth` (0 when nothing is cached),
        fork its fork point by `fork_at` (0: none). What the engine (StateCache.fork_point) and bench/step_sim.py ask."""
        x = self.shared_depth(ids, p) if len(self) else 0
        return x, fork_at(x, p, c0)

    def _hashes(self, a: np.ndarray, upto: int) -> list[int]:
        """Chained hashes of a[:k] for k = align, 2 align, ... <= upto."""
        raw, step, h, out = a[:upto].tobytes(), 8 * self.align, 0, []
        for j in range(upto // self.align):
            h = hash((h, raw[j * step : (j + 1) * step]))
            out.append(h)
        return out

    # ---- writing ---------------------------------------------------------------------------------------------------

    def add_group(self, ids: object, payload: object, nbytes: int) -> Group:
        """A new live group (device tier) over a copy of ``ids``; its ``nbytes`` count from now on."""
        a = as_ids(ids).copy()
        a.setflags(write=False)
        g = Group(a, a.tolist(), payload, int(nbytes))
        g.hashes = tuple(self._hashes(a, len(a)))
        for h in g.hashes:
            self._prefix.setdefault(h, []).append(g)
        self._groups[g] = None
        self._bytes += g.nbytes
        return g

    def add_checkpoint(self, group: Group, pos: int, payload: object, nbytes: int, route: int = 0,
                       fork: bool = False) -> Checkpoint:
        """A checkpoint at ``pos`` of a live group, on the device tier, most recently used. One already present with
        the same (pos, tokens, route) is replaced: dropped, its bytes (and its group's, if that was its last) freed.
        ``fork``: planted at a fork point (`fork_at`: where rows' tokens leave a cached state, the prefix the next new
        page after the same history reads, often seconds later): eviction passes over it once, moving it to the most
        recent end of its tier instead (one more lap of the LRU; counted as ``spared``)."""
        if group not in self._groups:
            raise ValueError("group is not live (evicted, replaced away or cleared)")
        if group.tier != DEVICE:
            raise ValueError("group is on the host tier: promote one of its checkpoints first")
        pos = int(pos)
        if pos <= 0 or pos > len(group.ids):
            raise ValueError(f"pos {pos} must be in (0, {len(group.ids)}]")
        head = group.tokens[:pos]
        bucket = self._buckets.setdefault((pos, self._fingerprint(group.tokens, pos)), [])
        old = next((c for c in bucket if c.route == route and _head(c.group.tokens, pos) == head), None)
        c = Checkpoint(group, pos, payload, int(nbytes), int(route))
        c.spare = bool(fork)
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
            self.counts["replaced"] += 1
            self._drop(old)
        return c

    def touch(self, ckpt: Checkpoint) -> None:
        """Mark a checkpoint most recently used (in its tier); a checkpoint no longer live is ignored."""
        lru = self._lru if ckpt.tier == DEVICE else self._host_lru
        if ckpt in lru:
            self.version += 1  # recency decides between checkpoints of other routes at one depth
            lru.move_to_end(ckpt)
            self._stamp(ckpt)
            if self.observer is not None:
                self.observer("hit", ckpt)

    def retire(self, ckpt: Checkpoint) -> None:
        """A row restored ``ckpt`` and planted a longer state along the same tokens (a state grown by an action): if
        ``ckpt`` is its group's end, the state the row grew past, it becomes the least recently used of its tier, the
        first to go when room is needed (it stays usable until then; a later row that reads it makes it recent again).
        A checkpoint inside its group (a fork point, a stride position: other states' prefixes) or no longer live is
        left as it is."""
        lru = self._lru if ckpt.tier == DEVICE else self._host_lru
        if ckpt in lru and ckpt.pos == len(ckpt.group.ids):
            lru.move_to_end(ckpt, last=False)
            self._low -= 1  # and the least recent where recency decides between routes at one depth (`lookup`)
            ckpt.used = self._low
            self.version += 1
            ckpt.spare = False
            self.counts["retired"] += 1

    def pin(self, ckpt: Checkpoint) -> None:
        """A row already taken will read ``ckpt``: eviction passes over it while it can (until ``unpin``)."""
        self._pins[ckpt] = self._pins.get(ckpt, 0) + 1

    def unpin(self, ckpt: Checkpoint) -> None:
        n = self._pins.get(ckpt, 0) - 1
        if n > 0:
            self._pins[ckpt] = n
        else:
            self._pins.pop(ckpt, None)

    def promote(self, ckpt: Checkpoint) -> bool:
        """Bring a host checkpoint (and its group, if on the host) to the device tier, most recently used, then evict
        the device down to its budget (others to the host). False when it is not live or cannot fit the device budget
        at all (it stays where it was); True when it is on the device (already or now)."""
        if ckpt.tier == DEVICE:
            return ckpt in self._lru
        if ckpt not in self._host_lru:
            return False
        g = ckpt.group
        need = ckpt.nbytes + (g.nbytes if g.tier == HOST else 0)
        if need > self.budget_bytes:
            return False
        self.version += 1
        if g.tier == HOST:
            g.payload = self._up(g.payload)
            g.tier = DEVICE
            self._host_bytes -= g.nbytes
            self._bytes += g.nbytes
        ckpt.payload = self._up(ckpt.payload)
        ckpt.tier = DEVICE
        del self._host_lru[ckpt]
        self._lru[ckpt] = None
        self._stamp(ckpt)
        self._host_bytes -= ckpt.nbytes
        self._bytes += ckpt.nbytes
        self.counts["promoted"] += 1
        self.pin(ckpt)
        try:
            self.evict()
        finally:
            self.unpin(ckpt)
        return ckpt.tier == DEVICE and ckpt in self._lru

    def evict(self) -> list[Checkpoint]:
        """Drop groups without checkpoints; then move least recently used device checkpoints to the host (drop them
        when the host tier cannot take them) until ``bytes + held_bytes <= budget_bytes`` (pinned ones only while
        ``bytes`` alone is over), and drop least recently used host checkpoints until ``host_bytes <=
        host_budget_bytes`` (a group goes with its last checkpoint). Pinned checkpoints go last. Returns the dropped
        checkpoints (either tier), least recent first."""
        for g in [g for g in self._groups if not g.ckpts]:
            self._drop_group(g)
        out: list[Checkpoint] = []
        while self._lru and self._bytes + self.held_bytes > self.budget_bytes:
            c = self._victim(self._lru)
            if c in self._pins and self._bytes <= self.budget_bytes:
                break  # over only by what the rows hold beside the cache: what they will read stays
            if not self._demote(c, out):
                self.counts["dropped_device"] += 1
                self._drop(c, out)
                out.append(c)
        while self._host_lru and self._host_bytes > self.host_budget_bytes:
            self._drop_host_victim(out)
        return out

    def clear(self) -> None:
        """Forget everything (groups and checkpoints become not live; host payloads freed)."""
        self.version += 1
        if self.observer is not None:
            for c in [*self._lru, *self._host_lru]:
                self.observer("evict", c)
        for c in self._host_lru:
            self._free(c.payload)
        for g in self._groups:
            if g.tier == HOST:
                self._free(g.payload)
        self._groups.clear()
        self._lru.clear()
        self._host_lru.clear()
        self._pins.clear()
        self._prefix.clear()
        self._buckets.clear()
        self._pos_count.clear()
        self._positions.clear()
        self._bytes = 0
        self._host_bytes = 0

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

    def _victim(self, lru: OrderedDict) -> Checkpoint:
        """The least recently used checkpoint of a tier that is not pinned, else the least recently used; one planted
        at a fork point (`spare`) is passed over once: it moves to the most recent end and the next is asked."""
        while True:
            c = next((c for c in lru if c not in self._pins), None) if self._pins else next(iter(lru))
            if c is None:
                self.counts["pinned_passed"] += 1
                return next(iter(lru))
            if not c.spare:
                return c
            c.spare = False
            lru.move_to_end(c)
            self._stamp(c)
            self.counts["spared"] += 1

    def _down(self, payload: object) -> tuple[bool, object]:
        """(moved, the host payload): without a tiers object any payload moves as it is (None included)."""
        if self.tiers is None:
            return True, payload
        moved = self.tiers.down(payload)
        return moved is not None and moved is not False, moved

    def _up(self, payload: object) -> object:
        return payload if self.tiers is None else self.tiers.up(payload)

    def _free(self, payload: object) -> None:
        if self.tiers is not None:
            self.tiers.free(payload)

    def _drop_host_victim(self, out: list) -> None:
        c = self._victim(self._host_lru)
        self.counts["dropped_host"] += 1
        self._drop(c, out)
        out.append(c)

    def _to_host(self, nbytes: int, payload: object, out: list, alive=lambda: True) -> tuple[bool, object]:
        """Room for nbytes on the host (dropping its least recently used checkpoints) and the payload's host copy:
        (True, host payload), or (False, None) when it cannot be had (more than the host budget, or no room even with
        the host tier emptied)."""
        if nbytes > self.host_budget_bytes:
            return False, None
        while True:
            while self._host_lru and self._host_bytes + nbytes > self.host_budget_bytes:
                self._drop_host_victim(out)
            if self._host_bytes + nbytes > self.host_budget_bytes or not alive():
                return False, None
            ok, moved = self._down(payload)
            if ok:
                return True, moved
            if moved is False:  # the copy cannot be made (device memory ran out): no host checkpoint is dropped for it
                self.counts["unmovable"] += 1
                return False, None
            if not self._host_lru:  # the pool has no room for it (fragmented) even when empty
                return False, None
            self._drop_host_victim(out)

    def _demote(self, c: Checkpoint, out: list) -> bool:
        """Move device checkpoint c to the host tier (most recent there); its group follows when c was its last on the
        device (`_settle`). False (nothing moved) when the host cannot take c."""
        if self.host_budget_bytes <= 0:
            return False
        g = c.group
        last = not any(x.tier == DEVICE for x in g.ckpts if x is not c)
        if c.nbytes + (g.nbytes if last else 0) > self.host_budget_bytes:
            return False
        ok, moved = self._to_host(c.nbytes, c.payload, out, lambda: c in self._lru)
        if not ok:
            return False
        self.version += 1
        c.payload, c.tier = moved, HOST
        del self._lru[c]
        self._host_lru[c] = None
        self._bytes -= c.nbytes
        self._host_bytes += c.nbytes
        self.counts["demoted"] += 1
        self._settle(g, out)
        return True

    def _settle(self, g: Group, out: list) -> None:
        """Keep a live group's payload on the device while one of its checkpoints is there, else on the host; when
        the host cannot take it, its host checkpoints go (and it with the last)."""
        if g not in self._groups or g.tier == HOST or any(x.tier == DEVICE for x in g.ckpts):
            return
        ok, moved = self._to_host(g.nbytes, g.payload, out, lambda: g in self._groups)
        if not ok:
            for x in list(g.ckpts):
                if g not in self._groups:
                    break
                self.counts["dropped_host"] += 1
                self._drop(x, out)
                out.append(x)
            return
        g.payload, g.tier = moved, HOST
        self._bytes -= g.nbytes
        self._host_bytes += g.nbytes

    def _drop(self, c: Checkpoint, out: list | None = None) -> None:
        self.version += 1
        if self.observer is not None:
            self.observer("evict", c)
        self._pins.pop(c, None)
        if c.tier == DEVICE:
            del self._lru[c]
            self._bytes -= c.nbytes
        else:
            del self._host_lru[c]
            self._host_bytes -= c.nbytes
            self._free(c.payload)
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
        g = c.group
        g.ckpts.remove(c)
        if not g.ckpts:
            self._drop_group(g)
        elif c.tier == DEVICE:
            self._settle(g, [] if out is None else out)

    def _drop_group(self, g: Group) -> None:
        del self._groups[g]
        for h in g.hashes:
            lst = self._prefix.get(h)
            if lst is not None:
                lst.remove(g)
                if not lst:
                    del self._prefix[h]
        if g.tier == DEVICE:
            self._bytes -= g.nbytes
        else:
            self._host_bytes -= g.nbytes
            self._free(g.payload)


MIN_ADVANCE = 16  # a checkpoint this close past the position a computation restores is not planted (it would save
# next to nothing; the step loop keeps states only this far inside a piece: statecache.run.batch.SNAP_GAP)


def state_end(state_len: int) -> int:
    """p: where a state of `state_len` tokens keeps its deepest checkpoint: its end, exactly (a question on it then
    computes only its own tokens; the state's other checkpoints lie on the `align` grid, plan_chunks). The one place
    it is derived; the cache, the plan below and statecache.sched read it here."""
    return state_len


def plan_chunks(start: int, state_len: int, *, stride: int, tail: int, align: int, max_chunk: int | None = None,
                extra: tuple = ()) -> list[int]:
    """The chunk ends of a row's state computed from a restored position ``start`` (0 = nothing restored), which
    are also the checkpoint positions to plant.

    With ``p = state_end(state_len)`` (the end itself): ``p``, and every multiple of ``stride`` below ``p``,
    ``p - tail`` and the ``extra`` positions below ``p`` (fork points), each rounded down to ``align`` and at least
    ``MIN_ADVANCE`` below ``p``; only those at least ``MIN_ADVANCE`` past ``start``, sorted. The step loop plants
    exactly these (``max_chunk`` None); a simulation of a runner whose chunks are at most ``max_chunk`` long
    splits a longer one at ``a + k * max_chunk`` from its own start ``a`` (those ends planted too). ``stride`` 0 or
    ``tail`` 0 disable those positions. ``[]`` when ``p < start + MIN_ADVANCE``.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if max_chunk is not None and (max_chunk < align or max_chunk % align):
        raise ValueError(f"max_chunk {max_chunk} must be a positive multiple of align {align}")
    if start < 0:
        raise ValueError(f"start {start} must be >= 0")
    if stride < 0 or tail < 0:
        raise ValueError("stride and tail must be >= 0")

    def down(v: int) -> int:
        return v - v % align

    p = state_end(state_len)
    first = start + MIN_ADVANCE
    if p < first:
        return []
    below: set[int] = set()
    if stride:
        below.update(down(k) for k in range(stride, p, stride))
    if tail:
        below.add(down(p - tail))
    below.update(down(x) for x in extra if 0 < x < p)
    ends = {p} | {x for x in below if x <= p - MIN_ADVANCE}  # none just below p either (p serves as well)
    out: list[int] = []
    s = start
    for e in sorted(v for v in ends if v >= first):
        while max_chunk is not None and e - s > max_chunk:
            s += max_chunk
            out.append(s)
        out.append(e)
        s = e
    return out
