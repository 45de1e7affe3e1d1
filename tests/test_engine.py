"""The engine on the built-in tiny model (CPU, float32): memo, duplicates, grouping by state, planting from the
packed forward under any backlog, the cold_ok policy, bad rows, text rows, statistics; and the `statecache score`
command. Every answer is checked against the uncached forward of the same row within 1e-4.
"""

from __future__ import annotations

import io
import json
import logging
import sys

import numpy as np
import pytest

from statecache.cache.config import CacheSettings
from statecache.cache.index import DEVICE
from statecache.cache.policy import ColdContext
from statecache.engine import RETRIES_CACHED, Engine
from statecache.rows.memo import Memo
from statecache.rows.text import encode_text_row
from tests.cache_util import assert_close, one_thread

Q = [
    {"text": "Which link leads to the checkout?", "options": ["the blue button", "the menu", "the search box"]},
    {"text": "Is the form complete?", "options": ["yes", "no"]},
    {"text": "What should the agent do next?", "options": ["click", "type", "scroll", "go back"]},
]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


@pytest.fixture
def engine():
    """A factory of fresh engines on the tiny model, CPU. States of 64+ tokens take the cached path unless told
    otherwise; stride 192 plants a checkpoint every 192 tokens."""

    def make(**kw) -> Engine:
        kw.setdefault("settings", CacheSettings(min_prefix=64, stride=192))
        return Engine(device="cpu", dtype="float32", **kw)

    return make


def toks(n: int, seed: int, vocab: int = 500) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def row(state: list[int], q: int, seed: int, nopts=(4,)) -> dict:
    """A token row: the state, then a question of q tokens answered at its last token (and earlier ones if asked)."""
    ids = state + toks(q, 1000 + seed)
    n = len(ids)
    slots = [n - 1 - j for j in range(len(nopts))][::-1]
    return {"ids": ids, "state_len": len(state), "slots": slots, "nopts": list(nopts)}


def check(eng: Engine, rows: list[dict], results: list[dict]) -> None:
    """Every answered row equals the uncached forward of its tokens (Engine.uncached); bookkeeping adds up."""
    for r, res in zip(rows, results):
        if "error" in res:
            continue
        tr = r if "ids" in r else encode_text_row(r, eng.tokenizer, eng.max_row_tokens)
        ref = eng.uncached([{"ids": tr["ids"], "state_len": 0, "slots": tr["slots"],
                             ("options" if "options" in tr else "nopts"): tr.get("options", tr.get("nopts"))}])[0]
        assert_close(res["probs"], ref)
        if res["path"] == "memo":
            assert res["reused"] == 0 and res["computed"] == 0
        else:
            assert res["reused"] + res["computed"] == len(tr["ids"])
            assert (res["reused"] > 0) == (res["path"] in ("hit", "partial"))


def paths(results: list[dict]) -> list[str]:
    return [r.get("path", "error") for r in results]


def text_state(agent: str, steps: int = 20) -> str:
    """About 20 tokens a step with the tiny tokenizer: 20 steps is a state of 400+ tokens."""
    return f"goal of agent {agent}: book a table for two near the park\n" + "\n".join(
        f"step {i}: {agent} clicked the button and typed a name into the field" for i in range(steps))


# ---- memo and duplicates ---------------------------------------------------------------------------------------------


def test_memo_answers_an_exact_repeat(engine):
    eng = engine()
    cached, plain = row(toks(300, 1), 10, 1), row(toks(30, 2), 10, 2)  # the second's state is too short to cache
    first = eng.answer([cached, plain])
    assert paths(first) == ["cold", "plain"]
    again = eng.answer([plain, cached])
    assert paths(again) == ["memo", "memo"]
    assert again[0]["probs"] == first[1]["probs"] and again[1]["probs"] == first[0]["probs"]
    assert eng.cache.stats["rows"] == 1 and eng.counts["plain"] == 1
    check(eng, [cached, plain, plain, cached], first + again)
    other = dict(cached, nopts=[5])  # same tokens, other option count: not the same row
    assert paths(eng.answer([other])) == ["hit"]
    assert eng.stats()["memo"] == 2


def test_duplicates_in_one_batch_are_computed_once(engine):
    eng = engine()
    cached, plain = row(toks(300, 3), 10, 3), row(toks(40, 4), 10, 4)
    res = eng.answer([cached, plain, cached, plain, cached])
    assert paths(res) == ["cold", "plain", "memo", "memo", "memo"]
    assert res[2]["probs"] == res[0]["probs"] and res[3]["probs"] == res[1]["probs"]
    assert eng.cache.stats["rows"] == 1 and eng.counts["plain"] == 1 and eng.counts["plain_tokens"] == 50
    check(eng, [cached, plain, cached, plain, cached], res)


def test_duplicates_without_a_memo_still_get_answers(engine):
    eng = engine()
    eng.memo = Memo(0)  # the memo off: a duplicate in one batch must still get a result
    cached, plain = row(toks(300, 5), 10, 5), row(toks(40, 6), 10, 6)
    res = eng.answer([plain, cached, plain, cached])
    assert all(r is not None and "probs" in r for r in res), res
    assert res[2]["probs"] == res[0]["probs"] and res[3]["probs"] == res[1]["probs"]
    assert paths(res)[:2] == ["plain", "cold"] and eng.counts["plain"] == 1
    check(eng, [plain, cached, plain, cached], res)
    assert paths(eng.answer([cached])) == ["hit"]  # nothing remembered: computed again, from the cache


# ---- grouping and the backlog ----------------------------------------------------------------------------------------


def test_a_new_state_shared_by_three_rows_is_planted_once(engine):
    eng = engine()
    S, T = toks(400, 5), toks(350, 6)
    rows = [row(S, 12, 1), row(T, 12, 2), row(S, 7, 3, nopts=(2, 3)), row(S, 30, 4)]
    res = eng.answer(rows)
    assert paths(res) == ["cold", "cold", "hit", "hit"]
    assert [r["reused"] for r in res] == [0, 0, 400, 400]
    check(eng, rows, res)


def test_a_backlog_still_plants_and_later_rows_hit(engine):
    eng = engine()
    S, T, U = toks(300, 7), toks(320, 8), toks(280, 9)
    res = eng.answer([row(S, 10, 1)], waiting_rows=10_000)
    assert paths(res) == ["cold"]  # planted whatever the backlog: stride 192, p - tail (284 -> 256), p
    assert sorted(c.pos for c in eng.cache.index.lru_order()) == [192, 256, 300]
    rows = [row(T, 10, 2), row(T, 11, 3), row(U, 10, 4), row(T, 12, 5), row(S, 13, 6), row(toks(30, 11), 4, 7)]
    res2 = eng.answer(rows, waiting_rows=10_000)
    # T and U are planted by their first rows; T's other rows wait for T's checkpoint and hit; S's continues
    assert paths(res2) == ["cold", "hit", "cold", "hit", "hit", "plain"]
    res3 = eng.answer([row(T + toks(100, 10), 5, 8), row(U, 9, 9)])
    assert paths(res3) == ["partial", "hit"]
    assert eng.counts["declined"] == 0 and eng.counts["plain"] == 1
    assert eng.stats()["cold"] == 3 and eng.stats()["hits"] == 4
    check(eng, [row(S, 10, 1)] + rows + [row(T + toks(100, 10), 5, 8), row(U, 9, 9)], res + res2 + res3)


def test_the_policy_is_asked_once_per_new_state(engine):
    asked = []

    def policy(ctx: ColdContext) -> bool:
        asked.append(ctx)
        return ctx.state_tokens != 320  # declines T

    eng = engine(cold_ok=policy)
    S, T = toks(300, 12), toks(320, 13)
    rows = [row(S, 10, 1), row(T, 10, 2), row(S, 11, 3), row(T, 12, 4), row(S, 13, 5)]
    res = eng.answer(rows, waiting_rows=7)
    assert paths(res) == ["cold", "plain", "hit", "plain", "hit"]
    assert [(c.state_tokens, c.sharing_rows, c.batch_rows, c.waiting_rows) for c in asked] == [(300, 3, 5, 7),
                                                                                               (320, 2, 5, 7)]
    assert asked[0].used_bytes == 0 and asked[0].budget_bytes == eng.cache.index.budget_bytes
    assert eng.cache.index.bytes == asked[0].state_bytes  # the estimate is what planting S took
    assert asked[1].used_bytes == 0  # asked before anything of this batch was planted
    assert eng.counts["declined"] == 1 and eng.counts["plain"] == 2
    assert all(c.group.tokens == S[:300] for c in eng.cache.index.lru_order())
    res2 = eng.answer([row(S, 14, 6), row(T, 15, 7)])
    assert paths(res2) == ["hit", "plain"] and len(asked) == 3  # S has a state: not asked again
    check(eng, rows + [row(S, 14, 6), row(T, 15, 7)], res + res2)


def test_the_default_policy_declines_a_state_the_budget_cannot_hold(engine):
    eng = engine(settings=CacheSettings(min_prefix=64, stride=192, mb=1, host_mb=0))  # one tier: half of 1 MiB
    small, big = toks(200, 14), toks(700, 15)
    assert eng.cache.state_bytes(200) <= 2**19 < eng.cache.state_bytes(700)  # half of 1 MiB: PlantWhenItFits
    res = eng.answer([row(big, 10, 1), row(small, 10, 2), row(big, 11, 3)])
    assert paths(res) == ["plain", "cold", "plain"]
    assert eng.counts["declined"] == 1 and all(c.group.tokens == small for c in eng.cache.index.lru_order())
    check(eng, [row(big, 10, 1), row(small, 10, 2), row(big, 11, 3)], res)


def test_with_a_host_tier_the_default_policy_plants_what_the_device_budget_holds(engine):
    """The host tier takes what a new state evicts (and the state itself later): the default policy plants a state
    of more than half the device budget, and declines one the device budget cannot hold at all."""
    eng = engine(settings=CacheSettings(min_prefix=64, stride=192, mb=1, host_mb=8))
    small, big, huge = toks(200, 14), toks(550, 15), toks(1200, 16)
    assert 2**19 < eng.cache.state_bytes(550) <= 2**20 < eng.cache.state_bytes(1200)
    res = eng.answer([row(big, 10, 1), row(small, 10, 2), row(huge, 11, 3)])
    assert paths(res) == ["cold", "cold", "plain"] and eng.counts["declined"] == 1
    other = toks(550, 17)
    assert paths(eng.answer([row(other, 10, 5)])) == ["cold"]  # it moves `big` to the host tier
    again = eng.answer([row(big, 12, 4)])
    assert paths(again) == ["hit"] and eng.cache.stats["restored_host"] == 1  # copied back
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
    check(eng, [row(big, 10, 1), row(small, 10, 2), row(huge, 11, 3), row(big, 12, 4)], res + again)


def test_ineligible_rows_take_the_plain_path(engine):
    """Rows the cache's rule refuses (StateCache.eligible) run plain; a long question does not make a row ineligible."""
    eng = engine()
    S = toks(300, 11)
    rows = [
        row(toks(50, 12), 10, 1),  # state shorter than min_prefix (64)
        {"ids": S + toks(10, 13), "state_len": 300, "slots": [200, 309], "nopts": [3, 4]},  # a slot before p
        {"ids": S + toks(10, 14), "state_len": 300, "slots": [300, 302, 304, 306, 309], "nopts": [2] * 5},  # 5 slots
        row(S, 2100, 15),  # a question longer than the chunk runner's largest chunk (2048): the step cuts it
    ]
    res = eng.answer(rows)
    assert paths(res) == ["plain"] * 3 + ["cold"]
    assert eng.cache.stats["rows"] == 1 and eng.counts["plain"] == 3
    check(eng, rows, res)


# ---- bad rows --------------------------------------------------------------------------------------------------------


def test_bad_rows_get_errors_and_the_rest_is_answered(engine):
    eng = engine()
    good1, good2 = row(toks(300, 20), 10, 1), row(toks(30, 21), 5, 2)
    bad = [
        "not a map",
        {"ids": [1, 2, 3], "state_len": 1},  # fields missing
        {"ids": [1, 2, 99999], "state_len": 1, "slots": [2], "nopts": [2]},  # a token outside the vocabulary
        {"ids": [1, 2, 3], "state_len": 1, "slots": [3], "nopts": [2]},  # a slot past the end
        {"ids": [1, 2, 3], "state_len": 1, "slots": [2], "nopts": [27]},  # more options than letters
        {"ids": [1, 2, 3], "state_len": 5, "slots": [2], "nopts": [2]},
        {"state": "a page", "questions": [{"text": "?", "options": ["only one"]}]},
        {"state": "a page", "questions": [], "ids": [1]},
    ]
    rows = [good1] + bad + [good2]
    res = eng.answer(rows)
    assert "probs" in res[0] and "probs" in res[-1]
    codes = [r["error"]["code"] for r in res[1:-1]]
    assert codes == ["bad_row", "bad_row", "id_out_of_range", "slot_out_of_range", "bad_nopts",
                     "state_len_out_of_range", "bad_nopts", "bad_row"]
    assert all(r["error"]["message"] for r in res[1:-1])
    assert eng.counts["errors"] == len(bad)
    check(eng, rows, res)


def test_a_failing_forward_fails_only_its_rows_and_the_rest_goes_on(engine, monkeypatch):
    """A step's forward that raises is halved until the failing piece stands alone: only the rows of S fail (the
    second one too, when it runs after the first failed), the others are answered in the same steps."""
    eng = engine()
    S = toks(300, 25)
    real = eng.runner.forward

    def fail_on_s(pieces):
        if any(list(pc.ids[:10]) == S[:10] for pc in pieces):
            raise RuntimeError("forward boom")
        return real(pieces)

    monkeypatch.setattr(eng.runner, "forward", fail_on_s)
    rows = [row(S, 10, 1), row(toks(20, 26), 5, 2), row(S, 11, 3), row(toks(280, 27), 5, 4)]
    res = eng.answer(rows)
    assert paths(res) == ["error", "plain", "error", "cold"]
    assert res[0]["error"]["code"] == "internal" and "forward boom" in res[0]["error"]["message"]
    monkeypatch.undo()
    res2 = eng.answer(rows[:1])
    assert paths(res2) == ["cold"]  # nothing of S was planted
    check(eng, rows + rows[:1], res + res2)


def test_device_memory_running_out_frees_cache_and_retries(engine, monkeypatch):
    """torch.OutOfMemoryError in a step's forward: the cache gives up half its device tier, the forward runs again
    (halved); every row is answered as the plain forward answers it. A row that runs out alone with nothing left to
    free gets `out_of_memory`."""
    import torch

    eng = engine()
    old = [row(toks(300, 90 + k), 5, k) for k in range(4)]
    eng.answer(old)
    held = eng.cache.index.bytes
    real, calls = eng.runner.forward, []

    def once_out(pieces):
        calls.append(len(pieces))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(pieces)

    monkeypatch.setattr(eng.runner, "forward", once_out)
    rows = [row(toks(300, 90), 9, 5), row(toks(250, 99), 6, 6), row(toks(40, 98), 3, 7)]
    res = eng.answer(rows)
    assert all("probs" in r for r in res), res
    assert eng.steps.stats["oom_relieved"] == 1 and eng.cache.index.bytes < held + eng.cache.state_bytes(250)
    check(eng, rows, res)

    def always_out(pieces):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(eng.runner, "forward", always_out)
    res = eng.answer([row(toks(260, 97), 4, 8)])
    assert res[0]["error"]["code"] == "out_of_memory" and "STATECACHE" in res[0]["error"]["message"]


# ---- text rows -------------------------------------------------------------------------------------------------------


def test_text_rows_with_one_state_share_its_tokens(engine):
    eng = engine(settings=CacheSettings())  # the default min_prefix (256)
    state = text_state("ada")
    r1, r2 = {"state": state, "questions": [Q[0]]}, {"state": state, "questions": [Q[1], Q[2]]}
    t1, t2 = (encode_text_row(r, eng.tokenizer, eng.max_row_tokens) for r in (r1, r2))
    n = t1["state_len"]
    assert n == t2["state_len"] and n >= 320 and t1["ids"][:n] == t2["ids"][:n]
    p = n  # the state's end
    res = eng.answer([r1])
    assert paths(res) == ["cold"]
    res2 = eng.answer([r2])
    assert paths(res2) == ["hit"] and res2[0]["reused"] == p and len(res2[0]["probs"]) == 2
    assert [len(x) for x in res2[0]["probs"]] == [2, 4]
    other = {"state": text_state("bob"), "questions": [Q[2]]}
    grown = {"state": text_state("ada", 25), "questions": [Q[0]]}  # five more steps: 100+ more tokens
    res3 = eng.answer([other, grown, other])
    assert paths(res3) == ["cold", "partial", "memo"]
    assert res3[1]["reused"] in (p, (p - 16) - (p - 16) % 64)  # p, or p - tail where its last tokens re-tokenise
    check(eng, [r1, r2, other, grown, other], res + res2 + res3)
    same = eng.answer([{"state": text_state("cy"), "questions": [q]} for q in Q])  # one batch, one new state
    assert paths(same) == ["cold", "hit", "hit"]


# ---- statistics ------------------------------------------------------------------------------------------------------


def test_stats_count_what_happened(engine):
    eng = engine()
    S = toks(300, 30)
    eng.answer([row(S, 10, 1), row(S, 10, 2), row(toks(20, 31), 5, 3), "junk"])  # cold, hit, plain, error
    eng.answer([row(S, 10, 1), row(S + toks(70, 32), 10, 4)])  # memo, partial
    s = eng.stats()
    assert {k: s[k] for k in ("rows", "memo", "plain", "errors", "batches", "hits", "partial", "cold")} == {
        "rows": 6, "memo": 1, "plain": 1, "errors": 1, "batches": 2, "hits": 1, "partial": 1, "cold": 1}
    assert s["tokens_reused"] == 300 + 300
    assert s["tokens_computed"] == 310 + (310 - 300) + 25 + (380 - 300)
    c = s["cache"]
    assert c["rows"] == 3 and c["checkpoints"] == len(eng.cache.index) > 0 and c["bytes"] <= c["mb"] * 2**20
    assert "plain_tokens" not in s


# ---- the score command -----------------------------------------------------------------------------------------------


def test_score_cli_answers_json_lines_in_order(monkeypatch, capsys):
    from statecache.cli import main

    S = toks(300, 40)
    rows = [row(S, 10, 1), None, {"ids": [1, 2], "state_len": 1, "slots": [5], "nopts": [2]}, row(S, 12, 2)]
    lines = [json.dumps(r) if r is not None else '{"ids": [1, 2' for r in rows]
    lines.insert(2, "")  # a blank line is skipped
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["score", "--device", "cpu", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    res = [json.loads(x) for x in out.splitlines()]
    assert len(res) == 4
    assert res[0]["path"] == "cold" and res[0]["reused"] == 0
    assert res[1]["error"]["code"] == "bad_json" and "line 2" in res[1]["error"]["message"]
    assert res[2]["error"]["code"] == "slot_out_of_range"
    assert res[3]["path"] == "hit" and res[3]["reused"] >= 256  # the default min_prefix is 256: p = 256
    assert res[3]["reused"] + res[3]["computed"] == 312
    eng = Engine(device="cpu", dtype="float32")
    check(eng, [rows[0], rows[3]], [res[0], res[3]])
    stats = json.loads(err.strip().splitlines()[-1].removeprefix("statecache: "))
    assert stats["rows"] == 3 and stats["errors"] == 1 and stats["hits"] == 1 and stats["cold"] == 1


def test_score_reads_a_line_as_json_does():
    """statecache score's reader (orjson first) means what json.loads means and fails where it fails; NaN (orjson
    refuses it) goes through json; an int past 64 bits still gets a clear error from the row checks."""
    from statecache.cli import loads_line
    from statecache.rows.check import RowError, check_row

    for text in ['{"ids": [1, 2, 3], "state_len": 2, "slots": [2], "nopts": [4]}', '[1, 2.5, "x", null, true, -7]',
                 '{"x": NaN}', '  {"a": {"b": [1e3, 9223372036854775807]}}  ', '"\\u00e9"']:
        assert json.dumps(loads_line(text)) == json.dumps(json.loads(text))
    for bad in ['{"ids": [1, 2', "", "nul"]:
        with pytest.raises(json.JSONDecodeError):
            loads_line(bad)
    huge = loads_line('{"ids": [5, %d], "state_len": 1, "slots": [1], "nopts": [4]}' % 2**70)
    with pytest.raises(RowError) as e:
        check_row(huge, 1000, 100)
    assert e.value.code in ("bad_type", "id_out_of_range") and "ids[1]" in e.value.message


def test_score_cli_precapture_flag_and_budget_line(monkeypatch, capsys):
    from statecache import cli

    seen = {}

    class Spy(Engine):
        def __init__(self, *a, **kw):
            seen["precapture"] = kw.get("precapture")
            super().__init__(*a, **kw)
            if kw.get("precapture"):  # what a CUDA start reports (the CPU captures no graphs)
                self.precapture_info = {"batch": {"graphs": 7, "seconds": 1.5, "failed": []}}

    monkeypatch.setattr("statecache.engine.Engine", Spy)  # the CLI imports Engine when it runs
    for argv, want in ((["score", "--device", "cpu"], True), (["score", "--device", "cpu", "--no-precapture"], False)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(row(toks(300, 41), 10, 1)) + "\n"))
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        assert seen["precapture"] is want and json.loads(out)["path"] == "cold"
        assert "state cache budget 1024 MiB" in err and "cpu default" in err
        assert ("precaptured 7 graphs in 1.5 s" in err) is want


def test_rows_of_saved_states_run_batched(engine):
    """Rows of states with checkpoints (hits, a grown state) and a new state's first row run in one step; the rows
    behind the new state and the grown one wait a step (they would compute the same state) and then hit."""
    eng = engine()
    a, b, c = toks(300, 21), toks(200, 22), toks(260, 23)
    check(eng, [row(a, 5, 1), row(b, 5, 2)], eng.answer([row(a, 5, 1), row(b, 5, 2)]))
    forwards, steps = eng.runner.stats["forwards"], eng.phases["steps"]
    grown = b + toks(70, 5)  # p 256 from b's 192
    rows = [row(a, 9, 3), row(c, 7, 4), row(grown, 6, 5), row(c, 12, 6), row(a, 20, 7, (3, 5)), row(c, 4, 8),
            row(grown, 11, 9)]
    res = eng.answer(rows)
    assert paths(res) == ["hit", "cold", "partial", "hit", "hit", "hit", "hit"]  # the grown state planted once
    assert eng.phases["steps"] - steps == 2 and eng.runner.stats["forwards"] - forwards == 2
    check(eng, rows, res)


def test_an_engine_without_a_step_loop_is_refused(engine):
    """The step loop is the engine's one runner: no batched runner (batch 0) and a cache aligned off its 64-token
    chunks are refused with what to change."""
    with pytest.raises(ValueError, match="at least one sequence"):
        engine(batch=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        engine(settings=CacheSettings(min_prefix=64, stride=192, align=32))


def test_a_restore_that_cannot_come_back_runs_again_from_nothing(engine, monkeypatch):
    """A row whose checkpoint sits on the host tier and cannot be copied back (the device budget refused it) is given
    back by its step (`retry`), scheduled again (RETRIES_CACHED times) and then run from nothing: answered as the
    uncached forward, path plain."""
    eng = engine(settings=CacheSettings(min_prefix=64, stride=192, mb=1, host_mb=8))
    big, other = toks(550, 15), toks(550, 17)
    eng.answer([row(big, 10, 1)])
    eng.answer([row(other, 10, 2)])  # moves big's checkpoints to the host tier
    assert eng.cache.index.lookup(big, limit=512).tier != DEVICE
    monkeypatch.setattr(eng.cache.index, "promote", lambda c: False)
    rows = [row(big, 12, 3)]
    res = eng.answer(rows)
    assert paths(res) == ["plain"] and res[0]["computed"] == len(rows[0]["ids"])
    assert eng.counts["retried"] == RETRIES_CACHED + 1
    check(eng, rows, res)


def test_a_row_with_more_slots_at_one_position_than_a_piece_holds_runs_in_parts(engine):
    """Six slots at one position (a piece holds 4): the row runs as two rows of the same tokens (the second continues
    from the state the first planted), its answers put back in order, each as the uncached forward's."""
    eng = engine()
    a = toks(300, 71)
    ids = a + toks(10, 72)
    six = {"ids": ids, "state_len": 300, "slots": [309] * 6, "nopts": [2, 3, 4, 5, 6, 7]}
    res = eng.answer([six])
    assert [len(p) for p in res[0]["probs"]] == [2, 3, 4, 5, 6, 7] and eng.counts["split"] == 1
    assert res[0]["path"] == "cold" and res[0]["reused"] + res[0]["computed"] >= len(ids)
    want = eng.uncached([dict(six, state_len=0)])[0]
    assert_close(res[0]["probs"], want)
    again = eng.answer([dict(six, nopts=[7, 6, 5, 4, 3, 2])])  # its state planted: both parts hit
    assert again[0]["path"] == "hit"
    assert_close(again[0]["probs"], eng.uncached([dict(six, state_len=0, nopts=[7, 6, 5, 4, 3, 2])])[0])


def test_a_scheduled_row_is_looked_up_once(engine, monkeypatch):
    """A row is looked up once when it joins the schedule; the scheduler keeps that lookup while the index is
    unchanged."""
    eng = engine()
    a, b = toks(300, 31), toks(200, 32)
    eng.answer([row(a, 5, 1), row(b, 5, 2)])
    ix, calls = eng.cache.index, []
    real = ix.lookup
    monkeypatch.setattr(ix, "lookup", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    rows = [row(a, 9, 3), row(b, 7, 4), row(a, 12, 5)]
    res = eng.answer(rows)
    check(eng, rows, res)
    assert paths(res) == ["hit", "hit", "hit"] and len(calls) == 3  # one per row, none again in its step


def test_hits_ride_beside_a_new_pages_chunks(engine):
    """A new page spreads over several steps (chunks of step_chunk tokens); a hit submitted while it runs rides in
    the next step launched, and is answered when that step is finished (the call after: each call launches a step
    and finishes the one before), long before the page; a bad row is answered at submission."""
    eng = engine(settings=CacheSettings(min_prefix=64, stride=128), step_chunk=128)
    a = toks(300, 31)
    eng.answer([row(a, 5, 1)])
    long_row = row(toks(700, 32), 6, 4)
    assert eng.submit([long_row], ["long"]) == [] and eng.pending() == 1
    launched = eng.steps.stats["steps"]
    done = eng.step()
    assert done == [] and eng.pending() == 1  # the page's first chunk, launched
    hit = row(a, 9, 2)
    now = eng.submit([hit, {"ids": [1]}], ["hit", "bad"])
    assert [t for t, _ in now] == ["bad"] and now[0][1]["error"]["code"]
    assert eng.step() == []  # the hit and the page's second chunk launched; the first chunk finished
    got = dict(eng.step())
    assert list(got) == ["hit"] and got["hit"]["path"] == "hit"
    while eng.pending():
        got.update(eng.step())
    # 640 of state tokens in chunks of 128, then the rest of the state and the question in one piece
    assert got["long"]["path"] == "cold" and eng.steps.stats["steps"] - launched == 6
    # every multiple of the stride, p - tail (684 -> 640) and p (inside the last piece)
    assert sorted(c.pos for c in eng.cache.index.lru_order() if c.group.tokens[:10] == long_row["ids"][:10]) == [
        128, 256, 384, 512, 640, 700]
    check(eng, [hit, long_row], [got["hit"], got["long"]])


def test_answers_are_handed_back_as_their_steps_end(engine):
    """on_result: the bad row at submission, the hit at the end of the first step, the new page (two steps) last;
    the returned list holds every row."""
    eng = engine(step_chunk=256)
    a = toks(300, 51)
    eng.answer([row(a, 5, 1)])
    events = []
    rows = [row(toks(400, 52), 6, 2), row(a, 9, 3), {"ids": [1]}]
    res = eng.answer(rows, on_result=lambda i, r: events.append((i, r.get("path"), "error" in r)))
    check(eng, rows[:2], res[:2])
    assert paths(res[:2]) == ["cold", "hit"]
    assert events == [(2, None, True), (1, "hit", False), (0, "cold", False)]
    seen = []
    assert eng.answer(rows[1:2], on_result=lambda i, r: seen.append(r["path"]))[0]["path"] == "memo"
    assert seen == ["memo"]


def test_gpu_thread_hands_a_hit_back_before_the_new_page_ends():
    """The GPU thread runs a step at a time: a hit drained with a long new page is answered at the end of the
    first step, while the page still has chunks to run."""
    import asyncio

    from statecache.engine import Engine
    from worker.gpu_thread import GpuThread

    eng = Engine(device="cpu", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128),
                 step_chunk=128)
    a = toks(300, 61)
    eng.answer([row(a, 5, 1)])
    gpu = GpuThread(lambda: eng)

    async def go():
        # both rows queued before the thread starts, so they reach the engine together
        t = [gpu.submit(row(toks(700, 62), 6, 2)), gpu.submit(row(a, 9, 3))]
        await asyncio.to_thread(gpu.start)
        hit = await asyncio.wait_for(t[1].result, 10)
        early = not t[0].result.done()
        return hit, await asyncio.wait_for(t[0].result, 20), early

    hit, cold, early = asyncio.run(go())
    assert gpu.stop(5)
    assert hit["path"] == "hit" and cold["path"] == "cold" and early
    assert gpu.counters["batches"] == 1 and gpu.pending() == 0


def test_stats_say_where_the_engine_spent_its_time(engine):
    """Engine.stats()["phases"]: wall seconds of the steps and the rows they finished (what the load benchmark reads
    to see where the time goes); a row with more slots than a piece holds runs through steps too."""
    eng = engine()
    a = toks(300, 51)
    eng.answer([row(a, 5, 1)])  # a new state: planted by its step
    ph = eng.stats()["phases"]
    assert ph["step_rows"] == 1 and ph["steps"] == 1 and ph["step_s"] > 0
    eng.answer([row(a, 9, 2), row(toks(400, 52), 6, 3)])  # a hit, a new state: one step
    ph = eng.stats()["phases"]
    assert ph["step_rows"] == 3 and ph["steps"] == 2
    five = {"ids": a + toks(10, 3), "state_len": 300, "slots": [300, 302, 304, 306, 309], "nopts": [2] * 5}
    eng.answer([five])  # more slots than a piece holds (4): the step cuts its question into two pieces
    ph = eng.stats()["phases"]
    # computed from 0 (the cache takes at most 4 slots): [0, 256) up to its first slot, then the question [256, 309)
    # with four slots and [309, 310) with the fifth
    assert ph["step_rows"] == 4 and ph["steps"] == 5
    st = eng.stats()["steps"]
    assert st["steps"] == 5 and st["pieces"] == 6 and st["failed"] == 0


def test_stats_say_where_start_up_went(engine, caplog):
    """Engine.startup_s: the seconds of each part of building the engine, in the order they ran, in its stats and
    in one log line (what an operator reads to see where a slow start went)."""
    with caplog.at_level(logging.INFO, logger="statecache.engine"):
        eng = engine()
    parts = eng.stats()["startup_s"]
    assert list(parts) == [
        "transformers", "tokenizer", "weights", "compile", "kernels", "runner", "precapture", "budget"]
    assert all(v >= 0 for v in parts.values()) and parts["weights"] > 0
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine built in")]
    assert len(line) == 1 and "tokenizer" in line[0] and "precapture" in line[0]


def test_new_pages_run_in_arrival_order_and_the_rows_behind_them_hit(engine):
    """New pages start first come first served, as far as a step's token budget goes; the rows that share a page
    being computed wait for its checkpoint and hit; every planted state serves the next questions."""
    eng = engine(step_tokens=320, step_chunk=128)
    a, b, c = toks(300, 31), toks(200, 32), toks(260, 33)
    order = []
    rows = [row(a, 5, 1), row(b, 6, 2), row(a, 7, 3), row(c, 8, 4)]
    res = eng.answer(rows, on_result=lambda i, r: order.append(i))
    check(eng, rows, res)
    assert paths(res) == ["cold", "cold", "hit", "cold"]
    assert order[-1] == 3 and order.index(1) < order.index(3)  # c starts after a and b: the budget holds two pages
    again = [row(a, 9, 5), row(b, 9, 6), row(c, 9, 7)]
    res = eng.answer(again)
    check(eng, again, res)
    assert paths(res) == ["hit", "hit", "hit"]


def test_score_timings_count_every_answered_row_by_path(monkeypatch, capsys):
    """`statecache score --timings` prints where the rows' time went, by path; the parts add up."""
    from statecache.cli import main

    S = toks(300, 41)
    rows = [row(S, 10, 1), row(S, 12, 2), row(S, 14, 3), {"ids": [1], "state_len": 1, "slots": [3], "nopts": [2]}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(json.dumps(r) for r in rows) + "\nnot json\n"))
    assert main(["score", "--device", "cpu", "--dtype", "float32", "--timings"]) == 0
    err = capsys.readouterr().err.splitlines()
    tm = json.loads(next(ln for ln in err if ln.startswith("statecache: timings ")).removeprefix("statecache: timings "))
    assert {k: v["rows"] for k, v in tm.items() if "rows" in v} == {"cold": 1, "hit": 2, "error": 1}
    for v in (tm["cold"], tm["hit"]):
        assert v["answer_ms"]["mean"] > 0 and v["gpu_wait_ms"]["mean"] == 0  # no GPU here: all of it is host work
        assert abs(v["answer_host_ms"]["mean"] - (v["answer_ms"]["mean"] - v["gpu_wait_ms"]["mean"])) < 1e-3
    assert tm["line_in_to_answer_out_ms"]["mean"] > 0


def test_the_workers_runner_takes_only_the_shapes_its_steps_can_have():
    """A worker's forwards hold at most a busy step's tokens (a longest piece where the step is shorter) and at most
    the rows it holds (max_jobs, up to the graph bucket that holds them): no graph is captured for more
    (Settings.step_sequences); its steps take the busy budget from three quarters of those rows."""
    from statecache.settings import Settings

    s = Settings.from_env({}).replace(device="cpu")
    e = Engine.from_settings(s)
    r = e.runner
    assert s.step_sequences == min(s.batch, s.max_jobs) == 24 and r.max_batch == 32
    assert r.max_tokens == s.step_tokens_busy == 3072
    assert (e.steps.sched.budget_tokens, e.steps.sched.busy_tokens, e.steps.sched.busy_rows) == (2048, 3072, 18)
    assert len(r.keys()) == 130 and all(B <= r.max_batch and T <= r.max_tokens for B, T, _ in r.keys())
    e = Engine.from_settings(s.replace(step_tokens=300, step_tokens_busy=300, max_jobs=40))
    assert (e.runner.max_batch, e.runner.max_tokens, e.steps.sched.budget_tokens) == (64, 512, 300)
    assert e.steps.sched.busy_tokens is None  # no larger busy budget: one budget
