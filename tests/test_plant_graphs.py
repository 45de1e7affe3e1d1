"""A lone planting row as pieces of graphs (statecache.plant.PlantGraphs), on the CPU.

CUDA graphs need a GPU; here the same pieces run eagerly (`run(..., eager=True)`): the forward of the padded row
with each delta rule taken out through the stage buffers and run split at the row's own positions, the conv tails
gathered by index, the K/V copied out of the static buffers. Its answers equal the plain forward's and its
checkpoints the packed planting forward's (float32). Through PlainPath: a lone planting row goes to the planter when
`plant_graphs` is on, and to the packed form when its shape fails to capture.
"""

from __future__ import annotations

import pytest
import torch

import statecache.graphs as graphs_mod
from statecache.kernels import TorchKernels
from statecache.plain import SLOT_BUCKETS, PlainPath
from statecache.plant import PlantGraphs
from tests.cache_util import assert_close, make_cache, one_thread, plain_path, reference, small_model, toks


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


def planter() -> PlantGraphs:
    return PlantGraphs(small_model(), TorchKernels(), None, 1024, graphs_mod.new_stats(), [])


@pytest.mark.parametrize("n,state_len,stride,tail", [(320, 300, 128, 16), (333, 300, 64, 64), (700, 650, 192, 16),
                                                     (130, 64, 0, 0)])
def test_pieces_equal_the_packed_planting_forward(n, state_len, stride, tail):
    cache = make_cache(False, stride=stride, tail=tail)
    ids = toks(n, n)
    slots, nopts = [n - 1, state_len], [4, 7]
    plan = cache.plan(state_len)
    pg = planter()
    key = pg.key(n, len(slots), len(plan), 64, SLOT_BUCKETS)
    assert key[0] >= n and key[0] % 64 == 0
    probs, pl = pg.run(key, ids, slots, nopts, plan, eager=True)
    assert_close(probs, reference(ids, slots, nopts))
    _, (want,) = plain_path().run([(ids, slots, nopts)], [plan])
    assert pl.positions == want.positions == plan
    pairs = [("S", pl.S, want.S), ("conv", pl.conv, want.conv), ("K", [pl.K], [want.K]), ("V", [pl.V], [want.V])]
    for name, a, b in pairs:
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def cpu_graph_mode(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_plain_path_sends_a_lone_planting_row_to_the_planter(cpu_graph_mode, monkeypatch):
    seen = []
    real = PlantGraphs.run
    monkeypatch.setattr(PlantGraphs, "run", lambda self, *a, **k: seen.append(a[0]) or real(self, *a, eager=True))
    pp = PlainPath(small_model(), TorchKernels(), graphs=True, plant_graphs=True, max_graph_tokens=1024)
    monkeypatch.setattr(pp, "_single", lambda *a: None)  # plain single rows: not this test's business
    cache = make_cache(False)
    a, b = toks(320, 1), toks(200, 2)
    outs, planted = pp.run([(a, [319], [4])], [cache.plan(300)])
    outs = [probs for probs, _route in outs]
    assert seen == [(320, 4, 4)] and planted[0].positions == [128, 192, 256]
    assert_close(outs[0], reference(a, [319], [4]))
    outs, planted = pp.run([(a, [319], [4]), (b, [199], [3])], [cache.plan(300), None])  # two rows: packed
    outs = [probs for probs, _route in outs]
    assert len(seen) == 1 and planted[1] is None and planted[0].positions == [128, 192, 256]
    assert_close(outs[1], reference(b, [199], [3]))


def test_a_shape_that_fails_to_capture_runs_packed(cpu_graph_mode):
    pp = PlainPath(small_model(), TorchKernels(), graphs=True, plant_graphs=True, max_graph_tokens=1024)
    a = toks(320, 3)
    plan = make_cache(False).plan(300)
    for _ in range(2):
        outs, planted = pp.run([(a, [319], [4])], [plan])  # no CUDA here: the capture fails, once
        outs = [probs for probs, _route in outs]
        assert_close(outs[0], reference(a, [319], [4]))
        assert planted[0].positions == plan
    assert pp.stats["capture_failed"] == 1 and pp.failures and pp.planter.graphs == {(320, 4, 4): None}


def test_one_key_serves_rows_of_other_states_and_positions():
    """Rows of one padded length, slot and checkpoint bucket but other states and positions, one after another
    through the same static buffers: nothing of the previous row leaks into the next."""
    pg = planter()
    cache = make_cache(False)
    keys = set()
    for k, (n, state_len) in enumerate([(330, 300), (320, 130), (300, 260), (330, 300)]):
        ids = toks(n, 40 + k)
        plan = cache.plan(state_len)
        key = pg.key(n, 1, len(plan), 64, SLOT_BUCKETS)
        keys.add(key)
        probs, pl = pg.run(key, ids, [n - 1], [4], plan, eager=True)
        assert_close(probs, reference(ids, [n - 1], [4]))
        _, (want,) = plain_path().run([(ids, [n - 1], [4])], [plan])
        for x, y in zip(pl.S + pl.conv + [pl.K, pl.V], want.S + want.conv + [want.K, want.V]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert keys == {(320, 4, 4), (384, 4, 4)}
