"""The graph-mode bookkeeping of the chunk runner and the plain path, on the CPU.

CUDA graphs need a GPU, but everything around them (shape keys, the one input buffer per graph, slots and option
counts as device data, captures before restores, a failed capture sending the row elsewhere, the shared pool) is
plain Python. Here `capture` is replaced by a stand-in whose "graph" re-runs the captured function and writes into
the captured output, exactly what a replay means, so those paths run with real models and are checked against
the plain forward (float32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

import statecache.graphs as graphs_mod
from statecache.cache import CacheSettings, StateCache
from statecache.kernels import TorchKernels
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner
from tests.cache_util import assert_close, one_thread, reference, small_model, toks


class ReplayGraph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


@pytest.fixture
def fake_graphs(monkeypatch):
    calls = {"captures": [], "fail": set()}

    def capture(fn, pool, warmup=2):
        calls["captures"].append(pool)
        for _ in range(warmup):
            out = fn()
        if out.shape[0] in calls["fail"]:
            raise RuntimeError("capture refused (test)")
        out = fn()
        return ReplayGraph(fn, out), out

    monkeypatch.setattr(graphs_mod, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with one_thread():
        yield calls


def test_cached_rows_through_replayed_graphs(fake_graphs):
    runner = ChunkRunner(small_model(), TorchKernels(), graphs=True)
    assert runner.pad and runner.pool == "the-pool"
    cache = StateCache(runner, CacheSettings(min_prefix=64, stride=128))
    state = toks(300, 61)
    for q, path in enumerate(["cold", "hit", "hit"]):
        ids = state + toks(17 + 9 * q, 70 + q)
        slots, nopts = [len(ids) - 1, 300], [4, 9]
        ans = cache.row(ids, 300, slots, nopts)
        assert ans is not None and ans.path == path
        assert_close(ans.probs, reference(ids, slots, nopts))
    assert all(g is not None for g in runner.graphs.values())
    assert sum(g.graph.replays for g in runner.graphs.values()) >= 5  # chunks of the cold row + each question
    assert runner.stats["captures"] == len(runner.graphs) == len(fake_graphs["captures"])


def test_failed_capture_sends_the_row_elsewhere(fake_graphs):
    runner = ChunkRunner(small_model(), TorchKernels(), graphs=True)
    cache = StateCache(runner, CacheSettings(min_prefix=64, stride=128))
    fake_graphs["fail"].add(runner.max_slots)  # every chunk graph's output has max_slots rows: all refuse
    ids = toks(300, 62) + toks(20, 63)
    assert cache.row(ids, 300, [319], [4]) is None
    assert runner.stats["capture_failed"] == 1 and runner.failures
    assert cache.stats["rows"] == 0 and len(cache.index) == 0


def test_lone_plain_rows_through_replayed_graphs(fake_graphs):
    plain = PlainPath(small_model(), TorchKernels(), graphs=True, pool="shared")
    rows = [(toks(n, 80 + n), [n - 1, n // 3], [3, 6]) for n in (40, 64, 65, 130)]
    for row in rows:
        assert_close(plain.forward([row])[0], reference(*row))
    assert sorted(plain.graphs) == [(64, 4), (128, 4), (192, 4)]  # 40 and 64 share the 64-token graph
    assert plain.graphs[(64, 4)].graph.replays == 2 and set(fake_graphs["captures"]) == {"shared"}
    fake_graphs["fail"].add(16)  # a row with 5 slots needs the 16-slot graph, which refuses: it runs packed
    row = (toks(50, 90), [10, 20, 30, 40, 49], [2, 3, 4, 5, 6])
    assert_close(plain.forward([row])[0], reference(*row))
    assert plain.graphs[(64, 16)] is None and plain.stats["capture_failed"] == 1


def test_precaptured_plain_graphs_and_no_capture_while_serving(fake_graphs):
    """An engine that precaptures: short lone rows' graphs at start-up, then nothing captured while serving; a lone
    row of a shape without a graph runs packed, with the same answer."""
    plain = PlainPath(small_model(), TorchKernels(), graphs=True, pool="shared")
    info = plain.precapture(max_tokens=128)
    assert sorted(plain.graphs) == [(64, 4), (128, 4)] and info["graphs"] == 2
    plain.capture_on_demand = False
    rows = [(toks(n, 95 + n), [n - 1], [4]) for n in (50, 120, 300)]
    for row in rows:
        assert_close(plain.forward([row])[0], reference(*row))
    assert sorted(plain.graphs) == [(64, 4), (128, 4)] and len(fake_graphs["captures"]) == 2
    assert plain.graphs[(64, 4)].graph.replays == 1 and plain.graphs[(128, 4)].graph.replays == 1


def test_fill_inputs_layout_and_no_stale_values():
    """A graph's input buffer is reused run after run: a shorter row must leave nothing of the longer one behind.
    Options: a count k is the first k letters (codes -2 - j), token ids as given, -1 past a slot's options, two
    letters in a padding slot."""
    import numpy as np

    from statecache.graphs import MAX_OPTIONS, fill_inputs, input_size, pack_inputs

    def opts(*rows):
        return [x for r in rows for x in list(r) + [-1] * (MAX_OPTIONS - len(r))]

    got = pack_inputs(8, 3, [1, 2, 3], [0, 2], [4, (17, 5)], (7, 3)).tolist()
    assert got == [1, 2, 3, 0, 0, 0, 0, 0] + [0, 2, 0] + opts([-2, -3, -4, -5], [17, 5], [-2, -3]) + [7, 3]
    n = input_size(8, 3, 2)
    buf = np.full(n, -7, dtype=np.int64)
    fill_inputs(buf, 8, 3, np.arange(10, 18), [5, 6, 7], [3, (1, 2, 3, 4), 26], (64, 8))
    fill_inputs(buf, 8, 3, np.array([9]), [0], [(30, 31)], (128, 1))
    assert buf.tolist() == [9, 0, 0, 0, 0, 0, 0, 0] + [0, 0, 0] + opts([30, 31], [-2, -3], [-2, -3]) + [128, 1]
