"""The cache's settings (`CacheSettings`): its byte budgets and where checkpoints go. Torch-free, so that the
scheduler (statecache.sched) and the service's settings (statecache.settings) read the same defaults; the one place
they are written. Knows nothing of tensors or of how the settings are used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheSettings:
    mb: int | None = None  # LRU bound on everything held (MiB); 0 turns the cached path off; None: sized from the
    # device's free memory at start-up (`fraction` of it, statecache.cache.budget), the CPU's fixed default elsewhere
    fraction: float = 0.9  # the share of free device memory the cache may take when mb is None
    stride: int = 2048  # a checkpoint at every multiple of this below the state end (0: none)
    tail: int = 16  # and one at state end - tail, aligned (0: none)
    align: int = 64  # the grid of checkpoints below a state's end, of new pages' chunk cuts and of prefix hashes
    min_prefix: int = 256  # shorter states are not cached (their rows run from nothing: path plain)
    max_slots: int = 4  # answer slots a cached row may have
    host_mb: int | None = None  # the host tier's bound (MiB); None: from the host's memory (statecache.cache.budget); 0: off
