"""Memo and row_key: exact keys, LRU bound, copies in and out."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.rows.memo import Memo, row_key


def result(p: float = 0.25) -> dict:
    return {"probs": [[p, 1 - p]], "path": "hit", "reused": 512, "computed": 40}


def test_hit_and_miss() -> None:
    m = Memo(8)
    k = row_key([1, 2, 3], [2], [2])
    assert m.get(k) is None
    m.put(k, result())
    assert m.get(k) == result()
    assert m.get(row_key([1, 2, 4], [2], [2])) is None  # one token apart
    assert m.get(row_key([1, 2, 3], [1], [2])) is None  # another slot
    assert m.get(row_key([1, 2, 3], [2], [3])) is None  # another option count
    assert len(m) == 1


def test_row_key_is_exact_and_type_independent() -> None:
    ids = np.arange(300, dtype=np.int64)
    k = row_key(ids, np.array([299]), [4])
    assert k == row_key(list(range(300)), [299], [4])
    assert k == row_key(ids.astype(np.int32), (299,), np.array([4], dtype=np.int64))
    assert hash(k) == hash(row_key(list(range(300)), [299], [4]))
    assert all(type(v) is int for part in k for v in part)
    assert row_key([1, 2], [1], [2]) != row_key([1], [2, 1], [2])  # parts never run into each other
    with pytest.raises(TypeError):
        row_key([1.0, 2.0], [1], [2])
    with pytest.raises(TypeError):
        row_key(np.array([1.0, 2.0]), [1], [2])


def test_lru_bound() -> None:
    m = Memo(3)
    keys = [row_key([i], [0], [2]) for i in range(5)]
    for k in keys[:3]:
        m.put(k, result())
    assert m.get(keys[0]) is not None  # keys[0] is now the most recent: keys[1] goes first
    m.put(keys[3], result())
    assert len(m) == 3
    assert m.get(keys[1]) is None
    assert all(m.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    m.put(keys[4], result())  # order was 0, 2, 3 after the gets: 0 goes
    assert len(m) == 3 and m.get(keys[0]) is None
    m.put(keys[4], result(0.5))  # an update does not grow it
    assert len(m) == 3 and m.get(keys[4]) == result(0.5)


def test_copy_semantics() -> None:
    m = Memo()
    k = row_key([5, 6, 7], [2], [2])
    v = result()
    m.put(k, v)
    v["probs"][0][0] = 9.0  # the caller's dict after put
    v["path"] = "plain"
    got = m.get(k)
    assert got == result()
    got["path"] = "memo"  # what callers do with a hit
    got["probs"][0].append(0.0)
    assert m.get(k) == result()


def test_zero_entries_disables_and_clear() -> None:
    m = Memo(0)
    m.put(row_key([1], [0], [2]), result())
    assert len(m) == 0 and m.get(row_key([1], [0], [2])) is None
    with pytest.raises(ValueError):
        Memo(-1)
    m = Memo(4)
    m.put(row_key([1], [0], [2]), result())
    m.clear()
    assert len(m) == 0 and m.get(row_key([1], [0], [2])) is None
