"""Graph mode on the CPU: a stand-in for CUDA graph capture (`ReplayGraph`, the `fake_graphs` fixture: its "graph"
re-runs the captured function and writes into the captured output, exactly what a replay means), which
tests/triton_interp.py and the batched runner's graph tests use; and the answer slots' options as a graph's input
buffer holds them (statecache.run.graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import statecache.run.graphs as graphs_mod
from statecache.run.graphs import MAX_OPTIONS, fill_options
from tests.cache_util import one_thread


class ReplayGraph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


@pytest.fixture
def fake_graphs(monkeypatch):
    """statecache.run.graphs.capture replaced by ReplayGraph; calls["fail"]: output lengths whose capture is refused."""
    calls = {"captures": [], "fail": set()}

    def capture(fn, pool, warmup=1):
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


def test_fill_options_layout_and_no_stale_values():
    """A graph's options buffer is reused run after run: fewer or shorter slots must leave nothing of the earlier
    ones behind. A count k is the first k letters (codes -2 - j), token ids as given, -1 past a slot's options, two
    letters in a padding slot."""

    def opts(*rows):
        return [list(r) + [-1] * (MAX_OPTIONS - len(r)) for r in rows]

    buf = np.full((3, MAX_OPTIONS), -7, dtype=np.int64)
    fill_options(buf, [4, (17, 5)])
    assert buf.tolist() == opts([-2, -3, -4, -5], [17, 5], [-2, -3])
    fill_options(buf, [3, (1, 2, 3, 4), 26])
    fill_options(buf, [(30, 31)])
    assert buf.tolist() == opts([30, 31], [-2, -3], [-2, -3])
