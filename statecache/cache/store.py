"""The cross-request state cache: the saved model states rows continue from, and nothing that runs the model.

A row is [state | question]; p = state_len (the state's end, statecache.cache.index.state_end). A state's checkpoints
sit at `plan`'s positions (p, and every multiple of `stride` below p, p - `tail` and a fork point, rounded down to
`align`); a checkpoint holds, per Gated DeltaNet layer,
the recurrent state and the conv's last inputs at its position (and with specialists the router's feature sum
there, under the route its adapter layers ran with); the checkpoints one row planted form a group that shares the
row's attention K/V of [0, p), stored once (`plant`). Lookup is token-exact (statecache.cache.index): the deepest
checkpoint whose tokens equal the row's up to it. An LRU bounded in bytes (states, conv tails and each group's K/V
once) is enforced by the caller (`index.evict`). What the device budget cannot keep moves to the host tier
(statecache.cache.index's two tiers; statecache.cache.tiers.HostPool's buffer, pinned on CUDA, `host_mb`), dropped from there by
its own LRU; a checkpoint on the host is copied back into the device budget before its row runs (`bring`).
Fork points: where a row's state shares an aligned prefix [0, x) with a cached group but no checkpoint sits at x
(a new page after the same goal and steps), x joins the row's plan (`fork_point`), so the next change reuses [0, x);
the tokens that prefix held beyond the restored checkpoint count as `tokens_lost`.

Image rows (statecache.run.images.RowImages) are known to the index by their key tokens: each image-pad token replaced
by a key derived from its image's sha256, so the same screenshot with a new question is a hit and a different one
at the same place never matches.

Knows tensors and bytes: not the model, not how a row runs (statecache.step runs rows from what `bring` returns and
hands `plant` what they computed), not whether a new state is planted at all (statecache.cache.policy), nor Redis, text,
the memo or batching.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from statecache.cache.budget import CPU_DEFAULT_MB, MIB, host_available_bytes, host_budget
from statecache.cache.config import CacheSettings
from statecache.cache.index import DEVICE, Checkpoint, CheckpointIndex, plan_chunks, state_end
from statecache.cache.tiers import HostPool

log = logging.getLogger("statecache.cache.store")


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
    def __init__(self, settings: CacheSettings | None = None, device="cpu", *, checkpoint_bytes: int = 0,
                 position_bytes: int = 0):
        """checkpoint_bytes: what one checkpoint's tensors take (GDN states, conv tails); position_bytes: one
        position of a group's attention K/V (both K and V of every attention layer): for `state_bytes`. A budget of
        None (`CacheSettings.mb`: the engine sizes it from the device once its forwards are in place) holds the
        CPU's fixed default until then."""
        self.s = dataclasses.replace(settings or CacheSettings())  # a copy: the engine re-sizes its budget
        if self.s.mb is None:
            self.s.mb = CPU_DEFAULT_MB
        if self.s.align < 1:
            raise ValueError(f"align must be >= 1, got {self.s.align}")
        self.checkpoint_bytes, self.position_bytes = int(checkpoint_bytes), int(position_bytes)
        self.host_budget = host_budget(self.s.host_mb, host_available_bytes() if self.s.host_mb is None else None)
        host_bytes = self.host_budget.mb * MIB if self.s.mb > 0 else 0
        self.index = CheckpointIndex(self.s.mb * 2**20, align=self.s.align, host_budget_bytes=host_bytes)
        self.host = HostPool(host_bytes, device) if host_bytes else None  # slabs as it fills
        self.index.tiers = self.host
        self.last_route = 0  # specialists: the route guessed for a row with no checkpoint
        self._serial = 0  # groups' serial numbers
        self.stats = {"rows": 0, "hits": 0, "partial": 0, "cold": 0, "tokens_reused": 0,
                      "tokens_computed": 0, "ckpts_made": 0, "evicted": 0, "mispredict": 0,
                      "restored_device": 0, "restored_host": 0, "tokens_lost": 0, "forks": 0}

    # ---- what may come here ---------------------------------------------------------------------------------------

    def state_end(self, state_len: int) -> int:
        """p: where the state's deepest checkpoint sits, its end (statecache.cache.index.state_end)."""
        return state_end(state_len)

    def eligible(self, state_len: int, slots) -> bool:
        """May this row's state be cached: a long enough state, 1..max_slots slots, all at or after p (rows with
        images too: see the module docstring). Whether a runner can run it is the runner's to say."""
        p = self.state_end(state_len)
        if self.s.mb <= 0 or p < self.s.min_prefix or not 0 < len(slots) <= self.s.max_slots:
            return False
        return min(slots) >= p

    def plan(self, state_len: int, start: int = 0, fork: int = 0) -> list[int]:
        """The checkpoint positions a state of state_len tokens plants, continuing from `start` (0: nothing
        restored), with the fork point `fork` (0: none; `fork_point`): the chunk ends of
        statecache.cache.index.plan_chunks, with no chunk cut for length)."""
        return plan_chunks(start, state_len, stride=self.s.stride, tail=self.s.tail, align=self.s.align,
                           extra=(fork,) if fork else ())

    def fork_point(self, keys, p: int, c0: int) -> int:
        """The deepest aligned position x <= p to which a cached group shares the row's tokens (index.shared_depth)
        when it lies past the restored position c0 (else 0): the prefix [c0, x) is recomputed though it was cached,
        and counted as `tokens_lost`; planting a checkpoint at x lets the next row sharing it reuse it. Asked once per
        row that runs, before it plants."""
        x, fork = self.index.fork_point(keys, p, c0)
        if x > c0:
            self.stats["tokens_lost"] += x - c0
        self.stats["forks"] += bool(fork)
        return fork

    def bring(self, c: Checkpoint | None, keys, limit: int, route: int | None = None) -> Checkpoint | None:
        """The checkpoint a row will restore, on the device: one on the host tier is copied back (statecache.cache.index
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
        return len(self.plan(state_len)) * self.checkpoint_bytes + self.state_end(state_len) * self.position_bytes

    def guess(self, best: Checkpoint | None) -> int:
        """The route a row runs with before its router has spoken: its deepest checkpoint's, else the last row's."""
        return best.route if best is not None else self.last_route

    def plant(self, ids, p: int, snaps, route: int, kv: tuple[torch.Tensor, torch.Tensor], forks=()) -> None:
        """A group over ids[:p] (index keys: an image row's RowImages.keys) with its checkpoints (pos, conv, S,
        feature sum | None), planted under `route`, sharing the K/V [A, p, Hkv, D] of `kv`; the tensors are kept as
        they are (the caller hands over tensors nothing writes again). Checkpoints at `forks` (`fork_point`) are
        planted as fork points (CheckpointIndex.add_checkpoint)."""
        K, V = kv
        if K.shape[1] != p or V.shape[1] != p:
            raise ValueError(f"K/V of {K.shape[1]} positions for a state planted up to {p}")
        self._serial += 1
        group = self.index.add_group(ids[:p], (K, V, self._serial), _nbytes(K, V))
        for pos, conv, S, fsum in snaps:
            parts = (conv, S) if fsum is None else (conv, S, fsum)
            self.index.add_checkpoint(group, pos, parts, _nbytes(*parts), route=route, fork=pos in forks)
            self.stats["ckpts_made"] += 1

    def clear(self) -> None:
        self.index.clear()

    def info(self) -> dict:
        """Counters: rows by path, tokens, checkpoints made; per tier its bytes, checkpoints and groups; restores by
        tier (restored_device, restored_host) and the host tier's copies (host: copies_up and up_ms are the copies
        back); evictions by tier and reason (tiers: demoted, dropped_device, dropped_host, replaced, promoted);
        tokens_lost (see fork_point)."""
        return {**self.stats, "checkpoints": len(self.index), "groups": self.index.n_groups,
                "bytes": self.index.bytes, "mb": self.s.mb, "host_bytes": self.index.host_bytes,
                "host_mb": self.index.host_budget_bytes // MIB, **self.index.tier_counts(),
                "tiers": dict(self.index.counts), **({"host": self.host.info()} if self.host is not None else {})}
