"""The worker and the producer library through a real Redis, with the fake engine (fast, no torch)."""

import asyncio
import logging
import pickle
import time

import pytest
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job

from producer.client import AnswerTimeout, Client, RowRejected, WorkerError
from producer.serial import deserialize, serialize
from tests.fakes import FakeEngine, fake_probs
from tests.harness import InProcessWorker, wait_for
from worker.backlog import Backlog

ROW = {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [2]}
TEXT = {"state": "the page shows a login form", "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}


def run(coro):
    return asyncio.run(coro)


async def connect(redis_url, queue_name, **kw):
    return await Client.connect(redis_url, queue_name, **kw)


def test_answers_through_the_queue(redis_url, queue_name, chatml_tokenizer):
    engine = FakeEngine(tokenizer=chatml_tokenizer)
    with InProcessWorker(redis_url, queue_name, lambda: engine):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                token = await client.answer(ROW)
                text = await client.answer_text(TEXT["state"], [("Log in?", ["yes", "no"])])
                again = await client.answer(TEXT)
                stats = await client.stats()
                return token, text, again, stats

        token, text, again, stats = run(main())
    assert token["probs"] == [fake_probs(ROW["ids"], 3, 2)] and token["path"] == "cold"
    assert text["path"] == "cold" and again["path"] == "memo" and again["probs"] == text["probs"]
    assert stats["engine"]["rows"] == 3 and stats["worker"]["rows"] == 3
    assert engine.threads == {"statecache-gpu"}


def test_concurrent_jobs_meet_in_batches(redis_url, queue_name):
    engine = FakeEngine(delay_s=0.03)
    with InProcessWorker(redis_url, queue_name, lambda: engine):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                rows = [{**ROW, "ids": [s, s, s, q]} for s in range(1, 5) for q in range(8)]
                return await asyncio.gather(*[client.answer(r) for r in rows])

        results = run(main())
    assert len(results) == 32 and all("probs" in r for r in results)
    assert max(n for n, _ in engine.calls) > 1  # rows that waited together went in one engine call


def test_bad_rows_raise_row_rejected_and_the_worker_goes_on(redis_url, queue_name):
    with InProcessWorker(redis_url, queue_name, lambda: FakeEngine(vocab_size=50)):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                with pytest.raises(RowRejected) as e:
                    await client.answer({**ROW, "ids": [1, 2, 3, 50]})
                assert e.value.code == "id_out_of_range" and "ids[3] = 50" in e.value.message
                with pytest.raises(RowRejected, match="bad_nopts"):
                    await client.answer({**ROW, "nopts": [27]})
                # a job with the wrong call shape, enqueued directly
                job = await client.pool.enqueue_job("answer", ROW, ROW, _queue_name=queue_name)
                assert (await job.result(timeout=10, poll_delay=0.01))["error"]["code"] == "bad_job"
                return await client.answer(ROW)

        assert "probs" in run(main())


def test_pickled_job_is_logged_and_skipped(redis_url, queue_name, caplog):
    caplog.set_level(logging.INFO)
    with InProcessWorker(redis_url, queue_name, FakeEngine):

        async def main():
            pickler = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=queue_name)
            try:
                job = await pickler.enqueue_job("answer", ROW, _queue_name=queue_name)  # arq's default: pickle
            finally:
                await pickler.aclose(close_connection_pool=True)
            async with await connect(redis_url, queue_name) as client:
                failed = Job(job.job_id, client.pool, queue_name, _deserializer=deserialize)
                with pytest.raises(Exception) as e:
                    await failed.result(timeout=10, poll_delay=0.01)
                assert "unable to deserialize job" in str(e.value)
                return await client.answer(ROW)

        assert "probs" in run(main())
    assert "deserializing job" in caplog.text and "failed" in caplog.text


def test_timeout_without_a_worker(redis_url, queue_name):
    async def main():
        async with await connect(redis_url, queue_name, timeout_s=0.3) as client:
            t0 = time.monotonic()
            with pytest.raises(AnswerTimeout, match="is a worker running"):
                await client.answer(ROW)
            return time.monotonic() - t0

    assert run(main()) < 2


def test_expired_job_is_a_worker_error(redis_url, queue_name):
    """A job whose producer gave up expires: a worker started later does not run it."""

    async def main():
        async with await connect(redis_url, queue_name) as client:
            with pytest.raises(AnswerTimeout):
                await client.answer(ROW, timeout_s=0.2)
            await asyncio.sleep(0.3)
            job_ids = await client.pool.zrange(queue_name, 0, -1)
            return client, job_ids

    _, job_ids = run(main())
    assert len(job_ids) == 1
    engine = FakeEngine()
    with InProcessWorker(redis_url, queue_name, lambda: engine) as w:
        wait_for(lambda: w.worker.jobs_failed == 1, 10, "the expired job")
    assert engine.calls == []


def test_worker_error_for_failed_job(redis_url, queue_name):
    with InProcessWorker(redis_url, queue_name, FakeEngine):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                with pytest.raises(WorkerError, match="not found"):
                    await client._run("no_such_job", (), 10)

        run(main())


def test_backlog_counts_ready_jobs_not_taken(redis_url, queue_name):
    async def main():
        pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize, job_deserializer=deserialize)
        try:
            for _ in range(12):
                await pool.enqueue_job("answer", ROW, _queue_name=queue_name)
            await pool.enqueue_job("answer", ROW, _queue_name=queue_name, _defer_by=60)  # not ready
            backlog = Backlog(pool, queue_name, threshold_rows=8)
            assert await backlog.read() == 12
            backlog.in_flight = 5
            assert await backlog.read() == 7 and not backlog.backed_up(1) and backlog.backed_up(2)
        finally:
            await pool.aclose(close_connection_pool=True)

    run(main())


def test_pickled_payload_never_unpickled(redis_url, queue_name):
    """A job payload that would run code if unpickled is refused by the msgpack deserialiser."""

    class Boom:
        def __reduce__(self):
            return (exec, ("import builtins; builtins.STATECACHE_PWNED = True",))

    import builtins

    with pytest.raises(Exception):
        deserialize(pickle.dumps({"f": "answer", "a": [Boom()], "k": {}, "t": 1, "et": 0}))
    assert not hasattr(builtins, "STATECACHE_PWNED")
