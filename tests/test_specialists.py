"""Specialists (routed LoRA adapters) on the CPU in float32.

- The forward with every route equals transformers' Qwen3.5 with peft (`PeftModel`, the trunk with adapters disabled)
  within 1e-4, and the route picked equals the one computed from transformers' hidden states (tests.spec_util);
  both checkpoint layouts (causal and conditional keys), ranks, alphas, rsLoRA, layers_to_transform varied.
- The cached path equals the plain path (itself checked against peft) across same state, grown state, middle change
  and evictions, with mispredictions forced; graph mode with replayed stand-in graphs (one graph for every route);
  a property-based run over random row sequences with routes.
- Bad folders fail at start-up with a clear error; the engine and `statecache score` report routes by name.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from statecache.cache import CacheSettings, StateCache
from statecache.checkpoints import make_checkpoint
from statecache.config import load_config
from statecache.kernels import TorchKernels
from statecache.loader import load_weights
from statecache.model import Qwen35
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner
from statecache.specialists import SpecialistsError, load_specialists
from statecache.specialists.make import make_specialists, write_router
from tests.cache_util import LETTER_IDS, SHAPE, TOL, assert_close, down, index_bytes_recount, one_thread, toks
from tests.oracle_util import build_checkpoint, max_abs_diff
from tests.oracle_util import LETTERS as ORACLE_LETTERS
from tests.spec_util import SpecReference
from tests.test_graph_modes import fake_graphs  # noqa: F401 - the stand-in graphs fixture

PADS = [pytest.param(False, id="exact"), pytest.param(True, id="padded")]
ROUTES = ("trunk", "alpha", "beta", "gamma")
# 4 layers: GDN, GDN, GDN, attention; the router reads the state entering layer 1
ADAPTERS = {
    "beta": dict(r=3, lora_alpha=5, target_modules=["in_proj_qkv", "in_proj_b", "out_proj", "q_proj", "o_proj", "up_proj"],
                 layers_to_transform=[1, 3], rank_pattern={"out_proj": 2}, alpha_pattern={"q_proj": 7}),
    "gamma": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["gate_proj", "down_proj", "k_proj", "v_proj"],
                  layers_to_transform=[3]),
}
_dirs: list = []


@functools.lru_cache(maxsize=1)
def world():
    """The small test model (tests.cache_util.SHAPE) with a 4-route specialists folder, loaded once."""
    tmp = tempfile.TemporaryDirectory(prefix="statecache-spec-")
    _dirs.append(tmp)
    md = make_checkpoint(Path(tmp.name) / "model", seed=7, **SHAPE)
    sd = make_specialists(md, Path(tmp.name) / "spec", routes=ROUTES, router_layer=1, adapters=ADAPTERS, seed=3,
                          scale=0.1)
    model = Qwen35(load_weights(md, LETTER_IDS, "cpu", torch.float32))
    spec = load_specialists(sd, model.cfg)
    return md, sd, model, spec


@functools.lru_cache(maxsize=1)
def reference_model() -> SpecReference:
    md, sd, _, _ = world()
    return SpecReference(md, sd, LETTER_IDS)


@functools.lru_cache(maxsize=1)
def plain() -> PlainPath:
    _, _, model, spec = world()
    return PlainPath(model, TorchKernels(), specialists=spec)


def plain_answer(ids, slots, nopts):
    return plain().answer([(list(ids), list(slots), list(nopts))])[0]


def forced_folder(route: int) -> Path:
    """A copy of the folder whose router always picks `route` (its bias dominates)."""
    _, sd, _, spec = world()
    out = Path(_dirs[0].name) / f"forced{route}"
    if not out.exists():
        shutil.copytree(sd, out)
        bias = torch.zeros(len(ROUTES))
        bias[route] = 1e4
        rw = load_file(str(sd / "router.safetensors"))
        write_router(out, list(ROUTES), 1, rw["weight"], bias)
    return out


def make_cache(pad: bool, spec, graphs: bool | None = None, **settings) -> StateCache:
    _, _, model, _ = world()
    runner = ChunkRunner(model, TorchKernels(), pad=pad, max_pos=1024, span_step=256, specialists=spec, graphs=graphs)
    s = {"mb": 64, "stride": 128, "tail": 16, "align": 64, "min_prefix": 64, **settings}
    return StateCache(runner, CacheSettings(**s))


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


# ---- the forward against transformers + peft -------------------------------------------------------------------------


def _rows(seed: int, k: int = 4):
    out = []
    for j in range(k):
        n = 40 + 23 * j
        ids = toks(n, seed + j)
        out.append((ids, [n - 1, n // 2], [4, 3]))
    return out


@pytest.mark.parametrize("route", range(len(ROUTES)))
def test_every_route_equals_peft(route):
    """The router forced to each route in turn: plain (packed and single) and cached answers equal PeftModel's with
    that route's adapter (the trunk: adapters disabled)."""
    _, _, model, _ = world()
    spec = load_specialists(forced_folder(route), model.cfg)
    ref = reference_model()
    rows = _rows(10 * route)
    packed = PlainPath(model, TorchKernels(), specialists=spec).answer(rows)
    single = PlainPath(model, TorchKernels(), specialists=spec, pad=True).answer(rows[:1])
    for (ids, slots, nopts), (probs, r) in zip(rows, packed):
        _, want = ref.answers(ids, slots, nopts, route=route)
        assert r == route
        assert max_abs_diff(probs, want) <= TOL
    assert single[0][1] == route and max_abs_diff(single[0][0], packed[0][0]) <= TOL
    cache = make_cache(False, spec)
    ids = toks(200, 99) + toks(30, route)
    ans = cache.row(ids, 200, [229], [5])
    assert ans.route == route
    assert max_abs_diff(ans.probs, ref.answers(ids, [229], [5], route=route)[1]) <= TOL


def test_router_picks_the_references_route():
    """The folder's own router over rows of random tokens: the route (and answer) equal the reference's, and the
    rows do not all take one route (else this test would show little)."""
    ref = reference_model()
    rows = _rows(500, k=10)
    got = plain().answer(rows)
    seen = set()
    for (ids, slots, nopts), (probs, r) in zip(rows, got):
        want_r, want = ref.answers(ids, slots, nopts)
        assert r == want_r
        assert max_abs_diff(probs, want) <= TOL
        seen.add(r)
    assert len(seen) >= 2, seen


def test_conditional_layout_keys(tmp_path):
    """A checkpoint in the Qwen3_5ForConditionalGeneration layout: its adapters' keys hold `language_model`."""
    md = build_checkpoint(tmp_path / "model", "cond_untied_sharded", seed=1)
    sd = make_specialists(md, tmp_path / "spec", routes=("trunk", "a", "b"), router_layer=3, seed=5, scale=0.1)
    keys = load_file(str(sd / "a" / "adapter_model.safetensors"))
    assert all(".language_model.layers." in k for k in keys)
    cfg = load_config(md)
    spec = load_specialists(sd, cfg)
    assert spec.split == 4 and spec.names == ["trunk", "a", "b"]
    model = Qwen35(load_weights(md, ORACLE_LETTERS, "cpu", torch.float32))
    ref = SpecReference(md, sd, ORACLE_LETTERS)
    rows = [(toks(50, s), [49, 20], [4, 2]) for s in range(3)]
    for (ids, slots, nopts), (probs, r) in zip(rows, PlainPath(model, TorchKernels(), specialists=spec).answer(rows)):
        want_r, want = ref.answers(ids, slots, nopts)
        assert r == want_r and max_abs_diff(probs, want) <= TOL


def test_trunk_is_exactly_the_model_without_specialists():
    """Route 0 adds exact zeros: answers equal the forward without specialists bit for bit."""
    _, _, model, _ = world()
    spec = load_specialists(forced_folder(0), model.cfg)
    rows = _rows(7)
    with_spec = [p for p, _ in PlainPath(model, TorchKernels(), specialists=spec).answer(rows)]
    assert with_spec == PlainPath(model, TorchKernels()).forward(rows)


# ---- the cached path ---------------------------------------------------------------------------------------------------


class Guesses:
    """A forced guess sequence for `StateCache.guess` (None: the cache's own rule)."""

    def __init__(self, cache: StateCache):
        self.cache, self.own, self.next = cache, cache.guess, None
        cache.guess = self

    def __call__(self, best):
        g, self.next = self.next, None
        return self.own(best) if g is None else g


def ask(cache: StateCache, ids, state_len, slots, nopts, guess=None):
    """cache.row, checked against the plain path with specialists: answer, route, bookkeeping."""
    forcer = cache.guess if isinstance(cache.guess, Guesses) else Guesses(cache)
    forcer.next = guess
    before = cache.stats["mispredict"]
    ans = cache.row(ids, state_len, slots, nopts)
    assert ans is not None
    probs, route = plain_answer(ids, slots, nopts)
    assert ans.route == route
    assert_close(ans.probs, probs)
    if guess is not None:
        assert cache.stats["mispredict"] - before == int(guess != route)
    p = down(state_len)
    assert 0 <= ans.reused <= p and ans.computed >= len(ids) - ans.reused
    assert cache.index.bytes == index_bytes_recount(cache) <= cache.index.budget_bytes
    for c in cache.index.lru_order():  # a checkpoint's feature sum is over its own tokens
        assert c.payload[2].shape == (SHAPE["hidden_size"],)
    return ans


def _wrong(route: int) -> int:
    return (route + 1) % len(ROUTES)


@pytest.mark.parametrize("pad", PADS)
def test_cached_patterns_with_mispredictions(pad):
    _, _, _, spec = world()
    cache = make_cache(pad, spec)
    A = toks(300, 1)
    q = [toks(12 + 3 * k, 100 + k) for k in range(8)]
    # a new state, guessed wrong (the trunk guess of a fresh cache, or forced)
    a0 = ask(cache, A + q[0], 300, [311], [4])
    r0 = a0.route
    assert {c.route for c in cache.index.lru_order()} == {r0}
    # same state: right guess (its checkpoint's route) when the question keeps the route; forced wrong guess
    a1 = ask(cache, A + q[1], 300, [300 + len(q[1]) - 1], [3], guess=_wrong(r0))
    assert a1.path == "hit" or a1.route != r0
    ask(cache, A + q[2], 300, [300 + len(q[2]) - 1], [5], guess=r0)
    # grown state, then a middle change (a new page after the same first 128 tokens)
    G = A + toks(40, 2)
    ask(cache, G + q[3], 340, [340 + len(q[3]) - 1], [4], guess=_wrong(r0))
    M = A[:150] + toks(180, 3)
    am = ask(cache, M + q[4], 330, [330 + len(q[4]) - 1], [4])
    assert am.reused in (0, 128)  # the stride checkpoint at 128, when one of this row's route exists
    assert cache.stats["mispredict"] >= 1
    # every route's checkpoints live side by side: lookups by route find their own
    for c in cache.index.lru_order():
        assert cache.index.lookup(list(c.group.tokens), limit=c.pos, route=c.route) is not None


@pytest.mark.parametrize("host_mb", [0, 4], ids=["one_tier", "host_tier"])
@pytest.mark.parametrize("pad", PADS)
def test_evictions_with_routes(pad, host_mb):
    """A budget of 1 MiB holds a few states: rows of several agents interleaved, guesses forced wrong half the time
    (with a 4 MiB host tier: checkpoints of routes go to the host and come back)."""
    _, _, _, spec = world()
    cache = make_cache(pad, spec, mb=1, host_mb=host_mb)
    states = [toks(260 + 20 * k, 10 + k) for k in range(4)]
    for step in range(10):
        S = states[step % 4]
        qq = toks(10 + step, 200 + step)
        ask(cache, S + qq, len(S), [len(S) + len(qq) - 1], [4], guess=(step % len(ROUTES)) if step % 2 else None)
        assert cache.index.bytes <= cache.index.budget_bytes and cache.index.host_bytes <= cache.index.host_budget_bytes
    assert (cache.stats["evicted"] if host_mb == 0 else cache.index.counts["demoted"]) > 0
    assert (cache.stats["restored_host"] > 0) == (host_mb > 0)


def test_one_graph_serves_every_route(fake_graphs):  # noqa: F811
    """Graph mode (replayed stand-in graphs): rows of different routes and mispredictions reuse the same graphs."""
    _, _, _, spec = world()
    cache = make_cache(True, spec, graphs=True)
    A = toks(300, 5)
    routes = set()
    for k in range(6):
        qq = toks(14, 300 + k)
        routes.add(ask(cache, A + qq, 300, [313], [4], guess=k % len(ROUTES)).route)
    keys = [k for k, g in cache.runner.graphs.items() if g is not None]
    assert len(keys) == len(set(keys)) and all(len(k) == 2 for k in keys)  # keyed by (chunk, span) only
    assert cache.stats["mispredict"] >= 1


@pytest.fixture
def gpu_like_graphs(monkeypatch):
    """Stand-in graphs whose replay, like a CUDA graph's, runs no Python: the captured function re-runs for its
    tensors' effects, then the specialists' host bookkeeping (which route B_fixed holds) is put back as it was."""
    from statecache import graphs as graphs_mod

    _, _, _, spec = world()
    lora = spec.lora

    class Replay:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            seen = lora.fixed_route, lora.fixed_owner
            self.out.copy_(self.fn())
            lora.fixed_route, lora.fixed_owner = seen

    def capture(fn, pool, warmup=2):
        for _ in range(warmup):
            fn()
        out = fn()
        return Replay(fn, out), out

    monkeypatch.setattr(graphs_mod, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_hits_mask_the_adapters_only_when_the_route_changes(gpu_like_graphs, monkeypatch):
    """The chunk runner's graphs do not mask B_fixed: it is masked before a run, outside the graph, only when the
    route differs from the one it holds, so a hit of the same route as the last forward masks nothing (and every
    route's hit does the same host work); the answers stay the plain path's."""
    from statecache.specialists.lora import StackedLora

    _, _, _, spec = world()
    masks = []  # each mask's host-known route (None: known on the device only)
    real = StackedLora.mask_route

    def counted(self, route, owner, known=None):
        masks.append(known)
        real(self, route, owner, known)
    monkeypatch.setattr(StackedLora, "mask_route", counted)
    cache = make_cache(True, spec, graphs=True)
    A = toks(300, 21)
    qs = [toks(14, 400 + k) for k in range(6)]
    for r in (2, 0):
        with router_forced(spec, r):
            cache.clear()
            assert ask(cache, A + qs[0], 300, [313], [4], guess=r).path == "cold"
            del masks[:]  # ask's plain reference masks too (in its own forward)
            probs = [plain_answer(A + q, [313], [4]) for q in qs[1:4]]
            del masks[:]
            for q, (want, route) in zip(qs[1:4], probs):
                ans = cache.row(A + q, 300, [313], [4])
                assert ans.path == "hit" and ans.route == route == r
                assert_close(ans.probs, want)
            assert masks == [r]  # the first hit after the plain reference's forwards; then none
            for q in qs[4:]:
                assert cache.row(A + q, 300, [313], [4]).path == "hit"
            assert masks == [r]


def test_a_lone_plain_graph_between_hits_makes_the_next_hit_mask(gpu_like_graphs):
    """A lone plain row's graph masks B_fixed with its own route inside the replay, unseen by the host: the plain
    path forgets the held route, so the next hit masks its route again instead of reading the plain row's."""
    _, _, model, spec = world()
    cache = make_cache(True, spec, graphs=True)
    lone = PlainPath(model, TorchKernels(), graphs=True, specialists=spec)
    A = toks(300, 22)
    row = toks(40, 23)
    with router_forced(spec, 3):  # the lone row's graph captured now: below it is only replayed
        assert lone.answer([(row, [39], [4])])[0][1] == 3
        assert list(lone.graphs) == [(64, 4)] and lone.graphs[(64, 4)] is not None
    with router_forced(spec, 1):
        want = [plain_answer(A + toks(14, 500 + k), [313], [4]) for k in range(2)]
        assert cache.row(A + toks(14, 499), 300, [313], [4]).route == 1
        ans = cache.row(A + toks(14, 500), 300, [313], [4])
        assert ans.path == "hit" and spec.lora.fixed_route == 1
        assert_close(ans.probs, want[0][0])
    with router_forced(spec, 3):
        assert lone.answer([(row, [39], [4])])[0][1] == 3  # one replay, masking route 3 unseen
    assert spec.lora.fixed_route is None
    with router_forced(spec, 1):
        ans = cache.row(A + toks(14, 501), 300, [313], [4])
        assert ans.path == "hit" and ans.route == 1
        assert_close(ans.probs, want[1][0])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "same", "grow", "middle"]), st.integers(0, 10**6),
                              st.one_of(st.none(), st.integers(0, len(ROUTES) - 1))), min_size=3, max_size=6),
       pad=st.booleans(), mb=st.sampled_from([1, 64]))
def test_random_row_sequences_with_routes(ops, pad, mb):
    _, _, _, spec = world()
    cache = make_cache(pad, spec, mb=mb)
    state = toks(260, 0)
    for op, seed, guess in ops:
        if op == "new":
            state = toks(200 + seed % 120, seed)
        elif op == "grow":
            state = state + toks(10 + seed % 60, seed)
        elif op == "middle":
            cut = 64 + seed % max(1, len(state) - 128)
            state = state[:cut] + toks(len(state) - cut, seed)
        state = state[:500]
        qq = toks(5 + seed % 25, seed + 1)
        n = len(state) + len(qq)
        ask(cache, state + qq, len(state), [n - 1], [2 + seed % 5], guess=guess)


# ---- batched continuations with routes -------------------------------------------------------------------------------


def batch_cache(pad: bool, spec, **settings) -> StateCache:
    from statecache.batch import BatchRunner

    _, _, model, _ = world()
    cache = make_cache(pad, spec, **settings)
    cache.batch = BatchRunner(model, TorchKernels(), max_batch=4, pad=pad, max_pos=1024, specialists=spec)
    return cache


@contextlib.contextmanager
def router_forced(spec, route: int):
    """The router picks `route` for every row while inside (its bias dominates); the plain reference follows."""
    bias = spec.router.bias.clone()
    spec.router.bias[route] = 1e4
    try:
        yield
    finally:
        spec.router.bias.copy_(bias)


@contextlib.contextmanager
def router_by_state(spec, states):
    """The router picks route k for rows whose state is states[k] (their mean feature is nearest that state's;
    a short question does not move it): the weights are the states' centred mean features. The plain reference
    follows."""
    probe = make_cache(False, spec)
    means = []
    for k, S in enumerate(states):
        ask(probe, S + toks(3, 990 + k), len(S), [len(S) + 2], [2])
        c = probe.index.lookup(S, limit=down(len(S)))
        means.append(c.payload[2] / c.pos)
    m = torch.stack(means)
    d = m - m.mean(0)
    weight, bias = spec.router.weight.clone(), spec.router.bias.clone()
    spec.router.weight.zero_()
    spec.router.bias.fill_(-1e4)
    spec.router.weight[: len(states)] = d * 1e3
    spec.router.bias[: len(states)] = -(d * m.mean(0)).sum(-1) * 1e3
    try:
        yield
    finally:
        spec.router.weight.copy_(weight)
        spec.router.bias.copy_(bias)


def check_batched(cache, rows, answers):
    for (ids, state_len, slots, nopts), a in zip(rows, answers):
        assert a is not None
        probs, route = plain_answer(ids, slots, nopts)
        assert a.route == route
        assert_close(a.probs, probs)
        assert 0 <= a.reused <= down(state_len) and a.computed >= len(ids) - a.reused
    assert cache.index.bytes == index_bytes_recount(cache) <= cache.index.budget_bytes
    for c in cache.index.lru_order():
        assert c.payload[2].shape == (SHAPE["hidden_size"],)


def mispredictions(cache, rows) -> int:
    """The rows whose router disagrees with the route of the checkpoint a batched call continues them from."""
    out = 0
    for ids, state_len, slots, nopts in rows:
        best = cache.index.lookup(ids, limit=down(state_len))
        out += best is not None and best.route != plain_answer(ids, slots, nopts)[1]
    return out


@pytest.mark.parametrize("pad", PADS)
def test_batched_rows_of_mixed_routes(pad):
    """Hits and grown states of states planted under different routes run in one batched forward (a route per
    sequence), equal the plain path with specialists; the grown states plant checkpoints whose feature sums let
    later rows continue exactly; a forced misprediction runs again with the router's route."""
    _, _, _, spec = world()
    cache = batch_cache(pad, spec)
    states = [toks(200 + 40 * k, 70 + k) for k in range(4)]
    planted = []
    for k, S in enumerate(states):  # each state planted under the route its router picks, forced apart
        with router_forced(spec, k):
            planted.append(ask(cache, S + toks(9, 80 + k), len(S), [len(S) + 8], [4]).route)
    assert planted == [0, 1, 2, 3]
    grown = states[1] + toks(150, 90)  # 64-aligned end 384 from the checkpoint at 192: more than a piece
    rows = [(S + toks(11 + k, 100 + k), len(S), [len(S) + 10 + k], [3 + k]) for k, S in enumerate(states)]
    rows.append((grown + toks(7, 110), len(grown), [len(grown) + 6, len(grown) + 2], [4, 5]))
    forwards, mis, want = cache.batch.stats["forwards"], cache.stats["mispredict"], mispredictions(cache, rows)
    answers = cache.rows_batched(rows)
    check_batched(cache, rows, answers)
    assert cache.batch.stats["forwards"] > forwards
    assert cache.stats["mispredict"] - mis == want
    # routes by state: every row keeps the route of its checkpoint, several routes in one forward
    fresh = [toks(200 + 30 * k, 140 + k) for k in range(4)]
    with router_by_state(spec, fresh):
        for k, S in enumerate(fresh):
            assert ask(cache, S + toks(9, 145 + k), len(S), [len(S) + 8], [4]).route == k
        rows3 = [(S + toks(20 - 3 * k, 150 + k), len(S), [len(S) + 19 - 3 * k], [2 + k]) for k, S in enumerate(fresh)]
        mis = cache.stats["mispredict"]
        answers = cache.rows_batched(rows3)
        check_batched(cache, rows3, answers)
        assert [a.route for a in answers] == [0, 1, 2, 3] and [a.path for a in answers] == ["hit"] * 4
        assert cache.stats["mispredict"] == mis
    # a state grown by more than a piece, its route kept (no misprediction: the batched run plants): its new
    # checkpoint carries the feature sum over [0, 384) that the one-at-a-time path plants
    grown = states[2] + toks(120, 91)  # 384 from the checkpoint at 256
    with router_forced(spec, 2):
        row = (grown + toks(7, 111), len(grown), [len(grown) + 6], [4])
        mis = cache.stats["mispredict"]
        check_batched(cache, [row], cache.rows_batched([row]))
        assert cache.stats["mispredict"] == mis
    c = cache.index.lookup(grown, limit=down(len(grown)))
    alone = make_cache(pad, spec)
    ask(alone, grown + toks(7, 110), len(grown), [len(grown) + 6], [4])
    c1 = alone.index.lookup(grown, limit=down(len(grown)))
    assert c.pos == c1.pos == 384 and (c.payload[2] - c1.payload[2]).abs().max() <= 1e-3
    # a hit on it equals the plain path
    again = [(grown + toks(13, 120), len(grown), [len(grown) + 12], [4])]
    check_batched(cache, again, cache.rows_batched(again))
    # every row forced to route 2: the other routes' checkpoints mispredict, each runs again with route 2
    with router_forced(spec, 2):
        rows2 = [(S + toks(15, 130 + k), len(S), [len(S) + 14], [4]) for k, S in enumerate(states)]
        mis, want = cache.stats["mispredict"], mispredictions(cache, rows2)
        answers = cache.rows_batched(rows2)
        check_batched(cache, rows2, answers)
        assert [a.route for a in answers] == [2] * 4
        assert want >= 1 and cache.stats["mispredict"] - mis == want
        assert answers[2].path == "hit" and answers[0].computed > len(rows2[0][0]) - answers[0].reused


def test_one_batch_graph_serves_any_mix_of_routes(monkeypatch):
    """Graph mode (stand-in graphs replaying the Triton batch kernels in the interpreter): the routes and sequence
    indices are graph inputs, so graphs captured with empty sequences answer rows of several routes at once."""
    from statecache.batch import BatchRunner
    from tests.triton_interp import batch_graphs_in_interpreter

    batch_graphs_in_interpreter(monkeypatch)
    _, _, model, spec = world()
    cache = make_cache(True, spec)
    runner = BatchRunner(model, TorchKernels(), max_batch=4, graphs=True, triton=True, max_pos=1024, tokens=(64, 128),
                         specialists=spec)
    runner.bk.span_kw = dict(n_splits=1)  # one split: the interpreter runs no combine grid
    cache.batch = runner
    states = [toks(270 + 10 * k, 160 + k) for k in range(3)]
    rows = [(S + toks(6 + 3 * k, 180 + k), len(S), [len(S) + 5 + 3 * k], [3 + k]) for k, S in enumerate(states)]
    with router_by_state(spec, states):  # state k takes route k: one forward of three routes, none mispredicted
        for k, S in enumerate(states):
            assert ask(cache, S + toks(5, 170 + k), len(S), [len(S) + 4], [4]).route == k
        mis = cache.stats["mispredict"]
        answers = cache.rows_batched(rows)
        check_batched(cache, rows, answers)
        assert [a.route for a in answers] == [0, 1, 2] and [a.path for a in answers] == ["hit"] * 3
        assert cache.stats["mispredict"] == mis
    with router_forced(spec, 2):  # every row forced to route 2: the others mispredict and run again
        check_batched(cache, rows, cache.rows_batched(rows))
    replayed = [k for k, g in runner.graphs.items() if g is not None and g.graph.replays]
    assert replayed and all(k[0] <= 4 for k in replayed) and runner.stats["forwards"] >= 2


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_batched_mixes_with_routes(data):
    """Agents whose states repeat, grow or are new, each round batched where rows continue from saved states and
    one at a time otherwise (as the engine does), a small budget evicting between rounds; every answer equals the
    plain path with specialists."""
    _, _, _, spec = world()
    cache = batch_cache(data.draw(st.booleans()), spec, mb=data.draw(st.sampled_from([1, 64])))
    states = [toks(data.draw(st.integers(200, 300)), 400 + a) for a in range(3)]
    seed = 0
    for _ in range(data.draw(st.integers(2, 3))):
        rows = []
        for a in range(3):
            seed += 1
            what = data.draw(st.sampled_from(["same", "grow", "new"]))
            if what == "grow":
                states[a] = (states[a] + toks(data.draw(st.integers(1, 140)), 500 + seed))[-480:]
            elif what == "new":
                states[a] = toks(data.draw(st.integers(200, 300)), 600 + seed)
            S = states[a]
            q = toks(data.draw(st.integers(2, 30)), 700 + seed)
            rows.append((S + q, len(S), [len(S) + len(q) - 1], [2 + seed % 5]))
        forced = data.draw(st.one_of(st.none(), st.integers(0, len(ROUTES) - 1)))
        with router_forced(spec, forced) if forced is not None else contextlib.nullcontext():
            answers = cache.rows_batched(rows)
            for row, a in zip(rows, answers):
                if a is None:  # no checkpoint to continue from: one at a time, as the engine does
                    a = ask(cache, *row)
                check_batched(cache, [row], [a])


# ---- the engine, the CLI, bad folders ----------------------------------------------------------------------------------


def test_engine_and_score_report_routes(monkeypatch, capsys):
    from statecache.cli import main
    from statecache.engine import Engine
    from statecache.tiny import tiny_model_dir, tiny_specialists_dir

    sd = tiny_specialists_dir()
    names = json.loads((sd / "router.json").read_text())["routes"]
    assert len(names) == 3
    S = toks(300, 41)
    rows = [{"ids": S + toks(10 + k, 50 + k), "state_len": 300, "slots": [309 + k], "nopts": [4]} for k in range(4)]
    rows.append({"ids": toks(40, 60), "state_len": 30, "slots": [39], "nopts": [3]})  # plain path
    eng = Engine(tiny_model_dir(), "cpu", "float32", specialists=sd)
    ref = SpecReference(tiny_model_dir(), sd, eng.letter_ids)
    res = eng.answer(rows)
    for r, out in zip(rows, res):
        want_r, want = ref.answers(r["ids"], r["slots"], r["nopts"])
        assert out["route"] == names[want_r] and max_abs_diff(out["probs"], want) <= TOL
    assert [x["path"] for x in res] == ["cold", "hit", "hit", "hit", "plain"]
    assert eng.answer(rows[:1])[0]["route"] == res[0]["route"]  # the memo keeps the route
    # the state's later rows continue from it in the step loop's packed forwards, each with its checkpoint's route
    more = [{"ids": S + toks(12 + k, 70 + k), "state_len": 300, "slots": [311 + k], "nopts": [3]} for k in range(3)]
    stepped = eng.phases["step_rows"]
    for r, out in zip(more, eng.answer(more)):
        want_r, want = ref.answers(r["ids"], r["slots"], r["nopts"])
        assert out["route"] == names[want_r] and max_abs_diff(out["probs"], want) <= TOL
    assert eng.phases["step_rows"] - stepped == 3
    assert eng.phases["batched_rows"] == eng.phases["packed_rows"] == eng.phases["one_by_one_rows"] == 0
    assert "mispredict" in eng.stats() and eng.stats()["specialists"]["routes"] == names
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(json.dumps(r) for r in rows[:2]) + "\n"))
    assert main(["score", "--device", "cpu", "--dtype", "float32", "--specialists", str(sd)]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [o["route"] for o in out] == [x["route"] for x in res[:2]]


def _copy(tmp_path) -> Path:
    _, sd, _, _ = world()
    d = tmp_path / "spec"
    shutil.copytree(sd, d)
    return d


def _edit_json(path: Path, **kw):
    raw = json.loads(path.read_text())
    raw.update(kw)
    path.write_text(json.dumps(raw))


def _edit_weights(path: Path, fn):
    save_file(fn(load_file(str(path))), str(path))


def _rename_key(old: str, new: str):
    def fn(sd):
        return {(k.replace(old, new)): v for k, v in sd.items()}
    return fn


BAD = {
    "missing_router": (lambda d: (d / "router.json").unlink(), "no router.json"),
    "missing_router_weights": (lambda d: (d / "router.safetensors").unlink(), "no router.safetensors"),
    "router_not_json": (lambda d: (d / "router.json").write_text("{"), "not valid JSON"),
    "router_layer_out_of_range": (lambda d: _edit_json(d / "router.json", router_layer=9), "router_layer must be"),
    "one_route": (lambda d: _edit_json(d / "router.json", routes=["trunk"]), "at least two names"),
    "names_clash": (lambda d: _edit_json(d / "router.json", routes=["trunk", "alpha", "Alpha", "gamma"]),
                    "route names clash"),
    "router_shape": (lambda d: _edit_weights(d / "router.safetensors", lambda sd: {**sd, "weight": sd["weight"][:, :10].contiguous()}),
                     "weight is (4, 10), expected (4, 64)"),
    "bias_missing": (lambda d: _edit_weights(d / "router.safetensors", lambda sd: {"weight": sd["weight"]}),
                     "needs tensors 'weight' and 'bias'"),
    "adapter_folder_missing": (lambda d: shutil.rmtree(d / "beta"), "route 'beta' has no adapter folder"),
    "adapter_weights_missing": (lambda d: (d / "gamma" / "adapter_model.safetensors").unlink(),
                                "missing adapter_model.safetensors"),
    "module_missing": (lambda d: _edit_weights(d / "gamma" / "adapter_model.safetensors",
                                               _rename_key("layers.3.self_attn.k_proj", "layers.2.self_attn.k_proj")),
                       "no such projection in layer 2 (linear_attention)"),
    "not_a_projection": (lambda d: _edit_weights(d / "gamma" / "adapter_model.safetensors",
                                                 _rename_key("mlp.gate_proj", "mlp.gate_thing")), "no such projection"),
    "below_router_layer": (lambda d: _edit_json(d / "router.json", router_layer=2), "below router_layer 2"),
    "wrong_lora_shape": (lambda d: _edit_weights(d / "alpha" / "adapter_model.safetensors",
                                                 lambda sd: {k: (v[:, :5].contiguous() if ".layers.2.mlp.down_proj.lora_A" in k else v)
                                                             for k, v in sd.items()}), "do not fit the projection"),
    "lone_lora_A": (lambda d: _edit_weights(d / "alpha" / "adapter_model.safetensors",
                                            lambda sd: {k: v for k, v in sd.items() if "layers.2.mlp.up_proj.lora_B" not in k}),
                    "has lora_A without its pair"),
    "rank_mismatch": (lambda d: _edit_json(d / "gamma" / "adapter_config.json", r=5), "rank 2 but adapter_config.json says r = 5"),
    "dora": (lambda d: _edit_json(d / "gamma" / "adapter_config.json", use_dora=True), "unsupported LoRA options"),
    "not_lora": (lambda d: _edit_json(d / "gamma" / "adapter_config.json", peft_type="IA3"), "only LoRA adapters"),
    "trunk_with_adapter": (lambda d: shutil.copytree(d / "alpha", d / "trunk"), "route 0 ('trunk') is the trunk"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_folders_fail_clearly(tmp_path, case):
    _, _, model, _ = world()
    d = _copy(tmp_path)
    spoil, message = BAD[case]
    spoil(d)
    with pytest.raises(SpecialistsError, match="specialists") as e:
        load_specialists(d, model.cfg)
    assert message in str(e.value)


def test_engine_refuses_a_bad_folder_at_start_up(tmp_path, monkeypatch, capsys):
    from statecache.cli import main
    from statecache.engine import Engine

    d = tmp_path / "nothing"
    d.mkdir()
    with pytest.raises(SpecialistsError, match="no router.json"):
        Engine(None, "cpu", "float32", specialists=d)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["score", "--device", "cpu", "--specialists", str(d)]) == 2
    assert "no router.json" in capsys.readouterr().err


def test_token_routes_equal_fixed_routes_per_row():
    """Two rows of different routes packed in one forward with a per-token route index (batched hits' form) equal
    each row run alone with its route fixed."""
    from statecache.mixers import PackedMixer
    from statecache.specialists import FixedRoute, TokenRoutes

    _, _, model, spec = world()
    k = TorchKernels()
    a, b = toks(50, 1), toks(37, 2)
    alone = []
    for ids, r in ((a, 1), (b, 3)):
        n = len(ids)
        mix = PackedMixer(k, torch.tensor([0, n], dtype=torch.int32), n)
        alone.append(model.body(torch.tensor(ids), torch.arange(n), mix, FixedRoute(spec.lora, spec.router, torch.tensor([r]))))
    n = len(a) + len(b)
    mix = PackedMixer(k, torch.tensor([0, len(a), n], dtype=torch.int32), len(a))
    tok = torch.tensor([1] * len(a) + [3] * len(b))
    both = model.body(torch.tensor(a + b), torch.cat([torch.arange(len(a)), torch.arange(len(b))]), mix,
                      TokenRoutes(spec.lora, spec.router, tok))
    assert (both - torch.cat(alone)).abs().max() <= 1e-4
    trunk = model.body(torch.tensor(a), torch.arange(len(a)), PackedMixer(k, torch.tensor([0, len(a)], dtype=torch.int32), len(a)))
    assert (trunk - alone[0]).abs().max() > 1e-3  # the adapter does something


def test_an_adapter_folder_that_is_no_route_is_reported(tmp_path, caplog):
    _, _, model, _ = world()
    d = _copy(tmp_path)
    shutil.copytree(d / "beta", d / "delta")
    with caplog.at_level("WARNING", logger="statecache.specialists"):
        spec = load_specialists(d, model.cfg)
    assert spec.names == list(ROUTES)
    assert "['delta'] are not routes" in caplog.text


# ---- the projection path: adapters folded into the projections ------------------------------------------------------


def _peft_site(ref: SpecReference, cfg, i: int, site: str, x: torch.Tensor, route: int) -> torch.Tensor:
    """peft's own output of one fused site: its modules' forwards (LoRA layers of the reference PeftModel with the
    route's adapter active, adapters disabled for the trunk) concatenated in the fused row order."""
    from statecache.specialists import site_modules

    block, mods, _ = site_modules(cfg, i)[site]
    layer = ref.pm.get_submodule(f"base_model.model.model.layers.{i}.{block}")
    with torch.no_grad():
        if route == 0:
            with ref.pm.disable_adapter():
                return torch.cat([getattr(layer, m)(x) for m, _ in mods], -1)
        ref.pm.set_adapter(ref.names[route])
        return torch.cat([getattr(layer, m)(x) for m, _ in mods], -1)


def test_projections_equal_peft_per_site_and_route():
    """Every adapted site (and an unadapted one) through the folded projection: FixedRoute for each route, and
    TokenRoutes with a random route per token, equal peft's LoRA layers with that route's adapter (1e-5)."""
    from statecache.specialists import FixedRoute, TokenRoutes

    _, _, model, spec = world()
    ref = reference_model()
    cfg = model.cfg
    spec.lora.attach(model.w)
    g = torch.Generator().manual_seed(11)
    keys = sorted(spec.lora.layout) + [(0, "in"), (0, "down")]  # layer 0 sits below the router: no adapter
    assert (0, "in") not in spec.lora.layout
    tok = torch.randint(0, len(ROUTES), (9,), generator=g)
    for i, site in keys:
        W = spec.lora.weight(model.w, (i, site))
        x = torch.randn(9, W.shape[1], generator=g)
        want = torch.stack([_peft_site(ref, cfg, i, site, x, r) for r in range(len(ROUTES))])  # [R, T, out]
        for r in range(len(ROUTES)):
            got = FixedRoute(spec.lora, spec.router, torch.tensor([r])).project(i, site, x, W)
            assert (got - want[r]).abs().max() <= 1e-5, (i, site, r)
        mixed = TokenRoutes(spec.lora, spec.router, tok).project(i, site, x, W)
        assert (mixed - want[tok, torch.arange(9)]).abs().max() <= 1e-5, (i, site)
    # the adapters differ by route where they act (else the test shows little)
    W = spec.lora.weight(model.w, (3, "gate_up"))
    x = torch.randn(4, W.shape[1], generator=g)
    outs = [FixedRoute(spec.lora, spec.router, torch.tensor([r])).project(3, "gate_up", x, W) for r in (0, 1, 3)]
    assert (outs[0] - outs[1]).abs().max() > 1e-3 and (outs[1] - outs[2]).abs().max() > 1e-3


def _ops(fn) -> list[str]:
    """The non-view aten ops fn runs (each a kernel on the GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_projection_kernels_per_site():
    """The work per site: a fixed route costs one GEMM with the extended weight and one addmm (its route masked once
    per forward: a comparison and one multiply per block size; none with an owner, which holds the route masked
    itself: the chunk runner); token routes one mask more; no adapter: one GEMM."""
    from statecache.specialists import FixedRoute, TokenRoutes

    _, _, model, spec = world()
    spec.lora.attach(model.w)
    lora = spec.lora
    route = torch.tensor([2])
    assert _ops(lambda: FixedRoute(lora, spec.router, route)) == ["eq"] + ["mul"] * len(lora.B_src)
    assert _ops(lambda: FixedRoute(lora, spec.router, route, owner=object())) == []
    owner = object()
    assert _ops(lambda: lora.hold_route(2, route, owner)) == ["eq"] + ["mul"] * len(lora.B_src)
    assert _ops(lambda: lora.hold_route(2, route, owner)) == [] and lora.fixed_owner is owner  # held already
    held = FixedRoute(lora, spec.router, route, owner=owner)
    W = lora.weight(model.w, (3, "gate_up"))
    x = torch.randn(5, W.shape[1])
    got = held.project(3, "gate_up", x, W)
    assert torch.equal(got, FixedRoute(lora, spec.router, route).project(3, "gate_up", x, W))
    with pytest.raises(RuntimeError, match="rewritten"):  # the plain binding just masked: not the owner's any more
        held.project(3, "gate_up", x, W)
    fixed = FixedRoute(lora, spec.router, route)
    tokens = TokenRoutes(lora, spec.router, torch.tensor([0, 1, 2, 3, 1]))
    for key in lora.layout:
        W = lora.weight(model.w, key)
        x = torch.randn(5, W.shape[1])
        assert _ops(lambda: fixed.project(*key, x, W)) == ["mm", "addmm_"], key
        assert _ops(lambda: tokens.project(*key, x, W)) == ["mm", "mul", "addmm_"], key
    W = lora.weight(model.w, (0, "gate_up"))
    x = torch.randn(5, W.shape[1])
    assert _ops(lambda: fixed.project(0, "gate_up", x, W)) == ["mm"]


def test_attach_folds_the_adapters_into_the_weights():
    """attach keeps W's values and memory (W is the first rows of its extended weight, which holds every adapter
    route's A), is a no-op the second time, refuses mismatched weights before changing any, and projections refuse
    weights that are not attached or a fixed route another binding has since overwritten."""
    from statecache.specialists import FixedRoute

    md, sd, _, _ = world()
    spec = load_specialists(sd, load_config(md))
    weights = load_weights(md, LETTER_IDS, "cpu", torch.float32)
    key = (1, "in")
    before = spec.lora.weight(weights, key).clone()
    x = torch.randn(3, before.shape[1])
    with pytest.raises(RuntimeError, match="attach"):
        FixedRoute(spec.lora, spec.router, torch.tensor([1])).project(*key, x, spec.lora.weight(weights, key))
    bf16 = load_weights(md, LETTER_IDS, "cpu", torch.bfloat16)
    ptrs = {k: spec.lora.weight(bf16, k).data_ptr() for k in spec.lora.layout}
    with pytest.raises(ValueError, match="bfloat16"):
        spec.lora.attach(bf16)
    assert ptrs == {k: spec.lora.weight(bf16, k).data_ptr() for k in spec.lora.layout}  # nothing changed
    spec.lora.attach(weights)
    W = spec.lora.weight(weights, key)
    W_ext = spec.lora.extended(key, W)
    lay = spec.lora.layout[key]
    assert torch.equal(W, before) and W.data_ptr() == W_ext.data_ptr() and W.is_contiguous()
    assert W_ext.shape == (lay.out + (len(ROUTES) - 1) * lay.rb, lay.fin)
    spec.lora.attach(weights)
    assert spec.lora.extended(key, spec.lora.weight(weights, key)) is W_ext  # no rebuild
    other = load_specialists(sd, load_config(md))  # another StackedLora taking the same weights over
    other.lora.attach(weights)
    assert not spec.lora.attached(weights) and other.lora.attached(weights) and not spec.lora._ext
    assert torch.equal(spec.lora.weight(weights, key), before)
    spec.lora.attach(weights)
    assert not other.lora._ext
    W = spec.lora.weight(weights, key)
    first = FixedRoute(spec.lora, spec.router, torch.tensor([1]))
    FixedRoute(spec.lora, spec.router, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="rewritten"):
        first.project(*key, x, W)
