"""Where a state's checkpoints sit, in the engine's own terms: `p` (statecache.cache.index.state_end: the state's end)
and the planted positions (statecache.cache.index.plan_chunks: p, and p - tail and every multiple of stride below p
rounded down to align, only those at least MIN_ADVANCE past the restored position). The numbers are the cache's settings
(statecache.cache.config.CacheSettings: stride, tail, align); pieces are cut by the scheduler, which plants no extra positions for them. Pure
arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from statecache.cache.config import CacheSettings
from statecache.cache.index import plan_chunks, state_end


@dataclass(frozen=True)
class Layout:
    stride: int
    tail: int
    align: int

    @classmethod
    def from_settings(cls, settings: CacheSettings | None = None) -> "Layout":
        """The layout of the cache's settings (default: their defaults)."""
        s = settings if settings is not None else CacheSettings()
        return cls(s.stride, s.tail, s.align)

    def end(self, state_len: int) -> int:
        """p: where the state's deepest checkpoint sits."""
        return state_end(state_len)

    def positions(self, start: int, state_len: int, forks: tuple = ()) -> list[int]:
        """The checkpoints a state of `state_len` tokens plants when computed from `start` (0: nothing restored), with
        its fork points `forks` (those deeper than `start`)."""
        return plan_chunks(start, state_len, stride=self.stride, tail=self.tail, align=self.align,
                           extra=tuple(x for x in forks if x > start))
