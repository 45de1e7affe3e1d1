"""Specialists (routed LoRA adapters) on the CPU in float32, through the step loop (statecache.step over the batched
runner: a route per row, guessed, then run again with the router's route where it disagrees).

- The step loop's uncached forward with every route equals transformers' Qwen3.5 with peft (`PeftModel`, the trunk
  with adapters disabled) within 1e-4, and the route picked equals the one computed from transformers' hidden states
  (tests.spec_util); both checkpoint layouts (causal and conditional keys), ranks, alphas, rsLoRA,
  layers_to_transform varied. Each fused projection (`TokenRoutes`) equals peft's LoRA layers per site and route.
- Cached rows equal the uncached step loop (itself checked against peft) across same state, grown state, middle
  change and evictions (one tier and a host tier), with mispredictions forced; rows of several routes in one packed
  forward, also through replayed batch graphs (one graph for any mix of routes); property-based runs over random row
  sequences with routes.
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

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from statecache.cache.store import Answer, StateCache
from statecache.dev.checkpoints import make_checkpoint
from statecache.dev.specialists import make_specialists, write_router
from statecache.kernels.dispatch import TorchKernels
from statecache.model.config import load_config
from statecache.model.forward import Qwen35
from statecache.model.loader import load_weights
from statecache.model.specialists import SpecialistsError, TokenRoutes, load_specialists
from statecache.run.batch import BatchRunner, Piece
from statecache.step import Steps
from tests.cache_util import (LETTER_IDS, MAX_POS, SHAPE, TOL, assert_close, index_bytes_recount, one_thread,
                              make_steps, run_rows, toks)
from tests.oracle_util import build_checkpoint, max_abs_diff
from tests.oracle_util import LETTERS as ORACLE_LETTERS
from tests.spec_util import SpecReference

PADS = [pytest.param(False, id="exact"), pytest.param(True, id="padded")]  # the batched runner's shapes bucketed
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


@functools.lru_cache(maxsize=None)
def forced_spec(route: int):
    _, _, model, _ = world()
    return load_specialists(forced_folder(route), model.cfg)


@functools.lru_cache(maxsize=None)
def runner(pad: bool = False, route: int | None = None) -> BatchRunner:
    """The batched runner over the small model with the folder's specialists (`route`: the copy whose router always
    picks it); eager; one per kind is enough: it keeps nothing between forwards."""
    _, _, model, spec = world()
    return BatchRunner(model, TorchKernels(), max_slots=4, max_batch=8, max_pos=MAX_POS, pad=pad,
                       specialists=spec if route is None else forced_spec(route))


def fits(ctx) -> bool:
    """Plant every state that fits the device budget (the default policy declines states over half of it: at 1 MiB
    that is every state here)."""
    return ctx.state_bytes <= ctx.budget_bytes


def steps_over(r: BatchRunner, cold_ok=None, **settings) -> Steps:
    """tests.cache_util.make_steps over runner `r`."""
    return make_steps(cold_ok, runner=r, **settings)


def spec_steps(pad: bool = False, route: int | None = None, cold_ok=None, **settings) -> Steps:
    return steps_over(runner(pad, route), cold_ok, **settings)


@functools.lru_cache(maxsize=1)
def _uncached_steps() -> Steps:
    """The reference's step loop: a runner of its own (the tests count the forwards of theirs)."""
    _, _, model, spec = world()
    return steps_over(BatchRunner(model, TorchKernels(), max_slots=4, max_batch=8, max_pos=MAX_POS, specialists=spec),
                      mb=0)


def uncached(ids, slots, nopts) -> tuple[list[list[float]], int]:
    """(probs, route) of the row run from nothing through the step loop with the folder's specialists, no cache (the
    router as it is now: tests below force it); checked against peft by the tests of the first section."""
    a = run_rows(_uncached_steps(), [(ids, 0, slots, nopts)], fresh=True)[0]
    assert isinstance(a, Answer), a
    return a.probs, a.route


@contextlib.contextmanager
def forwards_seen(r: BatchRunner):
    """Records the routes of each packed forward `r` runs while inside (a list of tuples, one per forward)."""
    seen: list[tuple] = []
    real = r.forward

    def forward(pieces):
        seen.append(tuple(pc.route for pc in pieces))
        return real(pieces)

    r.forward = forward
    try:
        yield seen
    finally:
        del r.forward


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
    """The router forced to each route in turn: uncached rows packed in one forward, a row alone in a padded forward,
    and a cached row (cold, then a hit) equal PeftModel's with that route's adapter (the trunk: adapters disabled)."""
    ref = reference_model()
    rows = _rows(10 * route)
    with forwards_seen(runner(False, route)) as seen:
        packed = run_rows(spec_steps(route=route, mb=0), [(ids, 0, s, n) for ids, s, n in rows], fresh=True)
    # the four rows in one forward, guessed the trunk (a fresh cache's guess), then again with the router's route
    assert seen == [(0,) * len(rows)] + ([(route,) * len(rows)] if route else [])
    single = run_rows(spec_steps(True, route, mb=0), [(rows[0][0], 0, rows[0][1], rows[0][2])], fresh=True)
    for (ids, slots, nopts), a in zip(rows, packed):
        _, want = ref.answers(ids, slots, nopts, route=route)
        assert a.route == route and a.path == "plain"
        assert max_abs_diff(a.probs, want) <= TOL
    assert single[0].route == route and max_abs_diff(single[0].probs, packed[0].probs) <= TOL
    steps = spec_steps(route=route)
    S = toks(200, 99)
    for q, path in ((toks(30, route), "cold"), (toks(25, 50 + route), "hit")):
        ids = S + q
        ans = run_rows(steps, [(ids, 200, [len(ids) - 1], [5])])[0]
        assert ans.route == route and ans.path == path
        assert max_abs_diff(ans.probs, ref.answers(ids, [len(ids) - 1], [5], route=route)[1]) <= TOL


def test_router_picks_the_references_route():
    """The folder's own router over rows of random tokens, run uncached together (each guessed, run again where the
    router disagrees): the route (and answer) equal the reference's, and the rows do not all take one route (else
    this test would show little)."""
    ref = reference_model()
    rows = _rows(500, k=10)
    got = run_rows(spec_steps(mb=0), [(ids, 0, s, n) for ids, s, n in rows], fresh=True)
    seen = set()
    for (ids, slots, nopts), a in zip(rows, got):
        want_r, want = ref.answers(ids, slots, nopts)
        assert a.route == want_r
        assert max_abs_diff(a.probs, want) <= TOL
        seen.add(a.route)
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
    r = BatchRunner(model, TorchKernels(), max_slots=4, max_batch=4, max_pos=MAX_POS, specialists=spec)
    got = run_rows(steps_over(r, mb=0), [(ids, 0, s, n) for ids, s, n in rows], fresh=True)
    for (ids, slots, nopts), a in zip(rows, got):
        want_r, want = ref.answers(ids, slots, nopts)
        assert a.route == want_r and max_abs_diff(a.probs, want) <= TOL


def test_trunk_is_exactly_the_model_without_specialists():
    """Route 0 adds exact zeros: answers equal the forward without specialists bit for bit."""
    _, _, model, _ = world()
    rows = [(ids, 0, s, n) for ids, s, n in _rows(7)]
    with_spec = run_rows(spec_steps(route=0, mb=0), rows, fresh=True)
    assert all(a.route == 0 for a in with_spec)
    trunk = BatchRunner(model, TorchKernels(), max_slots=4, max_batch=8, max_pos=MAX_POS)
    without = run_rows(steps_over(trunk, mb=0), rows, fresh=True)
    assert [a.probs for a in with_spec] == [a.probs for a in without]


# ---- the cached path ---------------------------------------------------------------------------------------------------


class Guesses:
    """A forced guess for `StateCache.guess` (None: the cache's own rule)."""

    def __init__(self, cache: StateCache):
        self.cache, self.own, self.next = cache, cache.guess, None
        cache.guess = self

    def __call__(self, best):
        g, self.next = self.next, None
        return self.own(best) if g is None else g


def check(steps: Steps, rows, answers) -> None:
    """Each answer equals the uncached step loop's (answer and route), its bookkeeping sound; the cache's bytes
    recount and within budget; every checkpoint carries a feature sum."""
    cache = steps.cache
    for (ids, state_len, slots, nopts), a in zip(rows, answers):
        assert isinstance(a, Answer), a
        probs, route = uncached(ids, slots, nopts)
        assert a.route == route
        assert_close(a.probs, probs)
        assert 0 <= a.reused <= state_len and a.computed >= len(ids) - a.reused
    assert cache.index.bytes == index_bytes_recount(cache) <= cache.index.budget_bytes
    for c in cache.index.lru_order():  # a checkpoint's feature sum is over its own tokens
        assert c.payload[2].shape == (SHAPE["hidden_size"],)


def ask(steps: Steps, ids, state_len, slots, nopts, guess=None) -> Answer:
    """One row through the cached step loop with its first guess forced (None: the cache's own), checked against the
    uncached step loop: answer, route, bookkeeping (a wrong forced guess is exactly one misprediction)."""
    cache = steps.cache
    forcer = cache.guess if isinstance(cache.guess, Guesses) else Guesses(cache)
    forcer.next = guess
    before = cache.stats["mispredict"]
    ans = run_rows(steps, [(ids, state_len, slots, nopts)])[0]
    forcer.next = None
    check(steps, [(ids, state_len, slots, nopts)], [ans])
    if guess is not None:
        assert cache.stats["mispredict"] - before == int(guess != ans.route)
    return ans


def _wrong(route: int) -> int:
    return (route + 1) % len(ROUTES)


@pytest.mark.parametrize("pad", PADS)
def test_cached_patterns_with_mispredictions(pad):
    steps = spec_steps(pad)
    cache = steps.cache
    A = toks(300, 1)
    q = [toks(12 + 3 * k, 100 + k) for k in range(8)]
    # a new state, guessed the trunk (a fresh cache's guess): a misprediction runs again with the router's route,
    # the first run's checkpoints kept under the trunk
    a0 = ask(steps, A + q[0], 300, [311], [4])
    r0 = a0.route
    assert {c.route for c in cache.index.lru_order()} == {0, r0}
    # same state: right guess (its checkpoint's route) when the question keeps the route; forced wrong guess
    a1 = ask(steps, A + q[1], 300, [300 + len(q[1]) - 1], [3], guess=_wrong(r0))
    assert a1.path == "hit" or a1.route != r0
    ask(steps, A + q[2], 300, [300 + len(q[2]) - 1], [5], guess=r0)
    # grown state, then a middle change (a new page after the same first 128 tokens)
    G = A + toks(40, 2)
    ask(steps, G + q[3], 340, [340 + len(q[3]) - 1], [4], guess=_wrong(r0))
    M = A[:150] + toks(180, 3)
    am = ask(steps, M + q[4], 330, [330 + len(q[4]) - 1], [4])
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
    steps = spec_steps(pad, cold_ok=fits, mb=1, host_mb=host_mb)
    cache = steps.cache
    states = [toks(260 + 20 * k, 10 + k) for k in range(4)]
    for step in range(10):
        S = states[step % 4]
        qq = toks(10 + step, 200 + step)
        ask(steps, S + qq, len(S), [len(S) + len(qq) - 1], [4], guess=(step % len(ROUTES)) if step % 2 else None)
        assert cache.index.bytes <= cache.index.budget_bytes and cache.index.host_bytes <= cache.index.host_budget_bytes
    assert (cache.stats["evicted"] if host_mb == 0 else cache.index.counts["demoted"]) > 0
    assert (cache.stats["restored_host"] > 0) == (host_mb > 0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "same", "grow", "middle"]), st.integers(0, 10**6),
                              st.one_of(st.none(), st.integers(0, len(ROUTES) - 1))), min_size=3, max_size=6),
       pad=st.booleans(), mb=st.sampled_from([1, 64]))
def test_random_row_sequences_with_routes(ops, pad, mb):
    steps = spec_steps(pad, cold_ok=fits, mb=mb)
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
        ask(steps, state + qq, len(state), [n - 1], [2 + seed % 5], guess=guess)


# ---- rows of several routes in one step ------------------------------------------------------------------------------


@contextlib.contextmanager
def router_forced(spec, route: int):
    """The router picks `route` for every row while inside (its bias dominates); the uncached reference follows."""
    bias = spec.router.bias.clone()
    spec.router.bias[route] = 1e4
    try:
        yield
    finally:
        spec.router.bias.copy_(bias)


@contextlib.contextmanager
def router_by_state(spec, states):
    """The router picks route k for rows whose state is states[k] (their mean feature is nearest that state's;
    a short question does not move it): the weights are the states' centred mean features. The uncached reference
    follows."""
    probe = spec_steps()
    means = []
    for k, S in enumerate(states):
        ask(probe, S + toks(3, 990 + k), len(S), [len(S) + 2], [2])
        c = probe.cache.index.lookup(S, limit=len(S))
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


def guessed(steps: Steps, rows) -> list[int]:
    """The route each row's first run takes when the rows are added together now: its deepest checkpoint's (any
    route), else the last answered row's (StateCache.guess)."""
    cache = steps.cache
    out = []
    for ids, state_len, _, _ in rows:
        best = cache.index.lookup(ids, limit=cache.state_end(state_len))
        out.append(cache.guess(best))
    return out


def mispredictions(steps: Steps, rows) -> int:
    """The rows whose router disagrees with the route their first run takes."""
    return sum(g != uncached(ids, slots, nopts)[1] for g, (ids, _, slots, nopts) in zip(guessed(steps, rows), rows))


def stepped(steps: Steps, rows) -> tuple[list[Answer], list[tuple]]:
    """Rows added together and stepped to their end, checked against the uncached step loop -> (their answers, the
    routes of each packed forward they ran in)."""
    with forwards_seen(steps.runner) as seen:
        answers = run_rows(steps, rows)
    check(steps, rows, answers)
    return answers, seen


@pytest.mark.parametrize("pad", PADS)
def test_rows_of_mixed_routes_in_one_forward(pad):
    """Hits and grown states of states planted under different routes run in one packed forward (a route per
    sequence), equal the uncached step loop; the grown states plant checkpoints whose feature sums let later rows
    continue exactly; a misprediction runs again with the router's route."""
    _, _, _, spec = world()
    steps = spec_steps(pad)
    cache = steps.cache
    states = [toks(200 + 40 * k, 70 + k) for k in range(4)]
    planted = []
    for k, S in enumerate(states):  # each state planted under the route its router picks, forced apart
        with router_forced(spec, k):
            planted.append(ask(steps, S + toks(9, 80 + k), len(S), [len(S) + 8], [4]).route)
    assert planted == [0, 1, 2, 3]
    grown = states[1] + toks(150, 90)  # 64-aligned end 384 from the checkpoint at 192: more than a piece
    rows = [(S + toks(11 + k, 100 + k), len(S), [len(S) + 10 + k], [3 + k]) for k, S in enumerate(states)]
    rows.append((grown + toks(7, 110), len(grown), [len(grown) + 6, len(grown) + 2], [4, 5]))
    mis, want, first = cache.stats["mispredict"], mispredictions(steps, rows), guessed(steps, rows)
    _, seen = stepped(steps, rows)
    assert cache.stats["mispredict"] - mis == want
    assert len(set(first)) >= 2 and any(len(set(f)) >= 2 for f in seen)  # several routes in one forward
    # routes by state: every row keeps the route of its checkpoint, four routes in one forward
    fresh = [toks(200 + 30 * k, 140 + k) for k in range(4)]
    with router_by_state(spec, fresh):
        for k, S in enumerate(fresh):
            assert ask(steps, S + toks(9, 145 + k), len(S), [len(S) + 8], [4], guess=k).route == k
        rows3 = [(S + toks(20 - 3 * k, 150 + k), len(S), [len(S) + 19 - 3 * k], [2 + k]) for k, S in enumerate(fresh)]
        mis = cache.stats["mispredict"]
        answers, seen = stepped(steps, rows3)
        assert [a.route for a in answers] == [0, 1, 2, 3] and [a.path for a in answers] == ["hit"] * 4
        assert cache.stats["mispredict"] == mis
        assert seen == [(0, 1, 2, 3)]  # one forward, a route per sequence
    # a state grown by more than a piece, its route kept (no misprediction): its new checkpoint carries the feature
    # sum over [0, 400) that a row planting it alone plants
    grown = states[2] + toks(120, 91)  # 400 from the checkpoint at 280
    with router_forced(spec, 2):
        row = (grown + toks(7, 111), len(grown), [len(grown) + 6], [4])
        mis = cache.stats["mispredict"]
        stepped(steps, [row])
        assert cache.stats["mispredict"] == mis
    c = cache.index.lookup(grown, limit=len(grown), route=2)
    alone = spec_steps(pad)
    with router_forced(spec, 2):
        ask(alone, grown + toks(7, 110), len(grown), [len(grown) + 6], [4], guess=2)
    c1 = alone.cache.index.lookup(grown, limit=len(grown), route=2)
    assert c.pos == c1.pos == 400 and (c.payload[2] - c1.payload[2]).abs().max() <= 1e-3
    # a hit on it equals the uncached step loop
    with router_forced(spec, 2):
        assert stepped(steps, [(grown + toks(13, 120), len(grown), [len(grown) + 12], [4])])[0][0].path == "hit"
    # every row forced to route 2: the rows guessing another route mispredict, each runs again with route 2
    with router_forced(spec, 2):
        rows2 = [(S + toks(15, 130 + k), len(S), [len(S) + 14], [4]) for k, S in enumerate(states)]
        first = guessed(steps, rows2)
        mis, want = cache.stats["mispredict"], mispredictions(steps, rows2)
        answers, _ = stepped(steps, rows2)
        assert [a.route for a in answers] == [2] * 4
        assert want == sum(g != 2 for g in first) >= 1 and cache.stats["mispredict"] - mis == want
        for g, (ids, _, _, _), a in zip(first, rows2, answers):
            if g != 2:  # both runs' tokens counted
                assert a.computed > len(ids) - a.reused


def test_one_batch_graph_serves_any_mix_of_routes(monkeypatch):
    """Graph mode (stand-in graphs replaying the Triton batch kernels in the interpreter): the routes and sequence
    indices are graph inputs, so graphs captured with empty sequences answer rows of several routes at once."""
    from tests.triton_interp import batch_graphs_in_interpreter

    batch_graphs_in_interpreter(monkeypatch)
    _, _, model, spec = world()
    r = BatchRunner(model, TorchKernels(), max_slots=4, max_batch=4, graphs=True, triton=True, max_pos=MAX_POS,
                    tokens=(64, 128), max_piece=128, specialists=spec)
    steps = steps_over(r)
    states = [toks(270 + 10 * k, 160 + k) for k in range(3)]
    rows = [(S + toks(6 + 3 * k, 180 + k), len(S), [len(S) + 5 + 3 * k], [3 + k]) for k, S in enumerate(states)]
    with router_by_state(spec, states):  # state k takes route k: one forward of three routes, none mispredicted
        for k, S in enumerate(states):
            assert ask(steps, S + toks(5, 170 + k), len(S), [len(S) + 4], [4], guess=k).route == k
        mis = steps.cache.stats["mispredict"]
        answers, seen = stepped(steps, rows)
        assert [a.route for a in answers] == [0, 1, 2] and [a.path for a in answers] == ["hit"] * 3
        assert steps.cache.stats["mispredict"] == mis and seen == [(0, 1, 2)]
    with router_forced(spec, 2):  # every row forced to route 2: the others mispredict and run again
        stepped(steps, rows)
    replayed = [k for k, g in r.graphs.items() if g is not None and g.graph.replays]
    assert replayed and all(k[0] <= 4 for k in replayed) and r.stats["forwards"] >= 2


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_mixes_with_routes(data):
    """Agents whose states repeat, grow or are new, each round's rows stepped together, a small budget evicting
    between rounds, the router sometimes forced to one route (the others' checkpoints mispredict); every answer
    equals the uncached step loop with specialists."""
    _, _, _, spec = world()
    steps = spec_steps(data.draw(st.booleans()), cold_ok=fits, mb=data.draw(st.sampled_from([1, 64])))
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
            stepped(steps, rows)


# ---- the engine, the CLI, bad folders ----------------------------------------------------------------------------------


def test_engine_and_score_report_routes(monkeypatch, capsys):
    """The engine with the tiny model's specialists: cached rows (cold, then hits continuing from the state, each
    with its checkpoint's route) and a short row the cache does not take answer and route as peft, as does
    `eng.uncached`; `statecache score` reports the routes by name."""
    from statecache.cli import main
    from statecache.dev.tiny import tiny_model_dir, tiny_specialists_dir
    from statecache.engine import Engine

    sd = tiny_specialists_dir()
    names = json.loads((sd / "router.json").read_text())["routes"]
    assert len(names) == 3
    S = toks(300, 41)
    rows = [{"ids": S + toks(10 + k, 50 + k), "state_len": 300, "slots": [309 + k], "nopts": [4]} for k in range(4)]
    rows.append({"ids": toks(40, 60), "state_len": 30, "slots": [39], "nopts": [3]})  # too short for the cache
    eng = Engine(tiny_model_dir(), "cpu", "float32", specialists=sd)
    ref = SpecReference(tiny_model_dir(), sd, eng.letter_ids)
    res = eng.answer(rows)
    for r, out in zip(rows, res):
        want_r, want = ref.answers(r["ids"], r["slots"], r["nopts"])
        assert out["route"] == names[want_r] and max_abs_diff(out["probs"], want) <= TOL
    assert [x["path"] for x in res] == ["cold", "hit", "hit", "hit", "plain"]
    for r, probs in zip(rows, eng.uncached(rows)):
        assert max_abs_diff(probs, ref.answers(r["ids"], r["slots"], r["nopts"])[1]) <= TOL
    assert eng.answer(rows[:1])[0]["route"] == res[0]["route"]  # the memo keeps the route
    # the state's later rows continue from it in one step, each with its checkpoint's route
    more = [{"ids": S + toks(12 + k, 70 + k), "state_len": 300, "slots": [311 + k], "nopts": [3]} for k in range(3)]
    stepped_rows = eng.phases["step_rows"]
    for r, out in zip(more, eng.answer(more)):
        want_r, want = ref.answers(r["ids"], r["slots"], r["nopts"])
        assert out["route"] == names[want_r] and max_abs_diff(out["probs"], want) <= TOL
    assert eng.phases["step_rows"] - stepped_rows == 3
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


@pytest.mark.parametrize("pad", PADS)
def test_token_routes_equal_each_row_alone(pad):
    """Two rows of different routes packed in one batched forward with a per-token route index (TokenRoutes) equal
    each row run alone in a forward of its own: their answers and the router's feature sums (padded: the padding
    tokens' route and sum go nowhere); the adapters act."""
    r = runner(pad)
    conv0, S0 = torch.zeros_like(r.st.conv[:, 0]), torch.zeros_like(r.st.S[:, 0])

    def piece(ids, route):
        n = len(ids)
        return Piece(np.asarray(ids, dtype=np.int64), 0, n, conv0, S0, None, None, (n - 1, n // 2, 5), (4, 3, 6),
                     route)

    def run(pieces):
        r.ensure_pieces(pieces)
        r.load(pieces)
        probs = r.read(r.forward(pieces)).clone()
        return probs, r.st.F[: len(pieces)].clone()

    a, b = toks(50, 1), toks(37, 2)
    alone = [run([piece(ids, k)]) for ids, k in ((a, 1), (b, 3))]
    both, F = run([piece(a, 1), piece(b, 3)])
    for j, (p, f) in enumerate(alone):
        assert (both[j, :3] - p[0, :3]).abs().max() <= 1e-5  # the three slots (the fourth is padding)
        assert (F[j] - f[0]).abs().max() <= 1e-3
    trunk, _ = run([piece(a, 0)])
    assert (trunk[0, :3] - alone[0][0][0, :3]).abs().max() > 1e-3  # the adapter does something


def test_an_adapter_folder_that_is_no_route_is_reported(tmp_path, caplog):
    _, _, model, _ = world()
    d = _copy(tmp_path)
    shutil.copytree(d / "beta", d / "delta")
    with caplog.at_level("WARNING", logger="statecache.model.specialists"):
        spec = load_specialists(d, model.cfg)
    assert spec.names == list(ROUTES)
    assert "['delta'] are not routes" in caplog.text


# ---- the projection path: adapters folded into the projections ------------------------------------------------------


def _peft_site(ref: SpecReference, cfg, i: int, site: str, x: torch.Tensor, route: int) -> torch.Tensor:
    """peft's own output of one fused site: its modules' forwards (LoRA layers of the reference PeftModel with the
    route's adapter active, adapters disabled for the trunk) concatenated in the fused row order."""
    from statecache.model.specialists import site_modules

    block, mods, _ = site_modules(cfg, i)[site]
    layer = ref.pm.get_submodule(f"base_model.model.model.layers.{i}.{block}")
    with torch.no_grad():
        if route == 0:
            with ref.pm.disable_adapter():
                return torch.cat([getattr(layer, m)(x) for m, _ in mods], -1)
        ref.pm.set_adapter(ref.names[route])
        return torch.cat([getattr(layer, m)(x) for m, _ in mods], -1)


def _routes(spec, route_tok) -> TokenRoutes:
    return TokenRoutes(spec.lora, spec.router, torch.as_tensor(route_tok))


def test_projections_equal_peft_per_site_and_route():
    """Every adapted site (and an unadapted one) through the folded projection (TokenRoutes): every token of one
    route, for each route, and a random route per token, equal peft's LoRA layers with that route's adapter (1e-5)."""
    _, _, model, spec = world()
    ref = reference_model()
    cfg = model.cfg
    spec.lora.attach(model.w)
    g = torch.Generator().manual_seed(11)
    keys = sorted(spec.lora.layout) + [(0, "in"), (0, "down")]  # layer 0 sits below the router: no adapter
    assert (0, "in") not in spec.lora.layout
    tok = torch.randint(0, len(ROUTES), (9,), generator=g)
    assert len(set(tok.tolist())) >= 3
    for i, site in keys:
        W = spec.lora.weight(model.w, (i, site))
        x = torch.randn(9, W.shape[1], generator=g)
        want = torch.stack([_peft_site(ref, cfg, i, site, x, r) for r in range(len(ROUTES))])  # [R, T, out]
        for r in range(len(ROUTES)):
            got = _routes(spec, [r] * 9).project(i, site, x, W)
            assert (got - want[r]).abs().max() <= 1e-5, (i, site, r)
        mixed = _routes(spec, tok).project(i, site, x, W)
        assert (mixed - want[tok, torch.arange(9)]).abs().max() <= 1e-5, (i, site)
    # the adapters differ by route where they act (else the test shows little)
    W = spec.lora.weight(model.w, (3, "gate_up"))
    x = torch.randn(4, W.shape[1], generator=g)
    outs = [_routes(spec, [r] * 4).project(3, "gate_up", x, W) for r in (0, 1, 3)]
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
    """The work per site with token routes: one GEMM with the extended weight, one mask of the routes' parts and one
    addmm; a site with no adapter: one GEMM."""
    _, _, model, spec = world()
    spec.lora.attach(model.w)
    tokens = _routes(spec, [0, 1, 2, 3, 1])
    for key in spec.lora.layout:
        W = spec.lora.weight(model.w, key)
        x = torch.randn(5, W.shape[1])
        assert _ops(lambda: tokens.project(*key, x, W)) == ["mm", "mul", "addmm_"], key
    W = spec.lora.weight(model.w, (0, "gate_up"))
    x = torch.randn(5, W.shape[1])
    assert _ops(lambda: tokens.project(0, "gate_up", x, W)) == ["mm"]


def test_attach_folds_the_adapters_into_the_weights():
    """attach keeps W's values and memory (W is the first rows of its extended weight, which holds every adapter
    route's A), is a no-op the second time, refuses mismatched weights before changing any, and projections refuse
    weights that are not attached."""
    md, sd, _, _ = world()
    spec = load_specialists(sd, load_config(md))
    weights = load_weights(md, LETTER_IDS, "cpu", torch.float32)
    key = (1, "in")
    before = spec.lora.weight(weights, key).clone()
    x = torch.randn(3, before.shape[1])
    with pytest.raises(RuntimeError, match="attach"):
        _routes(spec, [1, 2, 0]).project(*key, x, spec.lora.weight(weights, key))
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
    with pytest.raises(RuntimeError, match="attach"):  # the weights are the other's now
        _routes(spec, [1, 2, 0]).project(*key, x, spec.lora.weight(weights, key))
    spec.lora.attach(weights)
    assert not other.lora._ext
    W = spec.lora.weight(weights, key)
    assert (_routes(spec, [0, 0, 0]).project(*key, x, W) - x @ before.T).abs().max() <= 1e-6  # the trunk: W alone
