"""The state cache on the CPU in float32: every cached answer equals the uncached (plain) forward within 1e-4.

Hit, grown state (restores p - tail), middle change (restores a stride checkpoint), interleaved agents, a tiny
budget (evictions, bytes bound, LRU order), question chunks of any length, slots at the state end, short and
ineligible rows, long states split at the largest chunk; the chunk runner on arbitrary splits; and a
property-based run over random sequences of rows. Every test runs in both runner modes: eager exact-length chunks
(pad=False) and bucketed padded chunks (pad=True, the GPU's mode without graphs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.cache_util import (VOCAB, assert_close, down, index_bytes_recount, make_cache, make_runner, one_thread,
                              plain_path, reference, small_model, toks)

PADS = [pytest.param(False, id="exact"), pytest.param(True, id="padded")]


@pytest.fixture(scope="module", autouse=True)
def _model():
    with one_thread():
        small_model()
        yield


def ask(cache, ids, state_len, slots, nopts, **kw):
    """cache.row, checked: equal to the plain forward, bookkeeping consistent, bytes within budget."""
    ans = cache.row(ids, state_len, slots, nopts, **kw)
    assert ans is not None, "row unexpectedly declined"
    assert_close(ans.probs, reference(ids, slots, nopts))
    for pr, k in zip(ans.probs, nopts):
        assert len(pr) == k and abs(sum(pr) - 1) < 1e-5
    p = down(state_len, cache.s.align)
    assert ans.reused + ans.computed == len(ids)
    assert ans.reused % cache.s.align == 0 and 0 <= ans.reused <= p
    assert ans.path == ("hit" if ans.reused == p else "cold" if ans.reused == 0 else "partial")
    assert cache.index.bytes <= cache.index.budget_bytes
    assert cache.index.bytes == index_bytes_recount(cache)
    return ans


def question(n: int, seed: int) -> list[int]:
    return toks(n, 10_000 + seed)


def _planned(c0: int, state_len: int, stride=128, tail=16, align=64) -> set[int]:
    """Section 2's checkpoint positions of a row restored at c0 (independent of statecache.index.plan_chunks)."""
    p = down(state_len, align)
    want = {p, down(p - tail, align)} | {down(k, align) for k in range(stride, p, stride)}
    return {x for x in want if x > c0}


# ---- the three ways states repeat -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", PADS)
def test_same_state_again_is_a_hit(pad):
    cache = make_cache(pad)
    state = toks(300, 1)  # p = 256
    a = ask(cache, state + question(20, 1), 300, [319], [4])
    assert (a.path, a.reused, a.computed) == ("cold", 0, 320)
    assert sorted(c.pos for c in cache.index.lru_order()) == [128, 192, 256]  # stride 128, 256-16 -> 192, p
    b = ask(cache, state + question(33, 2), 300, [310, 332], [3, 5])
    assert (b.path, b.reused, b.computed) == ("hit", 256, 333 - 256)
    c = ask(cache, state + question(33, 2), 300, [310, 332], [3, 5])  # the very same row: a hit, same answer
    assert c.path == "hit" and c.probs == b.probs
    assert cache.stats["hits"] == 2 and cache.stats["cold"] == 1 and cache.stats["tokens_reused"] == 512


@pytest.mark.parametrize("pad", PADS)
def test_resident_kv_is_not_copied_again_but_a_clobbered_buffer_is(pad):
    """A hit on the state whose K/V the static buffers already hold skips the K/V copy: with the group's stored K/V
    poisoned, the answer is still right. Once another state ran (or the buffers were overwritten), the copy happens."""
    cache = make_cache(pad)
    a_state, b_state = toks(300, 41), toks(300, 42)
    ask(cache, a_state + question(20, 41), 300, [319], [4])
    K, V, serial = cache.index.lookup(a_state + question(5, 1), limit=256).group.payload
    saved = K.clone()
    K.fill_(1e4)  # poison the stored copy: a hit that copies it answers wrong
    assert cache.runner.kv_owner == (serial, 256)
    ask(cache, a_state + question(30, 43), 300, [329], [4])  # the buffers hold a's K/V already: no copy
    K.copy_(saved)
    ask(cache, b_state + question(20, 44), 300, [319], [4])  # another state: the buffers now hold b's K/V
    assert cache.runner.kv_owner[0] != serial
    ask(cache, a_state + question(25, 45), 300, [324], [4])  # back to a: copied from the (restored) store
    assert cache.runner.kv_owner == (serial, 256)
    cache.runner.st.K.fill_(-1e4)  # something overwrote the buffers and said so (as a graph capture does)
    cache.runner.kv_owner = None
    ask(cache, a_state + question(26, 46), 300, [325], [4])


@pytest.mark.parametrize("pad", PADS)
def test_grown_state_restores_p_minus_tail(pad):
    cache = make_cache(pad)
    state = toks(256, 2)  # p = 256 exactly: the tail checkpoint is at down(256 - 16) = 192
    ask(cache, state + question(10, 3), 256, [265], [4])
    grown = state[:-3] + [(t + 1) % VOCAB for t in state[-3:]] + toks(60, 3)  # last tokens re-tokenised, appended
    a = ask(cache, grown + question(12, 4), len(grown), [len(grown) + 11], [3])
    assert (a.path, a.reused) == ("partial", 192)
    # grown again, only appended: the last row planted its p (256) over `grown`'s tokens, and that is restored
    grown2 = grown + toks(40, 4)  # 356 tokens, p = 320
    b = ask(cache, grown2 + question(5, 5), len(grown2), [len(grown2) + 4], [2])
    assert (b.path, b.reused) == ("partial", 256)
    c = ask(cache, grown2 + question(7, 6), len(grown2), [len(grown2) + 6], [6])
    assert (c.path, c.reused) == ("hit", 320)


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("stride", [128, 192])
def test_middle_change_restores_a_stride_checkpoint(pad, stride):
    """stride 192: state chunks of 192 tokens, which the padded mode runs as 256 (padding inside the state)."""
    cache = make_cache(pad, stride=stride)
    state = toks(700, 3)  # p = 640, tail checkpoint at down(640 - 16) = 576
    ask(cache, state + question(9, 1), 700, [708], [4])
    planted = sorted(c.pos for c in cache.index.lru_order())
    assert planted == sorted(_planned(0, 700, stride=stride))
    assert planted == ([128, 256, 384, 512, 576, 640] if stride == 128 else [192, 384, 576, 640])
    for where in (300, 130, 400, 600, 639, 640, 5):
        s = list(state)
        s[where] = (s[where] + 1) % VOCAB
        a = ask(cache, s + question(9, 1), 700, [708], [4])
        assert a.reused == max([q for q in planted if q <= where], default=0), (where, a.reused)


@pytest.mark.parametrize("pad", PADS)
def test_interleaved_agents(pad):
    cache = make_cache(pad)
    A, B, C = toks(330, 11), toks(450, 12), toks(200, 13)
    pA, pB, pC = 320, 448, 192
    ask(cache, A + question(8, 1), 330, [337], [4])
    ask(cache, B + question(8, 2), 450, [457], [4])
    ask(cache, C + question(8, 3), 200, [207], [4])
    # A again (hit), B grows at its end (restores its p), C changes in its middle (restores a stride point)
    assert ask(cache, A + question(11, 4), 330, [335, 340], [2, 3]).reused == pA
    B2 = B + toks(100, 14)
    assert ask(cache, B2 + question(6, 5), 550, [555], [5]).reused == pB
    C2 = C[:150] + toks(80, 15)
    assert ask(cache, C2 + question(6, 6), 230, [235], [5]).reused == 128
    # and around once more: every agent's newest state is a hit; a stale one still finds its old checkpoint
    assert ask(cache, B2 + question(3, 7), 550, [552], [3]).path == "hit"
    assert ask(cache, C2 + question(3, 8), 230, [232], [3]).path == "hit"
    assert ask(cache, A + question(3, 9), 330, [332], [3]).path == "hit"
    assert ask(cache, C + question(3, 10), 200, [202], [3]).reused == pC
    assert ask(cache, B + question(3, 11), 450, [452], [3]).reused == pB


# ---- the budget ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", PADS)
def test_tiny_budget_evicts_least_recently_used(pad):
    cache = make_cache(pad, mb=1, host_mb=0)  # one tier (the host tier's own tests: tests/test_host_tier.py)
    budget = cache.index.budget_bytes
    A, B, C, D = (toks(200, s) for s in (21, 22, 23, 24))  # p = 192: checkpoints at 128 and 192
    ask(cache, A + question(5, 1), 200, [204], [4])
    one = cache.index.bytes  # one state's group (K/V of [0, 192)) and its two checkpoints
    assert 2 * one <= budget < 3 * one, "the test's sizes no longer force evictions"
    ask(cache, B + question(5, 2), 200, [204], [4])
    assert cache.stats["evicted"] == 0 and cache.index.n_groups == 2
    assert ask(cache, A + question(6, 3), 200, [205], [4]).path == "hit"  # A is now more recent than B
    ask(cache, C + question(5, 4), 200, [204], [4])  # three states do not fit: B, the least recent, goes
    assert cache.stats["evicted"] > 0
    assert ask(cache, A + question(7, 5), 200, [206], [4]).path == "hit"  # the most recently used one survived
    lru = cache.index.lru_order()
    assert lru[-1].group.ids.tolist() == A[:192]  # A's 192 checkpoint, just touched, is the most recent
    assert ask(cache, B + question(7, 6), 200, [206], [4]).path == "cold"  # B was evicted (and is planted again)
    # now C is the least recent state: D evicts it, while A and B stay
    ask(cache, D + question(5, 7), 200, [204], [4])
    assert ask(cache, B + question(8, 8), 200, [207], [4]).path == "hit"
    assert ask(cache, C + question(8, 9), 200, [207], [4]).path == "cold"
    assert cache.index.bytes <= budget


@pytest.mark.parametrize("pad", PADS)
def test_state_larger_than_budget_still_answers(pad):
    cache = make_cache(pad, mb=1, host_mb=0)
    big = toks(900, 5)  # K/V of [0, 896) alone is 1.75 MiB: nothing of it can be kept
    a = ask(cache, big + question(10, 1), 900, [909], [4])
    b = ask(cache, big + question(10, 2), 900, [909], [4])
    assert a.path == "cold" and b.path == "cold" and len(cache.index) == 0
    assert cache.index.bytes <= cache.index.budget_bytes


# ---- chunk shapes, slots, eligibility --------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", PADS)
def test_question_chunks_of_any_length(pad):
    cache = make_cache(pad)
    for state_len in (256, 300):
        state = toks(state_len, state_len)
        p = down(state_len)
        for q in (1, 2, 3, 17, 63, 64, 65, 100, 129):
            ids = state + question(q, q)
            n = len(ids)
            a = ask(cache, ids, state_len, [n - 1], [5])
            assert a.path == ("cold" if q == 1 else "hit") and a.computed == (n if q == 1 else n - p)


@pytest.mark.parametrize("pad", PADS)
def test_answer_slots_at_the_state_end(pad):
    cache = make_cache(pad)
    state = toks(256, 31)  # aligned: slot 256 is the question's first token
    ask(cache, state + question(4, 1), 256, [256], [3])
    a = ask(cache, state + question(4, 2), 256, [256, 259], [3, 4])
    assert a.path == "hit"
    state2 = toks(300, 32)  # not aligned: p = 256 is inside the state, slots may sit in [256, 300) too
    ask(cache, state2 + question(4, 3), 300, [256], [2])
    b = ask(cache, state2 + question(4, 4), 300, [256, 299, 300, 303], [2, 3, 4, 5])
    assert b.path == "hit" and b.reused == 256
    c = ask(cache, state2 + question(1, 5), 300, [256, 300], [7, 26])  # a one-token question, 26 options
    assert c.path == "hit"


@pytest.mark.parametrize("pad", PADS)
def test_short_states_are_declined(pad):
    cache = make_cache(pad)
    for n in (10, 63):
        ids = toks(n, n) + question(5, n)
        assert not cache.eligible(n, [n + 4])
        assert cache.row(ids, n, [n + 4], [4]) is None
    assert ask(cache, toks(64, 64) + question(5, 1), 64, [68], [4]).path == "cold"  # p = 64 = min_prefix
    assert ask(cache, toks(64, 64) + toks(63, 65) + question(5, 2), 127, [131], [4]).path == "hit"  # p = 64
    assert cache.stats["rows"] == 2 and len(cache.index) == 1


@pytest.mark.parametrize("pad", PADS)
def test_ineligible_rows_are_declined(pad):
    cache = make_cache(pad, runner=make_runner(pad, chunks=(16, 32, 64, 128, 256)))
    state = toks(300, 41)
    ids = state + question(20, 1)
    declined = [
        (ids, 300, [255], [4]),  # a slot before p (256)
        (ids, 300, [250, 310], [4, 4]),  # one of them
        (ids, 300, [300, 301, 302, 303, 304], [2] * 5),  # more slots than max_slots (4)
        (ids, 300, [], []),  # none
    ]
    for row in declined:
        assert not cache.eligible(row[1], row[2])
        assert cache.row(*row) is None
    beyond = [  # the cache's rule takes them (the step loop runs them); the chunk runner's shapes cannot hold them
        (state + question(300, 2), 300, [599], [4]),  # question chunk (344) longer than the largest chunk (256)
        (toks(900, 42) + question(200, 3), 900, [1099], [4]),  # p + question past the largest span (1024)
    ]
    for row in beyond:
        assert cache.eligible(row[1], row[2])
        assert cache.row(*row) is None
    assert len(cache.index) == 0 and cache.stats["rows"] == 0
    off = make_cache(pad, mb=0)  # mb 0 turns the cached path off
    assert off.row(ids, 300, [319], [4]) is None
    assert ask(cache, ids, 300, [256, 300, 310, 319], [2, 3, 4, 5]).path == "cold"  # 4 slots is fine


@pytest.mark.parametrize("pad", PADS)
def test_long_states_split_at_the_largest_chunk(pad):
    cache = make_cache(pad, runner=make_runner(pad, chunks=(16, 32, 64, 128, 256)), stride=0)
    state = toks(700, 51)  # p = 640: tail 576, p; [0, 576) runs as 256 + 256 + 64, planted there too
    ask(cache, state + question(30, 1), 700, [729], [4])
    assert sorted(c.pos for c in cache.index.lru_order()) == [256, 512, 576, 640]
    s = list(state)
    s[300] = (s[300] + 1) % VOCAB
    assert ask(cache, s + question(30, 1), 700, [729], [4]).reused == 256
    # and a 300-token stretch after a restore is split too: [256, 512) then [512, 576), [576, 640)
    assert sorted(c.pos for c in cache.index.lru_order()).count(512) == 2


def _plant_packed(cache, rows, planting):
    """One packed forward (statecache.plain) of rows [(ids, state_len, slots, nopts)]; those in `planting` leave
    their checkpoints, which are planted. -> the forward's answers."""
    plans = [cache.plan(r[1]) if k in planting else None for k, r in enumerate(rows)]
    outs, planted = plain_path().run([(r[0], r[2], r[3]) for r in rows], plans)
    outs = [probs for probs, _route in outs]
    for k, (r, pl) in enumerate(zip(rows, planted)):
        assert (pl is None) == (k not in planting)
        if pl is not None:
            cache.plant_planted(r[0], len(r[0]), pl.snaps(), pl.K, pl.V)
    return outs


@pytest.mark.parametrize("lone", [False, True], ids=["packed", "lone"])
@pytest.mark.parametrize("stride,tail", [(128, 16), (192, 16), (0, 0), (64, 64)])
def test_packed_forward_plants_what_the_chunked_path_plants(stride, tail, lone):
    """The packed forward's checkpoints (positions, conv tails, fp32 S, K/V) equal the chunked cold row's, for
    sequences of several lengths packed with one that plants nothing, or each row alone (its segments sliced,
    the short ones through the one-chunk kernel); and its answers are the plain forward's."""
    rows = [(toks(300, 91) + question(20, 1), 300, [319], [4]), (toks(40, 92), 40, [39], [3]),
            (toks(450, 93) + question(7, 2), 450, [452, 456], [2, 5]), (toks(64, 94) + question(3, 3), 64, [66], [4])]
    packed = make_cache(False, stride=stride, tail=tail)
    if lone:
        outs = [_plant_packed(packed, [r], {0} if k != 1 else set())[0] for k, r in enumerate(rows)]
    else:
        outs = _plant_packed(packed, rows, {0, 2, 3})
    for r, got in zip(rows, outs):
        assert_close(got, reference(r[0], r[2], r[3]))
    for ids, state_len, slots, nopts in (rows[0], rows[2], rows[3]):
        chunked = make_cache(False, stride=stride, tail=tail)
        ask(chunked, ids, state_len, slots, nopts)
        want = {c.pos: c for c in chunked.index.lru_order()}
        got = {c.pos: c for c in packed.index.lru_order() if c.group.tokens == list(ids[: down(state_len)])}
        assert sorted(got) == sorted(want) == chunked.plan(state_len)
        for pos, c in got.items():
            for name, x, y in zip(("conv", "S"), c.payload, want[pos].payload):
                assert x.dtype == y.dtype and x.shape == y.shape, name
                torch.testing.assert_close(x, y, rtol=0, atol=1e-5, msg=f"{name} at {pos}")
        (K, V, _), (K2, V2, _) = next(iter(got.values())).group.payload, want[pos].group.payload
        torch.testing.assert_close(K, K2, rtol=0, atol=1e-5)
        torch.testing.assert_close(V, V2, rtol=0, atol=1e-5)
    assert packed.index.bytes == index_bytes_recount(packed)
    assert packed.stats["cold"] == 3 and packed.stats["tokens_computed"] == len(rows[0][0]) + len(rows[2][0]) + 67


@pytest.mark.parametrize("pad", PADS)
def test_rows_continue_from_packed_planted_states(pad):
    """Hits, grown states and middle changes continue from what a packed forward planted, equal to the plain
    forward; a state's byte estimate is what planting it costs."""
    cache = make_cache(pad)
    a, b = toks(300, 95), toks(500, 96)
    _plant_packed(cache, [(a + question(9, 1), 300, [308], [4]), (b + question(9, 2), 500, [508], [4])], {0, 1})
    assert cache.index.bytes == cache.state_bytes(300) + cache.state_bytes(500)
    assert ask(cache, a + question(12, 3), 300, [311], [3]).path == "hit"
    assert ask(cache, b + question(4, 4), 500, [503], [2]).reused == 448
    assert ask(cache, a + toks(90, 97) + question(5, 5), 390, [394], [4]).reused == 256  # grown: p of the old state
    mid = list(b)
    mid[200] = (mid[200] + 1) % VOCAB
    assert ask(cache, mid + question(6, 6), 500, [505], [4]).reused == 128  # changed at 200: restores the stride 128


@pytest.mark.parametrize("pad", PADS)
def test_an_eligible_grown_state_is_not_declined(pad):
    """After a restore at 256 the state chunk [256, 896) is 640 tokens; padded, it would be 1024 and reach past
    max_pos (1024), so it runs as smaller chunks instead (answers still equal the plain forward)."""
    cache = make_cache(pad, stride=0)
    s = toks(1000, 81)
    ask(cache, s[:300] + question(5, 1), 300, [304], [3])
    ids = s + question(5, 1)
    assert cache.eligible(1000, [1004])
    assert ask(cache, ids, 1000, [1004], [3]).path == "partial"


# ---- the runner on its own: any split of a row into chunks -----------------------------------------------------------


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("cuts", [[1, 2, 3, 5, 64, 65, 200, 201, 202, 290], [100, 199], [2], [63, 127, 191, 255]])
def test_runner_any_chunk_split_equals_plain(pad, cuts):
    """Chunks of 1 and 2 tokens (the conv keeps older saved inputs), of 3, of odd lengths, padded or not."""
    runner = make_runner(pad)
    ids = toks(300, 71)
    slots, nopts = [299, 297], [4, 26]
    runner.st.reset()
    bounds = [0] + cuts + [300]
    for s, e in zip(bounds[:-2], bounds[1:-1]):
        runner.run(ids, s, e)
    s = bounds[-2]
    out = runner.run(ids, s, 300, slots, nopts)
    got = [out[j, : nopts[j]].tolist() for j in range(2)]
    assert_close(got, reference(ids, slots, nopts))


# ---- property: random sequences of rows from a few agents ------------------------------------------------------------

AGENTS = 3
MAX_STATE = 640


step = st.fixed_dictionaries({
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


@pytest.mark.parametrize("pad", PADS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**31 - 1), mb=st.sampled_from([1, 2, 64]), stride=st.sampled_from([128, 192, 320]),
       steps=st.lists(step, min_size=2, max_size=6))
def test_random_rows_match_the_plain_forward(pad, seed, mb, stride, steps):
    """stride 192 and 320 make state chunks the padded mode pads (192 -> 256, 320 -> 512, 256 -> 256 ...)."""
    rng = np.random.default_rng(seed)
    cache = make_cache(pad, mb=mb, stride=stride)
    states: dict[int, list[int]] = {}
    planted: set[tuple[int, ...]] = set()  # every prefix the cache was asked to keep (a model without eviction)
    groups: list[tuple[int, ...]] = []  # the tokens [0, p) of each row that planted
    rows, answers = [], []
    for k, s in enumerate(steps):
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
        n, p = len(ids), down(state_len)
        slots = sorted({p + int(f * (n - p)) for f in s["slots"]} | ({p} if s["at_p"] else set()))[:4]
        nopts = [s["nopts"]] * len(slots)
        evicted_before = cache.stats["evicted"]
        ans = cache.row(ids, state_len, slots, nopts)
        rows.append((ids, slots, nopts))
        answers.append(ans)
        if p < 64:
            assert ans is None, "a state shorter than min_prefix took the cached path"
            continue
        assert ans is not None, f"row {k} declined"
        assert ans.reused + ans.computed == n
        assert ans.reused % 64 == 0 and 0 <= ans.reused <= p
        assert ans.path == ("hit" if ans.reused == p else "cold" if ans.reused == 0 else "partial")
        event(f"path {ans.path}")
        # what it restored was planted before, from these very tokens; the deepest such, while nothing was evicted
        deepest = max([q for q in range(64, p + 1, 64) if tuple(ids[:q]) in planted], default=0)
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
        planned = _planned(ans.reused, state_len, stride=stride) | forks
        planted |= {tuple(ids[:q]) for q in planned}
        if ans.reused < p:
            groups.append(tuple(ids[:p]))
        assert cache.index.bytes <= cache.index.budget_bytes
        assert cache.index.bytes == index_bytes_recount(cache)
        assert all(c.pos <= len(c.group.ids) and c.pos % 64 == 0 for c in cache.index.lru_order())
    todo = [i for i, a in enumerate(answers) if a is not None]
    refs = plain_path().forward([rows[i] for i in todo]) if todo else []  # one packed plain forward
    for i, ref in zip(todo, refs):
        assert_close(answers[i].probs, ref)
    info = cache.info()
    event("evicted" if info["evicted"] else "nothing evicted")
    assert info["rows"] == len(todo) == info["hits"] + info["partial"] + info["cold"]
    assert info["tokens_reused"] == sum(answers[i].reused for i in todo)
    assert info["bytes"] <= mb * 2**20
