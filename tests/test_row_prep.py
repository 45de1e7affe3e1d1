"""Text rows checked and tokenised off the event loop, once (worker.prepare, Engine.check_aside): routing huge text
rows leaves the worker's event loop free, a routed row is tokenised once in the worker and answers as the engine
answers it, and a remembered row is never used for another row. Real engine (tiny model), real Redis."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import msgpack
import pytest
import redis.asyncio as redis_async
from arq.connections import RedisSettings, create_pool

import statecache.rows.text as text
from statecache.cache.routing import FingerprintLedger
from statecache.protocol import JOB_KEY_PREFIX, deserialize, live_key, private_queue, serialize
from statecache.settings import Settings
from tests.harness import InProcessWorker
from worker.routing import Router

WORDS = "the page shows a login form with a restaurant question and 123 links "


def page(chars: int, seed: int = 0) -> str:
    return (f"{seed} " + WORDS * (chars // len(WORDS) + 1))[:chars]


class EngineGpu:
    """What the router reads of the GPU thread, with a real engine behind it: idle, nothing pending."""

    busy = False

    def __init__(self, engine):
        self.engine = engine

    def pending(self) -> int:
        return 0

    def making_progress(self, stuck_s: float) -> bool:
        return True


@pytest.fixture(scope="module")
def engine():
    from statecache.engine import Engine

    return Engine()


def test_routing_huge_text_rows_leaves_the_event_loop_free(redis_url, engine):
    """Four text rows of a million characters each (a limit raised so that they pass the text bound and are
    tokenised in full, ~0.5 s each here): while the router dispatches them, a probe task on the same loop is never
    held up for long, and the router's heartbeat (a TTL of 1 s) never lapses. Before, the router tokenised them on
    the loop (the probe waited seconds, and the heartbeat lapsed: other workers would have recovered its jobs)."""
    engine.max_row_tokens = 1_000_000
    q = f"statecache:prep:{uuid.uuid4().hex[:10]}"
    settings = Settings(redis_url=redis_url, queue=q, metrics_port=0, route_ttl_s=1.0, health_interval_s=1)
    rows = [{"state": page(1_000_000, i), "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}
            for i in range(4)]

    async def main():
        r = redis_async.Redis.from_url(redis_url)
        try:
            ids = []
            for i, row in enumerate(rows):
                j = f"huge-{i}-{uuid.uuid4().hex[:6]}"
                await r.set(JOB_KEY_PREFIX + j, msgpack.packb({"f": "answer", "a": [row], "k": {}, "t": None,
                                                              "et": int(time.time() * 1000)}))
                await r.zadd(q, {j: int(time.time() * 1000) - 1000})
                ids.append(j)
            router = Router(r, settings, "w0", EngineGpu(engine), FingerprintLedger(engine.cache.s.align))
            await router.beat()
            lags, lapsed, done = [], [], asyncio.Event()

            async def probe():
                while not done.is_set():
                    t = time.perf_counter()
                    await asyncio.sleep(0.01)
                    lags.append(time.perf_counter() - t - 0.01)
                    if not await r.exists(live_key(q, "w0")):
                        lapsed.append(time.perf_counter())

            task = asyncio.create_task(probe())
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            moved = await router.dispatch()
            took = time.perf_counter() - t0
            done.set()
            await task
            mine = {m.decode() for m in await r.zrange(private_queue(q, "w0"), 0, -1)}
            prep = getattr(router, "prep", None)
            if prep is not None:
                prep.close()
            await r.delete(q, private_queue(q, "w0"), *[JOB_KEY_PREFIX + j for j in ids])
            return moved, mine, ids, took, max(lags), prep, lapsed
        finally:
            await r.aclose()

    try:
        moved, mine, ids, took, worst, prep, lapsed = asyncio.run(main())
    finally:
        engine.max_row_tokens = 32768
    print(f"routing took {took:.2f} s, the loop's worst wait {worst:.3f} s")
    assert worst < 0.5, f"the event loop was held up {worst:.2f} s while routing took {took:.2f} s"
    assert not lapsed, "the heartbeat lapsed while the rows were tokenised"  # it beat meanwhile (TTL 1 s)
    assert moved == 4 and mine == set(ids)
    assert prep.counts["checked"] == 4  # each row checked (tokenised) once, and remembered for its job here


def test_the_bound_refuses_a_huge_page_without_tokenising(engine, monkeypatch):
    """A 2.1 M-character page at the default limit (32768 tokens) is too_long at once: the tokenizer is never
    called (before, a page under 64 characters per token of the limit was tokenised in full, twice)."""
    calls = []
    real = text._plain_ids
    monkeypatch.setattr(text, "_plain_ids", lambda *a: calls.append(1) or real(*a))
    row = {"state": page(2_090_000), "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}
    (res,) = engine.answer([row])
    assert res["error"]["code"] == "too_long" and "characters" in res["error"]["message"]
    assert calls == [], f"the tokenizer ran {len(calls)} times"
    checked = engine.check_aside(row)
    assert checked.row is None and checked.error == (res["error"]["code"], res["error"]["message"]) and calls == []


def test_the_bound_never_refuses_a_row_that_fits(engine):
    """The bound is exact in its own terms: a text made of the vocabulary's token that covers the most characters of
    a class, `limit` times over (which that token alone would write in `limit` tokens), is not refused at `limit`
    tokens; one more time is."""
    bound = engine._text_bound(engine.tokenizer)
    vocab = engine.tokenizer.backend_tokenizer.get_vocab()
    decode = text._byte_decoder()
    for c, k in enumerate(bound.per_token):
        best = max((t for t in vocab if all(ch in decode for ch in t)),
                   key=lambda t: text._counts(bytes(decode[ch] for ch in t))[c])
        s = bytes(decode[ch] for ch in best).decode("utf-8", "replace")
        n = text._counts(s.encode())[c]
        if n != k:  # a token of partial UTF-8 (decoded with replacement characters): not a whole text
            continue
        limit = 50
        body = s * limit
        assert bound.refusal([body], limit) is None
        assert bound.refusal([body + s], limit) is not None


def test_the_bound_holds_for_texts_of_every_class(engine):
    """tokens >= n[c] / K[c] for every class c, on texts of letters, whitespace runs, punctuation runs, digits,
    non-ASCII and mixtures: the inequality the bound stands on."""
    bound = engine._text_bound(engine.tokenizer)
    texts = [page(5000), " " * 5000, "=" * 3000 + "-" * 3000, "1234567890" * 300, "ünïcødé 東京 " * 300,
             "\n\n\t  " * 700, "".join(chr(32 + i % 95) for i in range(4000)), "e\u0301" * 500]
    for t in texts:
        tokens = len(text._plain_ids(engine.tokenizer, t, set()))
        for n, k in zip(bound.counts([t]), bound.per_token):
            assert tokens * k >= n, (t[:20], n, k, tokens)


def test_a_routed_text_row_is_tokenised_once_and_answers_as_before(redis_url, queue_name, monkeypatch):
    """Through a real worker: a text row routed and answered is tokenised once in all (the router's tokens go to
    the job; the engine does not tokenise it again), and its answer is the engine's own for the raw row."""
    from statecache.engine import Engine

    calls = []
    real = text._plain_ids
    monkeypatch.setattr(text, "_plain_ids", lambda *a: calls.append(threading.current_thread().name) or real(*a))
    row = {"state": page(6000, 7), "questions": [{"text": "Log in?", "options": ["yes", "no", "later"]},
                                                 {"text": "Which link?", "options": ["home", "help"]}]}
    reference = Engine()
    calls.clear()
    (want,) = reference.answer([row])
    once = len(calls)
    assert once > 0 and "probs" in want
    with InProcessWorker(redis_url, queue_name, Engine) as w:

        async def ask():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=queue_name,
                                     job_serializer=serialize, job_deserializer=deserialize)
            try:
                calls.clear()
                job = await pool.enqueue_job("answer", row)
                return await job.result(timeout=60)
            finally:
                await pool.aclose()

        got = asyncio.run(ask())
        assert len(calls) == once, f"tokenised {len(calls)} pieces (threads {set(calls)}), once is {once}"
        assert all(name.startswith("statecache-rows") for name in calls)  # the row thread, never the loop's
        assert w.worker.ctx["rows"].counts == {"checked": 1, "reused": 1}
    assert len(got["probs"]) == len(want["probs"]) == 2
    for g, e in zip(got["probs"], want["probs"]):
        assert g == pytest.approx(e, abs=1e-6)


def test_a_remembered_row_is_never_used_for_another_row(engine):
    """The memo is keyed by the row's content: a job whose row differs (same job id or not) is checked afresh."""
    from worker.prepare import RowPrep, digest

    prep = RowPrep(EngineGpu(engine))
    a = {"state": page(3000, 1), "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}
    b = {"state": page(3000, 2), "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}

    async def main():
        key, checked = await prep.run(prep.check_one, a)
        prep.remember(key, checked)
        got_b = await prep.take(b)
        got_a = await prep.take(dict(a))
        return checked, got_a, got_b

    try:
        checked, got_a, got_b = asyncio.run(main())
    finally:
        prep.close()
    own_b = engine.check_aside(b)
    assert digest(a) != digest(b)
    assert list(got_b.row["ids"]) == list(own_b.row["ids"]) != list(checked.row["ids"])
    assert got_a.row is checked.row and got_a.raw is not None  # the equal row reuses its tokens
    assert prep.counts == {"checked": 2, "reused": 1}
