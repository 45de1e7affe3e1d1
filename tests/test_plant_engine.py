"""Planting from every forward, through the real engine on the built-in tiny model (CPU, float32).

Random batches of rows whose states are new, the same as an earlier one, grown from one, or changed in the middle,
with any backlog, at a budget that evicts (1 MiB) and one that does not: every answer equals the uncached forward of its
row within 1e-4; a row takes the plain path only where it is ineligible or the default policy declined its new state
because the budget could not hold it; a new state the policy accepts is planted by the step that computes it, so
rows of the same batch that share it continue from it (hits, where nothing evicted it); the cache's bytes stay
within budget and add up.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statecache.cache.config import CacheSettings
from statecache.cache.policy import ColdContext, PlantWhenItFits
from statecache.engine import Engine
from statecache.rows.memo import Memo
from tests.cache_util import index_bytes_recount, one_thread
from tests.test_engine import check


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


class Recording:
    """The default policy, its questions and answers kept."""

    def __init__(self):
        self.inner, self.asked = PlantWhenItFits(), []

    def __call__(self, ctx: ColdContext) -> bool:
        ok = self.inner(ctx)
        self.asked.append((ctx, ok))
        return ok


@functools.lru_cache(maxsize=None)
def engine(mb: int) -> Engine:
    return Engine(device="cpu", dtype="float32", cold_ok=Recording(), settings=CacheSettings(min_prefix=64, stride=192, mb=mb))


def fresh(mb: int) -> Engine:
    eng = engine(mb)
    eng.cache.clear()
    eng.memo = Memo(4096)
    eng.cold_ok.asked.clear()
    eng.counts = dict.fromkeys(eng.counts, 0)
    return eng


def toks(n: int, rng) -> list[int]:
    return rng.integers(0, 500, size=n).tolist()


row_ops = st.fixed_dictionaries({
    "op": st.sampled_from(["new", "same", "same", "grow", "middle", "repeat"]),
    "of": st.integers(0, 50),  # which earlier state
    "new_len": st.integers(30, 700),
    "append": st.integers(1, 200),
    "where": st.floats(0, 1, exclude_max=True),
    "qlen": st.integers(1, 30),
    "nopts": st.integers(2, 6),
    "two_slots": st.booleans(),
})


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), mb=st.sampled_from([1, 64]),
       batches=st.lists(st.tuples(st.lists(row_ops, min_size=1, max_size=5), st.sampled_from([0, 3, 10_000])),
                        min_size=1, max_size=3))
def test_random_batches_plant_and_answer_right(seed, mb, batches):
    eng = fresh(mb)
    rng = np.random.default_rng(seed)
    states: list[list[int]] = []
    ix = eng.cache.index  # what the default policy plants: up to the device budget and half of the larger tier
    half = min(ix.budget_bytes, PlantWhenItFits().max_share * max(ix.budget_bytes, ix.host_budget_bytes))
    asked_rows: list[dict] = []
    for ops, waiting in batches:
        rows = []
        for op in ops:
            if op["op"] == "repeat" and asked_rows:  # an exact repeat, in this batch or an earlier one
                rows.append(asked_rows[op["of"] % len(asked_rows)])
                event("repeat")
                continue
            kind = op["op"] if states and op["op"] != "repeat" else "new"
            base = states[op["of"] % len(states)] if states else []
            if kind == "new":
                s = toks(op["new_len"], rng)
            elif kind == "same":
                s = list(base)
            elif kind == "grow":
                s = base + toks(op["append"], rng)
            else:
                s = list(base)
                s[int(op["where"] * len(s))] = (s[int(op["where"] * len(s))] + 1) % 500
            states.append(s)
            ids = s + toks(op["qlen"], rng)
            n = len(ids)
            slots = [n - 2, n - 1] if op["two_slots"] and op["qlen"] >= 2 else [n - 1]
            rows.append({"ids": ids, "state_len": len(s), "slots": slots, "nopts": [op["nopts"]] * len(slots)})
            asked_rows.append(rows[-1])
            event(kind)
        asked_before = len(eng.cold_ok.asked)
        res = eng.answer(rows, waiting_rows=waiting)
        check(eng, rows, res)
        assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
        assert eng.cache.index.bytes == index_bytes_recount(eng.cache)
        asked = eng.cold_ok.asked[asked_before:]
        for ctx, ok in asked:  # the default policy: declines only what the budgets cannot hold
            assert ok == (ctx.state_bytes <= half) and ctx.waiting_rows == waiting and 1 <= ctx.batch_rows <= len(rows)
        declined_tokens = {ctx.state_tokens for ctx, ok in asked if not ok}
        planted_states = {}
        for r, out in zip(rows, res):
            eligible = eng.cache.eligible(r["state_len"], r["slots"])
            p = r["state_len"]  # where its deepest checkpoint sits
            if out["path"] == "plain":
                event("plain")
                assert not eligible or (p in declined_tokens and eng.cache.state_bytes(r["state_len"]) > half)
            if out["path"] == "cold":
                planted_states.setdefault(tuple(r["ids"][:p]), 0)
            elif out["path"] in ("hit", "partial", "cold") and mb == 64 and tuple(r["ids"][:p]) in planted_states:
                assert out["path"] == "hit"  # nothing evicted: the batch's planted state is continued from
            event(out["path"])
        if mb == 64:  # nothing evicted: every planted state is there to hit
            for key in planted_states:
                assert eng.cache.index.lookup(list(key), limit=len(key)).pos == len(key)


def test_a_long_backlog_keeps_the_cache_full():
    """Sixteen agents, each asking twice about its page per visit, every batch behind a long queue: after the
    first visit, the second question of each page and every later visit's unchanged page hit."""
    eng = fresh(64)
    rng = np.random.default_rng(5)
    pages = [toks(int(rng.integers(200, 500)), rng) for _ in range(16)]
    paths = []
    for visit in range(2):
        rows = []
        for a, page in enumerate(pages):
            for q in range(2):
                ids = page + toks(5 + q, rng)
                rows.append({"ids": ids, "state_len": len(page), "slots": [len(ids) - 1], "nopts": [4]})
        res = eng.answer(rows, waiting_rows=500)
        check(eng, rows, res)
        paths.append([r["path"] for r in res])
    assert paths[0] == ["cold", "hit"] * 16
    assert paths[1] == ["hit"] * 32
    assert eng.counts["plain"] == 0 and eng.counts["declined"] == 0
