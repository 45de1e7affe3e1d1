"""A bounded LRU memo of results for exactly repeated rows, answered before anything runs.

The key is the row's full tokens (as int64 bytes), slots and options (``row_key``), so a hit is exact: equal keys mean an
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

RowKey = tuple[object, tuple[int, ...], tuple[int, ...]]


def row_key(ids: Iterable[int], slots: Iterable[int], options: Iterable) -> RowKey:
    """An exact, hashable key of a row: its tokens as the bytes of an int64 array (hashed once, compared with
    memcmp: a 4k-token key costs microseconds to look up), its answer slots as a tuple of Python ints and its
    options per slot (an option count, or a tuple of option token ids: rows that differ only in their options are
    different rows). A list and a numpy array of the same tokens give the same key; floats are refused."""
    return _id_bytes(ids), _ints(slots), tuple(_spec(x) for x in options)


def _id_bytes(ids: Iterable[int]) -> object:
    arr = ids if isinstance(ids, np.ndarray) else np.array(ids if isinstance(ids, (list, tuple)) else list(ids))
    if arr.size and arr.dtype.kind not in "iub":
        if arr.dtype.kind == "O":  # ints beyond int64 (or junk): exact Python ints, never equal to an array key
            return _ints(arr.tolist())
        raise TypeError(f"expected integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False).tobytes()


def _ints(xs: Iterable[int]) -> tuple[int, ...]:
    """Integers as a tuple of Python ints; a float (even 3.0) is refused rather than truncated."""
    if isinstance(xs, np.ndarray):
        if xs.size and xs.dtype.kind not in "iu":
            raise TypeError(f"expected integers, got {xs.dtype}")
        return tuple(xs.tolist())
    return tuple(map(operator.index, xs))


def _spec(x) -> int | tuple[int, ...]:
    """One slot's options: a count stays an int, token ids become a tuple (never equal to a count)."""
    if isinstance(x, (list, tuple, np.ndarray)):
        return _ints(x)
    return operator.index(x)


_IMMUTABLE = (str, int, float, bool, type(None), bytes)


def _copy(x):
    """A deep copy of a JSON-like result (dicts, lists, scalars) without deepcopy's bookkeeping; anything else is
    deep-copied the general way."""
    t = type(x)
    if t is dict:
        return {k: _copy(v) for k, v in x.items()}
    if t is list:
        return [v if type(v) in _IMMUTABLE else _copy(v) for v in x]
    if t in _IMMUTABLE:
        return x
    return copy.deepcopy(x)


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
        return _copy(v)

    def put(self, key: Hashable, value: dict) -> None:
        """Store a copy of ``value`` as most recently used; evict the least recently used beyond the bound."""
        if self.max_entries == 0:
            return
        self._d[key] = _copy(value)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
