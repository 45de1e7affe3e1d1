"""A bounded LRU memo of results for exactly repeated rows, answered before anything runs.

The key is the row's full tokens, slots and option counts (``row_key``), so a hit is exact: equal keys mean an
equal row. Values are plain result dicts; the memo stores a deep copy and hands out a deep copy, so callers may
mutate what they get (e.g. set ``path="memo"``) or what they put.

What this module does NOT know: the model, tokenizer, routes or devices. A result depends on the model too, so
whoever changes the model must ``clear()`` the memo. No torch import, no locking (driven from one thread).
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

RowKey = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def row_key(ids: Iterable[int], slots: Iterable[int], nopts: Iterable[int]) -> RowKey:
    """An exact, hashable key of a row: its tokens, answer slots and option counts as tuples of Python ints
    (a list and a numpy array of the same tokens give the same key)."""
    return _ints(ids), _ints(slots), _ints(nopts)


def _ints(xs: Iterable[int]) -> tuple[int, ...]:
    """Integers as a tuple of Python ints; a float (even 3.0) is refused rather than truncated."""
    if isinstance(xs, np.ndarray):
        if xs.size and xs.dtype.kind not in "iu":
            raise TypeError(f"expected integers, got {xs.dtype}")
        return tuple(xs.tolist())
    return tuple(map(operator.index, xs))


class Memo:
    """Results by key, at most ``max_entries`` of them, least recently used evicted first (0 disables it)."""

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = int(max_entries)
        self._d: OrderedDict[Hashable, dict] = OrderedDict()

    def get(self, key: Hashable) -> dict | None:
        """A copy of the result stored under ``key`` (now most recently used), or None."""
        v = self._d.get(key)
        if v is None:
            return None
        self._d.move_to_end(key)
        return copy.deepcopy(v)

    def put(self, key: Hashable, value: dict) -> None:
        """Store a copy of ``value`` as most recently used; evict the least recently used beyond the bound."""
        if self.max_entries == 0:
            return
        self._d[key] = copy.deepcopy(value)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
