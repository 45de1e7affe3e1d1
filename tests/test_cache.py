"""The state cache through the step loop on the CPU in float32: every cached answer equals the uncached forward
(tests/cache_util.reference: the same step loop, no cache) within 1e-4.

Hit, grown state (restores p - tail), middle change (restores a stride checkpoint), interleaved agents, a tiny
budget (evictions, bytes bound, LRU order), questions of any length, slots at the state end, short and ineligible
rows (run plain), rows packed in one step planting what each plants alone, a question cut at its slots into pieces
of any length; and a property-based run over random sequences of rows. Rows run through statecache.step.Steps over
the small model (tests/cache_util.make_steps: 256-token pieces, 1024 tokens a step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from statecache.cache.index import MIN_ADVANCE
from statecache.cache.store import Answer
from tests.cache_util import (VOCAB, assert_close, checked, down, index_bytes_recount, make_steps, one_thread,
                              reference, run_rows, small_model, toks)


def plant_all(ctx) -> bool:
    """A cold_ok policy that plants every new state (the default declines one over half the budget): what the tests
    of evictions need."""
    return True


@pytest.fixture(scope="module", autouse=True)
def _model():
    with one_thread():
        small_model()
        yield


def ask(steps, ids, state_len, slots, nopts):
    """One row through the step loop to its end, checked: equal to the uncached forward, bookkeeping consistent,
    bytes within budget."""
    cache = steps.cache
    ans = run_rows(steps, [(ids, state_len, slots, nopts)])[0]
    assert isinstance(ans, Answer), f"the row failed: {ans!r}"
    assert not steps.pending()
    assert_close(ans.probs, reference(ids, slots, nopts))
    for pr, k in zip(ans.probs, nopts):
        assert len(pr) == k and abs(sum(pr) - 1) < 1e-5
    p = state_len  # where the deepest checkpoint sits: the state's end (statecache.cache.index.state_end)
    assert ans.reused + ans.computed == len(ids)
    if ans.path == "plain":  # the cache does not take it (StateCache.eligible), or cold_ok declined its new state
        assert ans.reused == 0
    else:
        assert cache.eligible(state_len, slots)
        assert 0 <= ans.reused <= p
        assert ans.path == ("hit" if ans.reused == p else "cold" if ans.reused == 0 else "partial")
    assert cache.index.bytes <= cache.index.budget_bytes
    assert cache.index.bytes == index_bytes_recount(cache)
    return ans


def question(n: int, seed: int) -> list[int]:
    return toks(n, 10_000 + seed)


def _planned(c0: int, state_len: int, stride=128, tail=16, align=64) -> set[int]:
    """The checkpoint positions of a row restored at c0 (independent of statecache.cache.index.plan_chunks): the state's
    end, and below it the aligned p - tail and multiples of stride at least MIN_ADVANCE below it; only those at least
    MIN_ADVANCE past c0."""
    p = state_len
    below = {down(p - tail, align)} | {down(k, align) for k in range(stride, p, stride)}
    want = {p} | {x for x in below if x <= p - MIN_ADVANCE}
    return {x for x in want if x >= c0 + MIN_ADVANCE}


def positions(cache) -> list[int]:
    return sorted(c.pos for c in cache.index.lru_order())


# ---- the three ways states repeat -------------------------------------------------------------------------------------


def test_same_state_again_is_a_hit():
    steps = make_steps()
    cache = steps.cache
    state = toks(300, 1)  # p = 300, its end
    a = ask(steps, state + question(20, 1), 300, [319], [4])
    assert (a.path, a.reused, a.computed) == ("cold", 0, 320)
    assert positions(cache) == [128, 256, 300]  # stride 128, 300-16 -> 256, p
    b = ask(steps, state + question(33, 2), 300, [310, 332], [3, 5])
    assert (b.path, b.reused, b.computed) == ("hit", 300, 33)  # the question's tokens alone
    c = ask(steps, state + question(33, 2), 300, [310, 332], [3, 5])  # the very same row: a hit, same answer
    assert c.path == "hit" and c.probs == b.probs
    assert cache.stats["hits"] == 2 and cache.stats["cold"] == 1 and cache.stats["tokens_reused"] == 600


def test_grown_state_restores_p_minus_tail():
    steps = make_steps()
    state = toks(256, 2)  # p = 256 exactly: the tail checkpoint is at down(256 - 16) = 192
    ask(steps, state + question(10, 3), 256, [265], [4])
    grown = state[:-3] + [(t + 1) % VOCAB for t in state[-3:]] + toks(60, 3)  # last tokens re-tokenised, appended
    a = ask(steps, grown + question(12, 4), len(grown), [len(grown) + 11], [3])
    assert (a.path, a.reused) == ("partial", 192)
    # grown again, only appended: the last row planted its p (256) over `grown`'s tokens, and that is restored
    grown2 = grown + toks(40, 4)  # 356 tokens: p = 356; grown's own p (316) restored
    b = ask(steps, grown2 + question(5, 5), len(grown2), [len(grown2) + 4], [2])
    assert (b.path, b.reused) == ("partial", 316)
    c = ask(steps, grown2 + question(7, 6), len(grown2), [len(grown2) + 6], [6])
    assert (c.path, c.reused) == ("hit", 356)


@pytest.mark.parametrize("stride", [128, 192])
def test_middle_change_restores_a_stride_checkpoint(stride):
    """The 700-token state runs over several steps (256-token pieces): checkpoints sit at the planned positions only,
    not at the pieces' ends (256, 512 with stride 192)."""
    steps = make_steps(stride=stride)
    cache = steps.cache
    state = toks(700, 3)  # p = 700, tail checkpoint at down(700 - 16) = 640
    ask(steps, state + question(9, 1), 700, [708], [4])
    assert steps.stats["steps"] >= 3  # [0, 640) took several pieces
    planted = positions(cache)
    assert planted == sorted(_planned(0, 700, stride=stride))
    assert planted == ([128, 256, 384, 512, 640, 700] if stride == 128 else [192, 384, 576, 640, 700])
    for where in (300, 130, 400, 600, 639, 640, 699, 5):
        s = list(state)
        s[where] = (s[where] + 1) % VOCAB
        held = [c.pos for c in cache.index.lru_order() if c.group.ids[: c.pos].tolist() == s[: c.pos]]
        a = ask(steps, s + question(9, 1), 700, [708], [4])
        # the deepest planted position before the change, or a fork point an earlier change planted deeper
        assert a.reused == max(held, default=0) >= max([q for q in planted if q <= where], default=0), (where, a.reused)


def test_interleaved_agents():
    steps = make_steps()
    A, B, C = toks(330, 11), toks(450, 12), toks(200, 13)
    pA, pB, pC = 330, 450, 200
    ask(steps, A + question(8, 1), 330, [337], [4])
    ask(steps, B + question(8, 2), 450, [457], [4])
    ask(steps, C + question(8, 3), 200, [207], [4])
    # A again (hit), B grows at its end (restores its p), C changes in its middle (restores a stride point)
    assert ask(steps, A + question(11, 4), 330, [335, 340], [2, 3]).reused == pA
    B2 = B + toks(100, 14)
    assert ask(steps, B2 + question(6, 5), 550, [555], [5]).reused == pB
    C2 = C[:150] + toks(80, 15)
    assert ask(steps, C2 + question(6, 6), 230, [235], [5]).reused == 128
    # and around once more: every agent's newest state is a hit; a stale one still finds its old checkpoint
    assert ask(steps, B2 + question(3, 7), 550, [552], [3]).path == "hit"
    assert ask(steps, C2 + question(3, 8), 230, [232], [3]).path == "hit"
    assert ask(steps, A + question(3, 9), 330, [332], [3]).path == "hit"
    assert ask(steps, C + question(3, 10), 200, [202], [3]).reused == pC
    assert ask(steps, B + question(3, 11), 450, [452], [3]).reused == pB


# ---- the budget ------------------------------------------------------------------------------------------------------


def test_tiny_budget_evicts_least_recently_used():
    steps = make_steps(mb=1, host_mb=0)  # one tier (the host tier's own tests: tests/test_host_tier.py)
    cache = steps.cache
    budget = cache.index.budget_bytes
    A, B, C, D = (toks(200, s) for s in (21, 22, 23, 24))  # p = 200: checkpoints at 128 and 200
    ask(steps, A + question(5, 1), 200, [204], [4])
    one = cache.index.bytes  # one state's group (K/V of [0, 200)) and its two checkpoints
    assert one == cache.state_bytes(200)
    assert 2 * one <= budget < 3 * one, "the test's sizes no longer force evictions"
    ask(steps, B + question(5, 2), 200, [204], [4])
    assert cache.stats["evicted"] == 0 and cache.index.n_groups == 2
    assert ask(steps, A + question(6, 3), 200, [205], [4]).path == "hit"  # A is now more recent than B
    ask(steps, C + question(5, 4), 200, [204], [4])  # three states do not fit: B, the least recent, goes
    assert cache.stats["evicted"] > 0
    assert ask(steps, A + question(7, 5), 200, [206], [4]).path == "hit"  # the most recently used one survived
    lru = cache.index.lru_order()
    assert lru[-1].group.ids.tolist() == A and lru[-1].pos == 200  # A's end, just touched, is the most recent
    assert ask(steps, B + question(7, 6), 200, [206], [4]).path == "cold"  # B was evicted (and is planted again)
    # now C is the least recent state: D evicts it, while A and B stay
    ask(steps, D + question(5, 7), 200, [204], [4])
    assert ask(steps, B + question(8, 8), 200, [207], [4]).path == "hit"
    assert ask(steps, C + question(8, 9), 200, [207], [4]).path == "cold"
    assert cache.index.bytes <= budget


def test_grown_past_end_goes_first_and_fork_points_get_a_lap():
    """The two corrections to recency (statecache.cache.index: `retire`, `add_checkpoint(fork=True)`) as the step loop
    makes them: a row that grows a state sends the old state's end to the eviction end (still a hit until evicted), and
    a new page planting its fork point plants it with a spare lap."""
    steps = make_steps()
    cache = steps.cache
    A = toks(330, 31)
    ask(steps, A + question(8, 1), 330, [337], [4])
    end_A = cache.index.lookup(A, 330)
    assert end_A.pos == 330 and cache.index.lru_order()[-1] is end_A
    grown = A + toks(100, 32)
    assert ask(steps, grown + question(6, 2), 430, [435], [5]).reused == 330
    assert cache.index.counts["retired"] == 1 and cache.index.lru_order()[0] is end_A
    assert ask(steps, A + question(5, 3), 330, [334], [4]).path == "hit"  # still there; read, recent again
    assert cache.index.lru_order()[-1] is end_A
    page = A[:200] + toks(150, 33)  # a new page after A's first 200 tokens: restores 128, plants its fork at 192
    a = ask(steps, page + question(6, 4), 350, [355], [5])
    assert a.reused == 128 and cache.stats["forks"] == 1
    mine = {c.pos: c.spare for c in cache.index.lru_order() if c.group.ids[:350].tolist() == page}
    assert mine[192] and not any(v for pos, v in mine.items() if pos != 192), mine
    assert cache.index.counts["retired"] == 1  # a fork restored (inside A's group) is not retired


def test_state_larger_than_budget_still_answers():
    big = toks(900, 5)  # K/V of [0, 896) alone is 1.75 MiB: nothing of it can be kept
    steps = make_steps(mb=1, host_mb=0)  # the default cold_ok declines it: it runs plain, nothing planted
    a = ask(steps, big + question(10, 1), 900, [909], [4])
    assert a.path == "plain" and steps.sched.stats["declined"] == 1 and len(steps.cache.index) == 0
    steps = make_steps(plant_all, mb=1, host_mb=0)  # planted anyway: evicted at once
    cache = steps.cache
    a = ask(steps, big + question(10, 1), 900, [909], [4])
    b = ask(steps, big + question(10, 2), 900, [909], [4])
    assert a.path == "cold" and b.path == "cold" and len(cache.index) == 0
    assert cache.stats["ckpts_made"] > 0 and cache.stats["evicted"] == cache.stats["ckpts_made"]
    assert cache.index.bytes <= cache.index.budget_bytes


# ---- questions, slots, eligibility -----------------------------------------------------------------------------------


def test_questions_of_any_length():
    steps = make_steps()
    for state_len in (256, 300):
        state = toks(state_len, state_len)
        p = state_len  # a hit computes its question's tokens alone
        for q in (1, 2, 3, 17, 63, 64, 65, 100, 129):
            ids = state + question(q, q)
            n = len(ids)
            a = ask(steps, ids, state_len, [n - 1], [5])
            assert a.path == ("cold" if q == 1 else "hit") and a.computed == (n if q == 1 else n - p)


def test_answer_slots_at_the_state_end():
    steps = make_steps()
    state = toks(256, 31)  # aligned: slot 256 is the question's first token
    ask(steps, state + question(4, 1), 256, [256], [3])
    a = ask(steps, state + question(4, 2), 256, [256, 259], [3, 4])
    assert a.path == "hit"
    state2 = toks(300, 32)  # not aligned: p = 300 all the same (the state's end); a slot inside the state runs plain
    assert ask(steps, state2 + question(4, 3), 300, [256], [2]).path == "plain"
    ask(steps, state2 + question(4, 3), 300, [300], [2])
    b = ask(steps, state2 + question(4, 4), 300, [300, 303], [4, 5])
    assert b.path == "hit" and b.reused == 300
    c = ask(steps, state2 + question(1, 5), 300, [300], [26])  # a one-token question, 26 options
    assert c.path == "hit"


def test_short_states_run_plain():
    steps = make_steps()
    cache = steps.cache
    for n in (10, 63):
        assert not cache.eligible(n, [n + 4])
        assert ask(steps, toks(n, n) + question(5, n), n, [n + 4], [4]).path == "plain"
    assert len(cache.index) == 0 and cache.stats["rows"] == 0
    assert ask(steps, toks(64, 64) + question(5, 1), 64, [68], [4]).path == "cold"  # p = 64 = min_prefix
    grown = ask(steps, toks(64, 64) + toks(63, 65) + question(5, 2), 127, [131], [4])  # restores 64, plants 127
    assert (grown.path, grown.reused) == ("partial", 64)
    assert cache.stats["rows"] == 2 and len(cache.index) == 2


def test_ineligible_rows_run_plain():
    steps = make_steps()
    cache = steps.cache
    state = toks(300, 41)
    ids = state + question(20, 1)
    plain = [
        (ids, 300, [255], [4]),  # a slot before p (256)
        (ids, 300, [250, 310], [4, 4]),  # one of them
        (ids, 300, [300, 301, 302, 303, 304], [2] * 5),  # more slots than max_slots (4): two question pieces
    ]
    for row in plain:
        assert not cache.eligible(row[1], row[2])
        assert ask(steps, *row).path == "plain"
    assert len(cache.index) == 0 and cache.stats["rows"] == 0
    assert not steps.takes(checked(ids, 300, [], []))  # no slot: the engine answers it as a bad row
    # a row past the runner's longest span (1024) is the runner's to refuse, though the cache's rule takes it
    far = checked(toks(900, 42) + question(200, 3), 900, [1099], [4])
    assert cache.eligible(900, [1099]) and not steps.takes(far)
    off = make_steps(mb=0)  # mb 0 turns the cache off: the row runs plain
    assert ask(off, ids, 300, [319], [4]).path == "plain" and len(off.cache.index) == 0
    # a question (344 tokens) longer than the chunk runner's largest chunk was: cached like any other
    assert ask(steps, state + question(300, 2), 300, [599], [4]).path == "cold"
    assert positions(cache) == [128, 256, 300]
    assert ask(steps, ids, 300, [300, 305, 310, 319], [2, 3, 4, 5]).path == "hit"  # 4 slots is fine


# ---- rows sharing a step ---------------------------------------------------------------------------------------------


def _compare_planted(got_cache, want_cache, state_len: int, tokens) -> None:
    """The checkpoints of the group over `tokens` in got_cache equal those of want_cache (its only group)."""
    want = {c.pos: c for c in want_cache.index.lru_order()}
    got = {c.pos: c for c in got_cache.index.lru_order() if c.group.ids.tolist() == list(tokens)}
    assert sorted(got) == sorted(want) == want_cache.plan(state_len)
    for pos, c in got.items():
        for name, x, y in zip(("conv", "S"), c.payload, want[pos].payload):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=f"{name} at {pos}")
    (K, V, _), (K2, V2, _) = next(iter(got.values())).group.payload, next(iter(want.values())).group.payload
    assert K.shape == K2.shape and V.shape == V2.shape
    torch.testing.assert_close(K, K2, rtol=0, atol=1e-5)
    torch.testing.assert_close(V, V2, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stride,tail", [(128, 16), (192, 16), (0, 0), (64, 64)])
def test_rows_packed_in_one_step_plant_what_each_plants_alone(stride, tail):
    """New states of several lengths run together (packed forwards, with a row the cache does not take) plant the
    checkpoints (positions, conv tails, fp32 S, K/V) each plants when it runs alone; the answers are the uncached
    forward's."""
    rows = [(toks(300, 91) + question(20, 1), 300, [319], [4]), (toks(40, 92), 40, [39], [3]),
            (toks(450, 93) + question(7, 2), 450, [452, 456], [2, 5]), (toks(64, 94) + question(3, 3), 64, [66], [4])]
    steps = make_steps(stride=stride, tail=tail)
    packed = steps.cache
    outs = run_rows(steps, rows)
    assert steps.stats["forwards"] < steps.stats["pieces"]  # pieces of several rows shared forwards
    assert [a.path for a in outs] == ["cold", "plain", "cold", "cold"]
    for r, got in zip(rows, outs):
        assert_close(got.probs, reference(r[0], r[2], r[3]))
    for ids, state_len, slots, nopts in (rows[0], rows[2], rows[3]):
        alone = make_steps(stride=stride, tail=tail)
        ask(alone, ids, state_len, slots, nopts)
        _compare_planted(packed, alone.cache, state_len, ids[:state_len])
    assert packed.index.bytes == index_bytes_recount(packed)
    assert packed.stats["cold"] == 3 and packed.stats["tokens_computed"] == len(rows[0][0]) + len(rows[2][0]) + 67


def test_rows_continue_from_states_planted_in_a_shared_step():
    """Hits, grown states and middle changes continue from what rows planted together, equal to the uncached
    forward; a state's byte estimate is what planting it costs."""
    steps = make_steps()
    cache = steps.cache
    a, b = toks(300, 95), toks(500, 96)
    got = run_rows(steps, [(a + question(9, 1), 300, [308], [4]), (b + question(9, 2), 500, [508], [4])])
    assert [x.path for x in got] == ["cold", "cold"]
    assert cache.index.bytes == cache.state_bytes(300) + cache.state_bytes(500)
    assert ask(steps, a + question(12, 3), 300, [311], [3]).path == "hit"
    assert ask(steps, b + question(4, 4), 500, [503], [2]).reused == 500
    assert ask(steps, a + toks(90, 97) + question(5, 5), 390, [394], [4]).reused == 300  # grown: p of the old state
    mid = list(b)
    mid[200] = (mid[200] + 1) % VOCAB
    assert ask(steps, mid + question(6, 6), 500, [505], [4]).reused == 128  # changed at 200: restores the stride 128


def test_a_grown_state_near_the_runners_span_continues():
    """A state grown to 1000 tokens (the runner's span is 1024) continues from its old p: [300, 1000) runs as
    several pieces after the restore."""
    steps = make_steps(stride=0)
    s = toks(1000, 81)
    ask(steps, s[:300] + question(5, 1), 300, [304], [3])
    assert steps.cache.eligible(1000, [1004])
    a = ask(steps, s + question(5, 1), 1000, [1004], [3])
    assert (a.path, a.reused) == ("partial", 300)


# ---- a question cut into pieces of any length ------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[193, 194, 195, 197, 200, 255, 256, 257, 290], [250], [255, 256, 299],
                                  [199, 263, 264]])
def test_a_question_cut_at_its_slots_continues_across_pieces_of_any_length(cuts):
    """Four slots at each of 192 and the cut positions: a piece holds four, so the question [192, 300) is cut at
    each of them, into pieces of 1, 2, 3 and odd lengths, each continuing its row's state (the conv keeps older
    saved inputs); cold, then as a hit. Each position's answers equal the uncached forward of a row with only those
    slots (its question one piece). The cache takes rows of that many slots here (max_slots), the runner's piece
    holds four."""
    ids = toks(300, 71)
    at = [192] + cuts
    nopts4 = [2, 4, 7, 26]
    slots = [x for x in at for _ in nopts4]
    nopts = nopts4 * len(at)
    want = {x: reference(ids, [x] * 4, nopts4) for x in at}
    steps = make_steps(max_slots=len(slots))
    for path in ("cold", "hit"):
        before = steps.stats["pieces"]
        ans = run_rows(steps, [(ids, 192, slots, nopts)])[0]
        assert isinstance(ans, Answer) and ans.path == path
        assert steps.stats["pieces"] - before == (path == "cold") + len(at)  # [0, 192), then a piece per cut
        for k, x in enumerate(at):
            assert_close(ans.probs[4 * k: 4 * k + 4], want[x])


# ---- property: random sequences of rows from a few agents ------------------------------------------------------------

AGENTS = 3
MAX_STATE = 640


visit = st.fixed_dictionaries({
    "agent": st.integers(0, AGENTS - 1),
    "op": st.sampled_from(["same", "same", "grow", "middle", "new"]),
    "new_len": st.integers(40, 480),
    "retok": st.integers(0, 5),  # grow: how many last tokens change
    "append": st.integers(1, 160),
    "where": st.floats(0, 1, exclude_max=True),  # middle: which token changes
    "qlen": st.integers(1, 40),
    "slots": st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3, unique=True),
    "at_p": st.booleans(),  # put the first slot right at p
    "nopts": st.integers(2, 8),
})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), mb=st.sampled_from([1, 2, 64]), stride=st.sampled_from([128, 192, 320]),
       visits=st.lists(visit, min_size=2, max_size=6))
def test_random_rows_match_the_uncached_forward(seed, mb, stride, visits):
    """Every new state is planted (plant_all), so a small budget evicts."""
    rng = np.random.default_rng(seed)
    steps = make_steps(plant_all, mb=mb, stride=stride)
    cache = steps.cache
    states: dict[int, list[int]] = {}
    planted: set[tuple[int, ...]] = set()  # every prefix the cache was asked to keep (a model without eviction)
    groups: list[tuple[int, ...]] = []  # the tokens [0, p) of each row that planted
    rows, answers = [], []
    for k, s in enumerate(visits):
        a = s["agent"]
        cur = states.get(a)
        if cur is None or s["op"] == "new":
            cur = rng.integers(0, VOCAB, s["new_len"]).tolist()
        elif s["op"] == "grow":
            r = min(s["retok"], len(cur))
            cur = cur[: len(cur) - r] + rng.integers(0, VOCAB, r + s["append"]).tolist()
            cur = cur[-MAX_STATE:] if len(cur) > MAX_STATE else cur  # too long: a new state, in effect
        elif s["op"] == "middle":
            i = int(s["where"] * len(cur))
            cur = list(cur)
            cur[i] = (cur[i] + 1 + int(rng.integers(0, VOCAB - 1))) % VOCAB
        states[a] = cur
        state_len = len(cur)
        ids = cur + rng.integers(0, VOCAB, s["qlen"]).tolist()
        n, p = len(ids), state_len
        slots = sorted({p + int(f * (n - p)) for f in s["slots"]} | ({p} if s["at_p"] else set()))[:4]
        nopts = [s["nopts"]] * len(slots)
        evicted_before = cache.stats["evicted"]
        ans = run_rows(steps, [(ids, state_len, slots, nopts)])[0]
        assert isinstance(ans, Answer), f"row {k} failed: {ans!r}"
        rows.append((ids, slots, nopts))
        answers.append(ans)
        assert ans.reused + ans.computed == n
        if p < 64:
            assert ans.path == "plain", "a state shorter than min_prefix was cached"
            continue
        assert 0 <= ans.reused <= p
        assert ans.path == ("hit" if ans.reused == p else "cold" if ans.reused == 0 else "partial")
        event(f"path {ans.path}")
        # what it restored was planted before, from these very tokens; the deepest such, while nothing was evicted
        deepest = max([len(t) for t in planted if len(t) <= p and t == tuple(ids[: len(t)])], default=0)
        assert ans.reused == 0 or tuple(ids[: ans.reused]) in planted
        assert ans.reused <= deepest
        if evicted_before == 0:
            assert ans.reused == deepest, (ans.reused, deepest)
        # a fork point (StateCache.fork_point): the deepest aligned depth below p to which a cached group's tokens
        # equal the row's, past what it restored; the deepest over every group planted while nothing was evicted,
        # each group's depth after (a superset: which of them is still cached is the LRU's business)
        forks = {max([q for q in range(64, p, 64) if ans.reused < q and g[:q] == tuple(ids[:q])], default=0)
                 for g in groups} - {0}
        forks = forks if evicted_before else set(sorted(forks)[-1:])
        planned = _planned(ans.reused, state_len, stride=stride) | {
            x for x in forks if ans.reused + MIN_ADVANCE <= x <= p - MIN_ADVANCE}
        planted |= {tuple(ids[:q]) for q in planned}
        if ans.reused < p:
            groups.append(tuple(ids[:p]))
        assert cache.index.bytes <= cache.index.budget_bytes
        assert cache.index.bytes == index_bytes_recount(cache)
        assert all(0 < c.pos <= len(c.group.ids) for c in cache.index.lru_order())
    for (ids, slots, nopts), ans in zip(rows, answers):
        assert_close(ans.probs, reference(ids, slots, nopts))
    todo = [a for a in answers if a.path != "plain"]
    info = cache.info()
    event("evicted" if info["evicted"] else "nothing evicted")
    assert info["rows"] == len(todo) == info["hits"] + info["partial"] + info["cold"]
    assert info["tokens_reused"] == sum(a.reused for a in todo)
    assert info["bytes"] <= mb * 2**20
