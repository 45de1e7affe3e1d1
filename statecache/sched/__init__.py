"""The step scheduler: plans each GPU step under a token budget from rows, their tokens and a view of the cache;
plain Python, no torch (a rules test holds that for every module here).

- `layout`: where checkpoints sit (the cache's settings, statecache.cache.index's rule);
- `view`: the `CacheView` interface the scheduler asks, `OverIndex` (its members that read statecache.cache.index's
  real index as it is: the engine's view builds on it) and `IndexView`, one over that index with payloads of None;
- `steps`: `Scheduler`, its plan (`Step`, `Piece`) and its finished rows (`Finished`).
"""

from statecache.sched.layout import Layout
from statecache.sched.steps import (COLD, HIT, PARTIAL, PLAIN, Finished, Piece, Row, Scheduler, Step, attn_pairs,
                                    slots_at_one_position)
from statecache.sched.view import CacheView, IndexView, OverIndex

__all__ = ["Layout", "CacheView", "IndexView", "OverIndex", "Scheduler", "Row", "Piece", "Step", "Finished", "HIT",
           "PARTIAL", "COLD", "PLAIN", "attn_pairs", "slots_at_one_position"]
