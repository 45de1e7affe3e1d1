"""A lone planting row through statecache.plant.PlantGraph, on the CPU.

CUDA graphs need a GPU; here the same forward runs eagerly (`graphs=False`): the padded row's forward with the
checkpoints' conv tails gathered, the delta rule's states at chunk starts (`delta_states`), the unaligned checkpoint
advanced through the one-chunk path with the rest of its chunk masked out (with `unaligned`; without it such a plan
is refused and no layer runs that path), the K/V copied out of the static buffers. Its answers equal the plain
forward's and its checkpoints the packed planting forward's (float32). Through PlainPath: a lone planting row goes
to the planter, several go one at a time, a plan the layout cannot hold goes packed, `between` runs between the
pieces; in graph mode a shape without a graph runs packed and nothing is captured while serving. Through the engine:
new states run one forward each, each answered before the next one's forward, and `unaligned` is on only for a cache
aligned to less than 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

import statecache.graphs as graphs_mod
from statecache.kernels import TorchKernels
from statecache.plain import SLOT_BUCKETS, PlainPath
from statecache.plant import SNAP_SLOTS, PlantGraph
from tests.cache_util import assert_close, make_cache, one_thread, plain_path, reference, small_model, toks


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


def planter(every: int = 4, unaligned: bool = False, kernels=None) -> PlantGraph:
    return PlantGraph(small_model(), kernels or TorchKernels(), None, 1024, graphs_mod.new_stats(), [], every=every,
                      graphs=False, unaligned=unaligned)


def assert_planted_equal(pl, want) -> None:
    assert pl.positions == want.positions
    pairs = [("S", pl.S, want.S), ("conv", pl.conv, want.conv), ("K", [pl.K], [want.K]), ("V", [pl.V], [want.V])]
    for name, a, b in pairs:
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n,state_len,stride,tail", [(320, 300, 128, 16), (333, 300, 64, 64), (700, 650, 192, 16),
                                                     (130, 64, 0, 0), (260, 250, 0, 40), (400, 390, 128, 0)])
def test_the_graph_planter_equals_the_packed_planting_forward(n, state_len, stride, tail):
    cache = make_cache(False, stride=stride, tail=tail)
    ids = toks(n, n)
    slots, nopts = [n - 1, state_len], [4, 7]
    plan = cache.plan(state_len)
    pg = planter()
    T, S = pg.key(n, len(slots), SLOT_BUCKETS)
    assert T == pg.pad(n) >= n and T % (pg.bucket // 2) == 0 and S == 4
    probs, pl = pg.run(ids, slots, nopts, plan, SLOT_BUCKETS)
    assert_close(probs, reference(ids, slots, nopts))
    _, (want,) = plain_path().run([(ids, slots, nopts)], [plan])
    assert_planted_equal(pl, want)


def test_padded_lengths_are_fine_up_to_fine_tokens_then_coarse():
    """New pages pad to half a bucket (64, as the plain path's lone graphs do) up to fine_tokens, then to a bucket;
    precapture covers every padded length once."""
    pg = PlantGraph(small_model(), TorchKernels(), None, 1024, graphs_mod.new_stats(), [], fine_tokens=512, graphs=False)
    assert [pg.pad(n) for n in (1, 64, 65, 300, 512, 513, 640, 641, 1024)] == [64, 64, 128, 320, 512, 640, 640, 768, 1024]
    assert pg.lengths(256) == [256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert [T for T, _ in pg.keys(257, 4)] == pg.lengths(257)[:] and pg.lengths(257)[0] == 320
    assert pg.key(1025, 1, SLOT_BUCKETS) is None and pg.key(1024, 1, SLOT_BUCKETS) == (1024, 4)


def test_layouts_it_cannot_hold():
    pg = planter(unaligned=True)
    assert pg.layout([100, 130], 256) is None  # two unaligned positions
    assert pg.layout(list(range(64, 64 * (SNAP_SLOTS + 1), 64)), 1024) is None  # more aligned ones than slots
    assert pg.layout([2, 64], 256) is None  # a first position inside the conv window
    assert pg.layout([64, 256], 256) is None  # a position at the padded end (a row is longer than its state)
    idx, slots = pg.layout([64, 128, 176, 192], 256)
    assert slots == [0, 1, SNAP_SLOTS - 1, 2]
    W1 = pg.W1
    at = idx[SNAP_SLOTS * W1 : SNAP_SLOTS * W1 + SNAP_SLOTS]
    assert at == [1, 2, 3, 0, 0, 0, 0, 2] and idx[-1] == 176 - 128
    assert idx[: 3 * W1] == [64 - W1 + r for r in range(W1)] + [128 - W1 + r for r in range(W1)] + \
        [192 - W1 + r for r in range(W1)]


def test_between_runs_between_the_pieces_and_changes_nothing():
    calls = []
    pg = planter(every=1)  # 4 layers: pieces after layers 1, 2, 3
    cache = make_cache(False)
    ids = toks(320, 5)
    plan = cache.plan(300)
    probs, pl = pg.run(ids, [319], [4], plan, SLOT_BUCKETS, between=lambda: calls.append(1))
    assert len(calls) == 3
    assert_close(probs, reference(ids, [319], [4]))
    _, (want,) = plain_path().run([(ids, [319], [4])], [plan])
    assert_planted_equal(pl, want)


def test_one_planter_serves_rows_of_other_states_and_positions():
    """Rows of other lengths, states and positions one after another through the same static buffers: nothing of
    the previous row leaks into the next."""
    pg = planter()
    cache = make_cache(False)
    keys = set()
    for k, (n, state_len) in enumerate([(330, 300), (320, 130), (300, 260), (330, 300), (200, 190)]):
        ids = toks(n, 40 + k)
        plan = cache.plan(state_len)
        keys.add(pg.key(n, 1, SLOT_BUCKETS))
        probs, pl = pg.run(ids, [n - 1], [4], plan, SLOT_BUCKETS)
        assert_close(probs, reference(ids, [n - 1], [4]))
        _, (want,) = plain_path().run([(ids, [n - 1], [4])], [plan])
        assert_planted_equal(pl, want)
    assert keys == {(384, 4), (320, 4), (256, 4)}  # 320 and 300 tokens share a graph, as the two rows of 330 do


def test_plain_path_runs_planting_rows_alone_through_the_planter(monkeypatch):
    seen = []
    real = PlantGraph.run
    def spy(self, ids, *a, **k):
        got = real(self, ids, *a, **k)
        if got is not None:
            seen.append(len(ids))
        return got

    monkeypatch.setattr(PlantGraph, "run", spy)
    pp = PlainPath(small_model(), TorchKernels(), plant_graphs=True, max_graph_tokens=1024)
    assert pp.planter is not None and not pp.planter.use_graphs
    cache = make_cache(False)
    a, b, c = toks(320, 1), toks(200, 2), toks(260, 3)
    rows = [(a, [319], [4]), (b, [199], [3]), (c, [259], [4])]
    plans = [cache.plan(300), None, cache.plan(250)]
    assert pp.forwards(rows, plans) == [[0], [2], [1]]
    outs, planted = pp.run(rows, plans)
    assert seen == [320, 260] and planted[1] is None
    for (ids, slots, nopts), (probs, _route) in zip(rows, outs):
        assert_close(probs, reference(ids, slots, nopts))
    _, (want,) = plain_path().run([rows[2]], [plans[2]])
    assert_planted_equal(planted[2], want)
    odd = [100, 130]  # two unaligned positions: packed (PlantMixer)
    assert pp.forwards([rows[0]], [odd]) == [[0]] and not pp.planter.can(320, 1, odd, SLOT_BUCKETS)
    outs, planted = pp.run([rows[0]], [odd])
    assert seen == [320, 260] and planted[0].positions == odd


@pytest.fixture
def cpu_graph_mode(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_in_graph_mode_a_shape_without_a_graph_runs_packed(cpu_graph_mode):
    pp = PlainPath(small_model(), TorchKernels(), graphs=True, max_graph_tokens=1024)
    assert pp.planter is not None and pp.planter.use_graphs
    info = pp.planter.precapture(256, SLOT_BUCKETS[0], progress=None)  # no CUDA here: every capture fails
    assert info["graphs"] == 0 and pp.stats["capture_failed"] == len(pp.planter.keys(256, 4)) and pp.failures
    a = toks(320, 3)
    plan = make_cache(False).plan(300)
    captures = pp.stats["captures"]
    monkeypatch_single = pp._single
    pp._single = lambda *x: None  # plain single rows: not this test's business
    outs, planted = pp.run([(a, [319], [4])], [plan])
    pp._single = monkeypatch_single
    assert_close(outs[0][0], reference(a, [319], [4]))
    assert planted[0].positions == plan and pp.stats["captures"] == captures  # packed; nothing captured meanwhile


@pytest.mark.parametrize("plan", [[64, 176, 192], [4], [63], [64, 128, 129], [100]])
def test_an_unaligned_position_is_advanced_from_its_chunk_start(plan):
    """A plan with one position off the 64-token chunks (a cache aligned to less than 64, or a tail that is not a
    multiple of it): its state is its chunk start's advanced through the tokens before it, the rest of the chunk
    masked out; all of it equals the packed planting forward's (which splits the delta rule there)."""
    pg = planter(every=2, unaligned=True)
    n = 300
    ids = toks(n, 60 + plan[-1])
    assert pg.layout(plan, 384) is not None
    probs, pl = pg.run(ids, [n - 1], [4], plan, SLOT_BUCKETS)
    assert_close(probs, reference(ids, [n - 1], [4]))
    _, (want,) = plain_path().run([(ids, [n - 1], [4])], [plan])
    assert pl.positions == want.positions
    for name, a, b in (("S", pl.S, want.S), ("conv", pl.conv, want.conv)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for x, y in ((pl.K, want.K), (pl.V, want.V)):  # the split delta rule rounds differently upstream: within 1e-4
        torch.testing.assert_close(x, y, rtol=0, atol=1e-4)


def test_a_plan_past_the_row_is_refused():
    with pytest.raises(ValueError):
        planter().run(toks(200, 1), [199], [4], [64, 250], SLOT_BUCKETS)


class CountingKernels(TorchKernels):
    """TorchKernels counting its one-chunk delta-rule calls (the unaligned advance's kernel)."""

    def __init__(self):
        super().__init__()
        self.into = 0

    def delta_into(self, *a, **k):
        self.into += 1
        return super().delta_into(*a, **k)


@pytest.mark.parametrize("n,state_len,stride", [(320, 300, 128), (700, 650, 128), (130, 64, 0)])
def test_without_unaligned_aligned_plans_plant_the_same_and_skip_the_advance(n, state_len, stride):
    """unaligned=False (the default): a plan of chunk starts gives exactly what unaligned=True gives (answers and
    checkpoints), and no layer runs the one-chunk kernel; with unaligned=True every GDN layer runs it once."""
    plan = make_cache(False, stride=stride, tail=16).plan(state_len)
    assert all(c % 64 == 0 for c in plan)
    ids = toks(n, 90 + n)
    slots, nopts = [n - 1, state_len], [4, 7]
    k_off, k_on = CountingKernels(), CountingKernels()
    probs, pl = planter(kernels=k_off).run(ids, slots, nopts, plan, SLOT_BUCKETS)
    probs_on, pl_on = planter(kernels=k_on, unaligned=True).run(ids, slots, nopts, plan, SLOT_BUCKETS)
    assert k_off.into == 0 and k_on.into == len(small_model().cfg.linear_layers)
    assert probs == probs_on
    assert pl.positions == pl_on.positions == plan
    for a, b in ((pl.S, pl_on.S), (pl.conv, pl_on.conv), ([pl.K, pl.V], [pl_on.K, pl_on.V])):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    _, (want,) = plain_path().run([(ids, slots, nopts)], [plan])
    assert_planted_equal(pl, want)


def test_without_unaligned_every_slot_takes_an_aligned_position():
    """unaligned=False: SNAP_SLOTS chunk starts fit (the last slot is an ordinary one), one more does not; with
    unaligned=True one fewer fits (the last slot is kept for an unaligned position)."""
    full = list(range(64, 64 * (SNAP_SLOTS + 1), 64))
    assert planter().layout(full + [64 * (SNAP_SLOTS + 1)], 1024) is None
    assert planter(unaligned=True).layout(full, 1024) is None
    idx, slots = planter().layout(full, 1024)
    W1 = planter().W1
    assert slots == list(range(SNAP_SLOTS))
    assert idx[SNAP_SLOTS * W1 : SNAP_SLOTS * W1 + SNAP_SLOTS] == [c // 64 for c in full] and idx[-1] == 0
    n = full[-1] + 20
    ids = toks(n, 77)
    probs, pl = planter().run(ids, [n - 1], [4], full, SLOT_BUCKETS)
    assert_close(probs, reference(ids, [n - 1], [4]))
    _, (want,) = plain_path().run([(ids, [n - 1], [4])], [full])
    assert_planted_equal(pl, want)


@pytest.mark.parametrize("plan", [[64, 176, 192], [100], [64, 128, 129]])
def test_without_unaligned_a_plan_off_the_chunks_is_refused_and_runs_packed(plan):
    """unaligned=False: a plan with a position off the 64-token chunks has no layout (`can` says no), so PlainPath
    runs that row packed (PlantMixer), answered and planted as the packed planting forward does."""
    pg = planter()
    assert pg.layout(plan, 384) is None and not pg.can(300, 1, plan, SLOT_BUCKETS)
    assert planter(unaligned=True).can(300, 1, plan, SLOT_BUCKETS)
    pp = PlainPath(small_model(), TorchKernels(), plant_graphs=True, max_graph_tokens=1024)
    assert pp.planter is not None and not pp.planter.unaligned
    assert PlainPath(small_model(), TorchKernels(), plant_graphs=True, plant_unaligned=True).planter.unaligned
    ids = toks(300, 11 + plan[-1])
    row = (ids, [299], [4])
    outs, (pl,) = pp.run([row], [plan])
    assert pp.stats.get("planting_graph_rows", 0) == 0 and pp.stats["packed_forwards"] == 1
    assert_close(outs[0][0], reference(*row))
    _, (want,) = plain_path().run([row], [plan])
    assert_planted_equal(pl, want)


@pytest.mark.parametrize("align,state_len,unaligned", [(64, 300, False), (128, 300, False), (32, 300, True),
                                                     (16, 330, True), (16, 300, True)])
def test_the_engine_advances_to_unaligned_positions_only_for_a_cache_aligned_to_less_than_64(align, state_len,
                                                                                            unaligned):
    """The engine turns `unaligned` on exactly when its cache is aligned to less than 64 tokens (and then runs no step
    loop: the batched runner's snapshots sit on the 64-token chunks); a new state with one position off the chunks
    then goes through the planting graph, one with two (16, 300: 272 and 288) runs packed; either way its answers
    equal the plain forward's and its state serves the next question."""
    from statecache.cache import CacheSettings
    from statecache.engine import Engine
    from tests.test_engine import check

    eng = Engine(device="cpu", dtype="float32", max_pos=2048, plant_graphs=True,
                 settings=CacheSettings(min_prefix=64, stride=192, align=align))
    assert eng.plain.planter is not None and eng.plain.planter.unaligned is unaligned
    odd = [c for c in eng.cache.plan(state_len) if c % 64]
    assert len(odd) == (0 if align >= 64 else 2 if (align, state_len) == (16, 300) else 1)
    state = toks(state_len, 5)
    for k in range(2):
        rows = [{"ids": state + toks(6 + k, 6 + k), "state_len": state_len, "slots": [state_len + 5 + k], "nopts": [4]}]
        res = eng.answer(rows)
        check(eng, rows, res)
        assert res[0]["path"] == ("cold" if k == 0 else "hit")
    # a cache on the 64-token chunks: new states run through the step loop; one aligned to less: through the planting
    # graph when it holds the state's positions
    assert (eng.steps is not None) == (align % 64 == 0)
    assert eng.plain.stats.get("planting_graph_rows", 0) == (1 if eng.steps is None and len(odd) <= 1 else 0)
