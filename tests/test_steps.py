"""The step loop (statecache.step over statecache.sched) through the real engine on the built-in tiny model (CPU,
float32): rows submitted in waves while steps run, under random token budgets, chunk sizes and cache budgets, every
answer equal to the plain forward of its row within 1e-4 (with the tiny specialists too: routes and answers as the
routed plain forward), the cache's bytes within budget; device memory running out at random forwards changes no
answer. Image rows in waves: tests/test_images.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statecache.cache.config import CacheSettings
from statecache.engine import Engine
from statecache.rows.memo import Memo
from tests.cache_util import answer_in_waves, assert_close, index_bytes_recount, one_thread
from tests.test_engine import check


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


@functools.lru_cache(maxsize=None)
def engine(step_tokens: int, step_chunk: int, mb: int, routes: bool = False) -> Engine:
    spec = None
    if routes:
        from statecache.dev.tiny import tiny_specialists_dir

        spec = tiny_specialists_dir()
    return Engine(device="cpu", dtype="float32", step_tokens=step_tokens, step_chunk=step_chunk,
                  settings=CacheSettings(min_prefix=64, stride=192, mb=mb, host_mb=0 if mb == 1 else None),
                  specialists=spec)


def fresh(step_tokens: int, step_chunk: int, mb: int, routes: bool = False) -> Engine:
    eng = engine(step_tokens, step_chunk, mb, routes)
    eng.clear_schedule()  # rows an example that failed left (hypothesis then shows that failure, not this leftover)
    eng.cache.clear()
    eng.memo = Memo(4096)
    return eng


def toks(n: int, rng) -> list[int]:
    return rng.integers(0, 500, size=n).tolist()


ops = st.fixed_dictionaries({
    "op": st.sampled_from(["new", "same", "same", "grow", "middle", "short"]),
    "of": st.integers(0, 50),
    "new_len": st.integers(64, 900),
    "append": st.integers(1, 300),
    "where": st.floats(0, 1, exclude_max=True),
    "qlen": st.integers(1, 40),
    "slots": st.integers(1, 3),
})


def make_rows(wave, states, rng, note=event) -> list[dict]:
    rows = []
    for op in wave:
        kind = op["op"] if states else "new"
        base = states[op["of"] % len(states)] if states else []
        if kind == "new":
            s = toks(op["new_len"], rng)
        elif kind == "same":
            s = list(base)
        elif kind == "grow":
            s = base + toks(op["append"], rng)
        elif kind == "middle":
            s = list(base)
            s[int(op["where"] * len(s))] = (s[int(op["where"] * len(s))] + 1) % 500
        else:  # a state too short for the cache: computed from 0 through the step, nothing planted
            s = toks(30, rng)
        states.append(s)
        ids = s + toks(op["qlen"], rng)
        n, k = len(ids), min(op["slots"], op["qlen"])
        slots = list(range(n - k, n))
        rows.append({"ids": ids, "state_len": len(s), "slots": slots, "nopts": [2 + j for j in range(k)]})
        note(kind)
    return rows


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), step_tokens=st.sampled_from([128, 320, 2048]),
       step_chunk=st.sampled_from([64, 192, 512]), mb=st.sampled_from([1, 64]),
       waves=st.lists(st.tuples(st.lists(ops, min_size=1, max_size=5), st.integers(0, 3)), min_size=1, max_size=4))
def test_waves_of_rows_between_steps_answer_as_the_plain_forward(seed, step_tokens, step_chunk, mb, waves):
    """Each wave is submitted, then that many steps run before the next wave comes (0: it joins at once); the last
    wave's rows are stepped to their end. Every row is answered once, as the plain forward answers it. After every
    step the cache's device bytes and what the rows in the schedule hold beside them (Steps.held_bytes) are within
    the budget, or what is left on the device is what those rows will read (pinned)."""
    eng = fresh(step_tokens, step_chunk, mb)
    rng = np.random.default_rng(seed)
    states: list[list[int]] = []
    batches = [(make_rows(wave, states, rng), steps) for wave, steps in waves]
    rows = [r for batch, _ in batches for r in batch]

    def within_budget() -> None:
        ix, held = eng.cache.index, eng.steps.held_bytes()
        assert ix.bytes <= ix.budget_bytes
        assert ix.bytes + held <= ix.budget_bytes or all(c in ix._pins for c in ix._lru), (ix.bytes, held)
        event(f"held {'none' if not held else 'some'}; device tier {'empty' if not ix.bytes else 'holding'}")

    res = answer_in_waves(eng, batches, within_budget)
    assert all("probs" in r for r in res), [r for r in res if "probs" not in r]
    check(eng, rows, res)
    for r in res:
        event(r["path"])
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
    assert eng.cache.index.bytes == index_bytes_recount(eng.cache)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), step_tokens=st.sampled_from([128, 2048]), step_chunk=st.sampled_from([64, 192]),
       mb=st.sampled_from([1, 64]),
       waves=st.lists(st.tuples(st.lists(ops, min_size=1, max_size=5), st.integers(0, 2)), min_size=2, max_size=4))
def test_waves_of_rows_with_specialists_routes_answer_as_the_routed_plain_forward(seed, step_tokens, step_chunk, mb,
                                                                                   waves):
    """The tiny model with its 3-route specialists: rows in waves through the step loop (each with a guessed route,
    run again with the router's where it disagreed) answer and route as the uncached forward of each row (routed by
    the router over the whole row, checked against peft in tests/test_specialists.py), float32 1e-4."""
    eng = fresh(step_tokens, step_chunk, mb, routes=True)
    missed = eng.cache.stats["mispredict"]
    rng = np.random.default_rng(seed)
    states: list[list[int]] = []
    batches = [(make_rows(wave, states, rng), steps) for wave, steps in waves]
    rows = [r for batch, _ in batches for r in batch]
    res = answer_in_waves(eng, batches)
    for r in res:
        event(r["path"])
    event(f"mispredictions: {eng.cache.stats['mispredict'] > missed}")
    want = eng.uncached(rows, results=True)
    for r, w in zip(res, want):
        assert "probs" in r, r
        assert r["route"] == w["route"]
        assert_close(r["probs"], w["probs"])
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), step_tokens=st.sampled_from([320, 2048]), mb=st.sampled_from([1, 64]),
       qlens=st.lists(st.integers(1, 1200), min_size=1, max_size=4), slots=st.integers(1, 9))
def test_long_questions_and_many_slots_run_through_the_step_as_the_plain_forward(seed, step_tokens, mb, qlens, slots):
    """Questions longer than the runner's longest piece (512 tokens) and rows with more slots than a piece holds (4,
    two at one position sometimes), over new, repeated and grown states: the step takes every row, cuts each question
    into pieces, and each answer equals the plain forward's."""
    eng = fresh(step_tokens, 192, mb)
    rng = np.random.default_rng(seed)
    base = toks(int(rng.integers(100, 600)), rng)
    states = [base, base, base + toks(int(rng.integers(1, 100)), rng), toks(int(rng.integers(64, 400)), rng)]
    rows = []
    for k, q in enumerate(qlens):
        s = states[k % len(states)]
        ids = s + toks(q, rng)
        at = [int(x) for x in rng.choice(np.arange(len(s), len(ids)), size=min(slots, q), replace=False)]
        if len(at) > 1 and rng.random() < 0.5:
            at[1] = at[0]  # two slots at one position
        at = sorted(at)
        rows.append({"ids": ids, "state_len": len(s), "slots": at, "nopts": [2 + j % 5 for j in range(len(at))]})
    assert all(eng.steps.takes(eng._prepare(0, r)[0]) for r in rows)
    before = {k: v for k, v in eng.phases.items() if k.endswith("_rows") and not k.startswith("step")}
    res = eng.answer(rows)
    assert {k: v for k, v in eng.phases.items() if k.endswith("_rows") and not k.startswith("step")} == before
    assert all("probs" in r for r in res), [r for r in res if "probs" not in r]
    check(eng, rows, res)
    for r in res:
        event(r["path"])
    assert eng.cache.index.bytes == index_bytes_recount(eng.cache)


def random_waves(eng: Engine, rng, waves: int) -> tuple[list[dict], list[dict]]:
    """Waves of 4 random rows (new, same, grown, changed states) submitted between steps, then steps until none is
    pending -> (the rows, their results in order)."""
    states: list[list[int]] = []
    rows, got = [], {}
    for _ in range(waves):
        wave = [{"op": o, "of": int(rng.integers(0, 50)), "new_len": int(rng.integers(64, 700)),
                 "append": int(rng.integers(1, 200)), "where": float(rng.random()), "qlen": int(rng.integers(2, 20)),
                 "slots": int(rng.integers(1, 3))} for o in rng.choice(["new", "same", "grow", "middle"], 4)]
        batch = make_rows(wave, states, rng, note=lambda kind: None)
        got.update(eng.submit(batch, list(range(len(rows), len(rows) + len(batch)))))
        rows += batch
        got.update(eng.step())
    while eng.pending():
        got.update(eng.step())
    return rows, [got[i] for i in range(len(rows))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_memory_running_out_at_random_forwards_changes_no_answer(seed):
    """A fault hook raises torch.OutOfMemoryError at a third of the step forwards while rows arrive in waves: the
    cache gives up half its device tier and the forward runs again (in halves once there is nothing to free), and
    every row is answered as the plain forward answers it."""
    eng = fresh(320, 192, 64)
    rng = np.random.default_rng(seed)
    real, faults, last = eng.runner.forward, [0], [False]
    coin = np.random.default_rng(100 + seed)

    def sometimes_out(pieces):  # a third of the forwards, never twice in a row (freeing memory makes room)
        if not last[0] and coin.random() < 1 / 3:
            faults[0] += 1
            last[0] = True
            raise torch.OutOfMemoryError("CUDA out of memory (fault hook)")
        last[0] = False
        return real(pieces)

    eng.runner.forward = sometimes_out
    try:
        rows, res = random_waves(eng, rng, 6)
    finally:
        eng.runner.forward = real
    assert faults[0] > 0 and eng.steps.stats["oom_failed"] == 0
    assert all("probs" in r for r in res), [r for r in res if "probs" not in r]
    check(eng, rows, res)


@pytest.mark.parametrize("seed", [0, 1])
def test_answers_that_cannot_be_read_give_their_rows_back_and_change_no_answer(seed):
    """A fault hook makes reading a forward's answers raise (as a device error surfacing when a step is finished
    would) for a third of the forwards, never twice in a row: that forward's rows are scheduled again, the step's
    other rows stand, nothing they half-computed is planted, and every row is answered as the plain forward answers
    it; a row whose answers never read fails alone, with an error result."""
    eng = fresh(320, 192, 64)
    rng = np.random.default_rng(seed)
    real, faults, last = eng.runner.read_later, [0], [False]
    coin = np.random.default_rng(200 + seed)

    def sometimes_unreadable(out):
        wait = real(out)
        if last[0] or coin.random() >= 1 / 3:
            last[0] = False
            return wait
        faults[0] += 1
        last[0] = True

        def broken():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fault hook)")
        return broken

    eng.runner.read_later = sometimes_unreadable
    try:
        rows, res = random_waves(eng, rng, 5)
        assert faults[0] > 0 and eng.counts["retried"] > 0
        assert all("probs" in r for r in res), [r for r in res if "probs" not in r]
        check(eng, rows, res)
        eng.memo = Memo(4096)  # never readable: the row fails alone after its retries, the others are answered
        eng.runner.read_later = lambda out: (_ for _ in ()).throw(RuntimeError("unreadable (fault hook)"))
        bad = make_rows([{"op": "new", "of": 0, "new_len": 100, "append": 1, "where": 0.0, "qlen": 5, "slots": 1}],
                        [], rng, note=lambda kind: None)
        done = dict(eng.submit(bad, ["bad"]))
        while eng.pending():
            done.update(eng.step())
        assert done["bad"]["error"]["code"] == "internal" and "unreadable" in done["bad"]["error"]["message"]
    finally:
        eng.runner.read_later = real
    assert not eng.pending() and not eng.steps.live


def test_after_a_step_raises_and_the_schedule_is_cleared_later_rows_are_answered():
    """A step raising past its own isolation (here device memory running out in a forward and again while the cache
    gives memory back, with a step in flight behind it) makes the worker give up the schedule
    (`Engine.clear_schedule`, as worker.gpu_thread does): every row in it comes back, and the rows submitted after are
    answered as the plain forward answers them (the scheduler does not wait for the abandoned steps: on an H100 one
    such failure failed every later step)."""
    eng = fresh(320, 192, 64)
    rng = np.random.default_rng(7)
    first = make_rows([{"op": "new", "of": 0, "new_len": 600, "append": 1, "where": 0.0, "qlen": 5, "slots": 1}] * 3,
                      [], rng, note=lambda kind: None)
    tags = [f"a{k}" for k in range(len(first))]
    assert eng.submit(first, tags) == []
    eng.step()  # a step in flight
    real, evict = eng.runner.forward, eng.cache.index.evict

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (fault hook)")

    eng.runner.forward = eng.cache.index.evict = out_of_memory
    try:
        with pytest.raises(torch.OutOfMemoryError, match="fault hook"):
            eng.step()
    finally:
        eng.runner.forward, eng.cache.index.evict = real, evict
    assert sorted(eng.clear_schedule()) == tags and not eng.pending() and not eng.steps.live
    rows, res = random_waves(eng, rng, 3)
    assert all("probs" in r for r in res), [r for r in res if "probs" not in r]
    check(eng, rows, res)


def test_states_longer_than_a_pieces_span_are_cached_through_the_step():
    """The step loop takes every row up to the longest a row may be; whether a state may be cached is the cache's
    rule alone (StateCache.eligible): a 1500-token state and one grown past 2000 are planted and continued from,
    every answer as the uncached forward's."""
    eng = Engine(device="cpu", dtype="float32", settings=CacheSettings(min_prefix=64, stride=192))
    rng = np.random.default_rng(4)
    s = toks(1500, rng)
    grown = s + toks(600, rng)
    rows = [{"ids": x + toks(9, rng), "state_len": len(x), "slots": [len(x) + 8], "nopts": [4]} for x in (s, s, grown, grown)]
    res = [eng.answer([r])[0] for r in rows]
    assert [r["path"] for r in res] == ["cold", "hit", "partial", "hit"], [r["path"] for r in res]
    assert res[1]["reused"] == eng.cache.state_end(1500) and res[3]["reused"] == eng.cache.state_end(2100)
    assert eng.phases["step_rows"] == 4
    check(eng, rows, res)
