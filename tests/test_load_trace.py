"""bench/load_bench.py's trace and its unbounded-cache reference (the benchmark itself runs on the device)."""

import importlib.util
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("load_bench", ROOT / "bench" / "load_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_unbounded_reuse_by_hand():
    L = _bench()
    rng = random.Random(0)
    state = [rng.randrange(100, 500) for _ in range(300)]
    rows = [L.Row(0, state + [1, 2], 300, [301], [2]),  # new
            L.Row(0, state + [3, 4, 5], 300, [302], [3]),  # same state: 256 aligned
            L.Row(0, state + [7] * 100 + [1], 400, [400], [2]),  # grown: the old state, 300 -> 256
            L.Row(0, state[:150] + [9] * 250 + [1], 400, [400], [2]),  # middle change at 150 -> 128
            L.Row(1, state + [1], 300, [300], [2])]  # another agent: never shares
    assert L.unbounded_reuse(rows) == [0, 256, 256, 128, 0]


def test_trace_shape():
    L = _bench()
    tr = L.AgentTrace(3, seed=5, vocab=(10, 1000), min_state=2000, max_state=6000)
    rows = tr.interleaved(120)
    assert rows == L.AgentTrace(3, seed=5, vocab=(10, 1000)).interleaved(120)  # seeded
    for r in rows:
        assert 2000 <= r.state_len <= 6000 and 10 <= len(r.ids) - r.state_len <= 90
        assert 1 <= len(r.slots) <= 2 and all(r.state_len <= s < len(r.ids) for s in r.slots)
        assert all(10 <= t < 1000 for t in r.ids) and all(2 <= k <= 6 for k in r.nopts)
    moves = sum((a.moves for a in tr.agents), L.Counter())
    assert moves["grow"] > moves["replace"] > 0
    reuse = L.unbounded_reuse(rows)
    assert sum(reuse) > 0.8 * sum(r.state_len for r in rows[3:]) * 0.8
