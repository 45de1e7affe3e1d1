"""Routing rows over several workers: state fingerprints and the routing decision, in plain Python.

Fingerprints. A state is known to the routing by fingerprints of its aligned prefixes: `prefix_fingerprints(keys,
p, align)` chains an 8-byte blake2b over the int64 bytes of each `align`-token block, so the k-th value names the
tokens [0, k * align) and a row's whole list (every aligned depth of its state) costs one pass over its tokens.
A cache's checkpoint at `pos` (statecache.cache.index; a state's end need not be a multiple of `align`) is advertised
as `fingerprint(keys, pos rounded down to align, align)`, the value a row's list holds at that depth: the worker
holding it advertises it (`FingerprintLedger`, fed by the index's observer calls on plant, hit and eviction) and a
row finds its deepest held depth by looking its list up.
A fingerprint only sends a row somewhere: the lookup inside the worker stays token-exact (statecache.cache.index), so a
collision costs a cold row, never a wrong answer. A row's keys and p come from the engine (`Engine.state_key`), the
one place that tokenises and aligns a row.

The decision. `choose` picks a worker for a row from what the live workers hold of its state (deepest depth
each), its home (`home`: rendezvous hashing of the state's first block over the live workers, so an agent's new
states go where its earlier ones went, and only 1/N of them move when a worker joins or leaves) and the workers'
loads (rows in their queues): the deepest holder, else the home, unless that worker's load exceeds the least
loaded one's by `shed_rows` (a holder: twice that): then the least loaded (a cold row there beats the wait). `take_from` says what an
idle worker may take from the others' queues (rows that waited past a grace period).

Knows tokens as int sequences and worker ids as strings; knows nothing of Redis, arq, torch or the model.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

FP_BYTES = 8


def _blocks(keys, upto: int) -> bytes:
    a = keys if isinstance(keys, np.ndarray) and keys.dtype == np.int64 else np.asarray(keys, dtype=np.int64)
    return np.ascontiguousarray(a[:upto]).tobytes()


def prefix_fingerprints(keys, p: int, align: int) -> list[str]:
    """Fingerprints (hex) of keys[:align], keys[:2*align], ..., keys[:p] (p a multiple of align; [] when p < align)."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    p -= p % align
    raw = _blocks(keys, p)
    step = align * 8
    out, h = [], b""
    for off in range(0, len(raw), step):
        h = hashlib.blake2b(h + raw[off: off + step], digest_size=FP_BYTES).digest()
        out.append(h.hex())
    return out


def fingerprint(keys, pos: int, align: int) -> str:
    """The fingerprint of keys[:pos] (pos a positive multiple of align): prefix_fingerprints(...)[-1]."""
    if pos < align or pos % align:
        raise ValueError(f"pos {pos} must be a positive multiple of align {align}")
    return prefix_fingerprints(keys, pos, align)[-1]


def home_key(keys, state_len: int, align: int) -> str:
    """What a state's home is hashed from: its first aligned block (an agent's goal and first steps stay put while
    its page changes), or all its tokens when it is shorter than one block."""
    n = align if state_len >= align else state_len
    return hashlib.blake2b(_blocks(keys, n), digest_size=FP_BYTES).hexdigest()


def _score(key: str, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}/{worker}".encode(), digest_size=8).digest(), "big")


def home(key: str, workers: Sequence[str]) -> str | None:
    """Rendezvous (highest random weight) hashing: the worker of `workers` with the highest score for `key`; stable
    while that worker lives, whoever else joins or leaves."""
    return max(workers, key=lambda w: _score(key, w)) if workers else None


@dataclass(frozen=True)
class Decision:
    worker: str
    reason: str  # affinity | home | shed | least_loaded
    depth: int = 0  # aligned blocks of the state the chosen worker holds (0: none)


HELD_PATIENCE = 2  # a row whose state a worker holds waits for it up to twice as much more load (elsewhere it is cold)

REASONS = ("affinity", "home", "shed", "least_loaded")


def choose(loads: Mapping[str, int], held: Mapping[str, int], key: str | None, shed_rows: int) -> Decision:
    """The worker for one row. loads: live worker -> rows in its queue (waiting or running); held: worker -> the
    deepest depth (blocks) of the row's state it advertises (absent or 0: none); key: the row's home key (None: no
    state to keep together, e.g. a row the cache does not take); shed_rows: how much more load than the least
    loaded worker's the preferred one may have before the row goes to the least loaded instead (twice that,
    HELD_PATIENCE, for a holder: elsewhere the row is cold; a row no one holds is cold everywhere)."""
    if not loads:
        raise ValueError("no live worker")
    least = min(loads, key=lambda w: (loads[w], w))
    live_held = {w: d for w, d in held.items() if d > 0 and w in loads}
    if live_held:
        best = max(live_held.values())
        pick = min((w for w, d in live_held.items() if d == best), key=lambda w: (loads[w], w))
        if loads[pick] - loads[least] <= HELD_PATIENCE * shed_rows:
            return Decision(pick, "affinity", best)
        return Decision(least, "shed", live_held.get(least, 0))
    if key is None:
        return Decision(least, "least_loaded")
    pick = home(key, sorted(loads))
    if loads[pick] - loads[least] <= shed_rows:
        return Decision(pick, "home")
    return Decision(least, "shed")


def take_from(my_load: int, waited_s: float, grace_s: float) -> bool:
    """May an idle worker (nothing queued or running: my_load 0) take a row from another's queue that has waited
    waited_s? Only past the grace period: before it, the row's own worker (which holds its state) may still reach it."""
    return my_load == 0 and waited_s >= grace_s


class FingerprintLedger:
    """The fingerprints a cache holds, fed by the index's observer (`observe`, called on the engine's thread on
    plant, hit and eviction) and drained by the worker's event loop (`drain`): which to advertise (planted or hit
    since the last drain) and which to withdraw (no checkpoint of it left). Counts checkpoints per fingerprint, so
    a checkpoint replaced by one of the same tokens (the index adds the new before dropping the old) stays
    advertised. Thread-safe."""

    def __init__(self, align: int):
        self.align = align
        self._fp: dict = {}  # checkpoint -> its fingerprint (computed once, at plant)
        self._count: dict[str, int] = {}
        self._fresh: set[str] = set()
        self._gone: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, event: str, ckpt) -> None:
        """event: plant | hit | evict, for a statecache.cache.index.Checkpoint (its group's keys and its pos)."""
        if event == "plant":
            depth = ckpt.pos - ckpt.pos % self.align  # the aligned prefix it holds (a state's end lies past it)
            if depth < self.align:
                return
            fp = fingerprint(ckpt.group.ids, depth, self.align)
            with self._lock:
                self._fp[ckpt] = fp
                self._count[fp] = self._count.get(fp, 0) + 1
                self._fresh.add(fp)
                self._gone.discard(fp)
        elif event == "hit":
            with self._lock:
                fp = self._fp.get(ckpt)
                if fp is not None:
                    self._fresh.add(fp)
        elif event == "evict":
            with self._lock:
                fp = self._fp.pop(ckpt, None)
                if fp is None:
                    return
                n = self._count[fp] - 1
                if n:
                    self._count[fp] = n
                else:
                    del self._count[fp]
                    self._fresh.discard(fp)
                    self._gone.add(fp)

    def drain(self) -> tuple[set[str], set[str]]:
        """(to advertise, to withdraw) since the last drain."""
        with self._lock:
            fresh, gone = self._fresh, self._gone
            self._fresh, self._gone = set(), set()
        return fresh, gone

    def held(self) -> set[str]:
        """Every fingerprint held now (to advertise again after Redis lost them)."""
        with self._lock:
            return set(self._count)
