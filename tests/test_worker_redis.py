"""The service contract through a real Redis, with the real engine on the tiny model: the bare arq
`enqueue_job("answer", row)`, refused payloads, the Client's errors, results without the row, the backlog."""

import asyncio
import pickle
import time

import pytest
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job

import producer
from producer.client import AnswerTimeout, Client, QueueUnavailable, RowRejected, WorkerError
from producer.local_redis import LocalRedis
from statecache.engine import Engine
from statecache.protocol import RESULT_KEY_PREFIX, deserialize, serialize
from tests.harness import InProcessWorker, wait_for
from worker.backlog import Backlog

ROW = {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [2]}
TEXT = {"state": "the page shows a login form", "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}


def run(coro):
    return asyncio.run(coro)


def long_row(state: int, q: int = 0, n: int = 300) -> dict:
    return {"ids": [state] * n + [10 + q], "state_len": n, "slots": [n], "nopts": [3]}


@pytest.fixture(scope="module")
def engine():
    return Engine()


@pytest.fixture
def private_redis():
    """A Redis of this test's own: the worker may serve arq's default queue there."""
    with LocalRedis() as server:
        yield server


async def connect(redis_url, queue_name, **kw):
    return await Client.connect(redis_url, queue_name, **kw)


def test_bare_arq_pool_with_the_msgpack_pair(private_redis, engine):
    """What an agent service writes: create_pool + enqueue_job("answer", row) + job.result(), nothing else set.
    A pickled job (arq's default serialiser) fails with a message naming the fix; the next row is answered."""
    url = private_redis.url
    with InProcessWorker(url, producer.QUEUE_NAME, lambda: engine):

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(url), job_serializer=producer.serialize,
                                     job_deserializer=producer.deserialize)
            pickler = await create_pool(RedisSettings.from_dsn(url))  # arq's default: pickle
            try:
                job = await pool.enqueue_job("answer", long_row(7))
                first = await job.result(timeout=30, poll_delay=0.01)
                stored = await pool.get(RESULT_KEY_PREFIX + job.job_id)
                pickled = await pickler.enqueue_job("answer", long_row(7, 1))
                with pytest.raises(RuntimeError) as refused:
                    await pickled.result(timeout=30, poll_delay=0.01)
                after = await (await pool.enqueue_job("answer", long_row(7, 2))).result(timeout=30, poll_delay=0.01)
                text = await (await pool.enqueue_job("answer", TEXT)).result(timeout=30, poll_delay=0.01)
                return first, stored, str(refused.value), after, text
            finally:
                await pool.aclose(close_connection_pool=True)
                await pickler.aclose(close_connection_pool=True)

        first, stored, refused, after, text = run(main())
    assert first["path"] == "cold" and len(first["probs"][0]) == 3
    want = Engine().answer([long_row(7)])[0]
    assert all(abs(a - b) < 1e-4 for a, b in zip(first["probs"][0], want["probs"][0]))
    assert deserialize(stored)["a"] == []  # the stored result carries no copy of the row
    assert "job_serializer=statecache.protocol.serialize" in refused and "pickle" in refused
    assert after["path"] == "hit" and len(text["probs"][0]) == 2


def test_undecodable_and_oversize_jobs(redis_url, queue_name, engine):
    with InProcessWorker(redis_url, queue_name, lambda: engine, max_job_bytes=4096):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                await client.pool.set("arq:job:junk", b"\xc1 not msgpack")
                await client.pool.zadd(queue_name, {"junk": 1})
                failed = Job("junk", client.pool, queue_name, _deserializer=deserialize)
                with pytest.raises(Exception) as e:
                    await failed.result(timeout=10, poll_delay=0.01)
                with pytest.raises(RowRejected) as big:
                    await client.answer({**ROW, "ids": list(range(2000)), "slots": [1999]})
                return str(e.value), big.value, await client.answer(ROW)

        refused, big, after = run(main())
    assert "msgpack serialiser pair" in refused
    assert big.code == "job_too_large" and "STATECACHE_MAX_JOB_BYTES" in big.message
    assert "probs" in after


def test_bad_rows_raise_row_rejected_and_the_worker_goes_on(redis_url, queue_name, engine):
    with InProcessWorker(redis_url, queue_name, lambda: engine):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                with pytest.raises(RowRejected) as e:
                    await client.answer({**ROW, "ids": [1, 2, 3, 10**6]})
                assert e.value.code == "id_out_of_range" and "ids[3] is outside" in e.value.message
                assert "1000000" not in e.value.message  # the rule, not the value
                with pytest.raises(RowRejected, match="bad_nopts"):
                    await client.answer({**ROW, "nopts": [27]})
                job = await client.pool.enqueue_job("answer", ROW, ROW, _queue_name=queue_name)
                assert (await job.result(timeout=10, poll_delay=0.01))["error"]["code"] == "bad_job"
                with pytest.raises(WorkerError, match="not found"):
                    await client._run("no_such_job", (), 10)
                return await client.answer(ROW), await client.stats()

        result, stats = run(main())
    assert "probs" in result and stats["engine"]["rows"] >= 3 and stats["worker"]["batches"] >= 3
    log = stats["engine"]["step_log"]  # the engine's last steps ride in the stats job's answer (not in its snapshots)
    ms, gap = log["fields"].index("device_ms"), log["fields"].index("gap_ms")
    assert log["steps"] and all(s[ms] > 0 for s in log["steps"])
    assert log["steps"][0][gap] is None and all(s[gap] >= 0 for s in log["steps"][1:])  # from the step before's end


def test_timeout_without_a_worker(redis_url, queue_name):
    async def main():
        async with await connect(redis_url, queue_name, timeout_s=0.3) as client:
            t0 = time.monotonic()
            with pytest.raises(AnswerTimeout, match="is a worker running"):
                await client.answer(ROW)
            return time.monotonic() - t0

    assert run(main()) < 2


def test_expired_job_is_not_run(redis_url, queue_name, engine):
    """A job whose producer gave up expires: a worker started later does not run it."""

    async def main():
        async with await connect(redis_url, queue_name) as client:
            with pytest.raises(AnswerTimeout):
                await client.answer(ROW, timeout_s=0.2)
            await asyncio.sleep(0.3)
            return await client.pool.zrange(queue_name, 0, -1)

    assert len(run(main())) == 1
    with InProcessWorker(redis_url, queue_name, lambda: engine) as w:
        wait_for(lambda: w.worker.jobs_failed == 1, 10, "the expired job")
        assert w.gpu.counters["rows"] == 0


def test_client_raises_its_own_error_through_an_outage(engine):
    """Redis goes away: the Client keeps trying until its timeout, then raises QueueUnavailable (an AnswerTimeout)."""
    with LocalRedis() as server:

        async def main():
            client = await connect(server.url, "statecache:test:outage", timeout_s=1.5)
            server.stop()
            t0 = time.monotonic()
            try:
                with pytest.raises(QueueUnavailable, match="Redis did not answer within 1.5 s") as e:
                    await client.answer(ROW)
            finally:
                await client.close()
            with pytest.raises(QueueUnavailable):
                await connect(server.url, "statecache:test:outage", timeout_s=0.5)
            return time.monotonic() - t0, e.value

        elapsed, err = run(main())
    assert 1.4 < elapsed < 5 and isinstance(err, AnswerTimeout) and isinstance(err, producer.ClientError)


def test_backlog_counts_ready_jobs_not_taken(redis_url, queue_name):
    async def main():
        pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize, job_deserializer=deserialize)
        try:
            for _ in range(12):
                await pool.enqueue_job("answer", ROW, _queue_name=queue_name)
            await pool.enqueue_job("answer", ROW, _queue_name=queue_name, _defer_by=60)  # not ready
            backlog = Backlog(pool, queue_name)
            assert await backlog.read() == 12
            backlog.in_flight = 5
            assert await backlog.read() == 7 and backlog.waiting(2) == 9
        finally:
            await pool.aclose(close_connection_pool=True)

    run(main())


def test_pickled_payload_never_unpickled():
    """A job payload that would run code if unpickled is refused by the msgpack deserialiser."""

    class Boom:
        def __reduce__(self):
            return (exec, ("import builtins; builtins.STATECACHE_PWNED = True",))

    import builtins

    with pytest.raises(Exception):
        deserialize(pickle.dumps({"f": "answer", "a": [Boom()], "k": {}, "t": 1, "et": 0}))
    assert not hasattr(builtins, "STATECACHE_PWNED")


def test_profile_a_running_worker(redis_url, queue_name, engine):
    """The `profile` job: torch.profiler over the engine's thread while rows are answered; tables of ops and the
    engine's phases over that stretch; bad arguments get an error result, not a dead worker."""
    with InProcessWorker(redis_url, queue_name, lambda: engine):

        async def main():
            async with await connect(redis_url, queue_name) as client:
                prof = asyncio.ensure_future(client.profile(1.0, rows=15))
                await asyncio.sleep(0.2)
                answers = [await client.answer(long_row(200 + 64 * k, 5)) for k in range(3)]
                got = await prof
                with pytest.raises(RowRejected, match="seconds in"):
                    await client.profile(0)
                return answers, got, await client.answer(ROW)

        answers, got, after = run(main())
    assert all("probs" in a for a in answers) and "probs" in after
    assert got["seconds"] == 1.0 and "aten::" in got["host_table"] and "Name" in got["device_table"]
    assert got["phases"]["step_rows"] >= 1


def test_no_password_in_the_clients_errors(caplog):
    """A Client against an unreachable Redis whose URL carries a password: QueueUnavailable (and the log) name the
    Redis without it."""
    from producer.local_redis import free_port

    url = f"redis://:s3cr3t-pw@127.0.0.1:{free_port()}/0"  # nothing listens there

    async def main():
        with pytest.raises(QueueUnavailable) as e:
            await connect(url, "statecache:test:nopw", timeout_s=0.5)
        return e.value

    with caplog.at_level("WARNING"):
        err = run(main())
    assert "redis://:***@127.0.0.1" in str(err), str(err)
    assert "s3cr3t" not in str(err) and "s3cr3t" not in repr(err.args) and "s3cr3t" not in caplog.text


def test_redact_hides_every_form_of_credentials():
    from statecache.protocol import redact
    from statecache.settings import Settings

    assert redact("redis://:pw1@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://user:pw1@h/0") == "rediss://user:***@h/0"
    assert redact("redis://pw1@h/0") == "redis://***@h/0"  # a lone user-info part may be a password
    assert redact("redis://:p@w1@h/0") == "redis://:***@h/0"  # an unescaped @ in the password
    assert redact("redis://h/0?password=pw1&db=1") == "redis://h/0?password=***&db=1"
    assert redact("failed at redis://:pw1@a/0, then unix://:pw1@/tmp/r.sock") == \
        "failed at redis://:***@a/0, then unix://:***@/tmp/r.sock"
    assert redact("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert "pw1" not in repr(Settings(redis_url="redis://:pw1@h/0"))


def test_the_clients_jobs_outlive_a_run_again_after_a_kill(redis_url, queue_name, monkeypatch):
    """With the default settings a Client's job lives (and the Client waits) long enough for a killed worker's job
    to run again: its in-progress mark (arq's, job timeout + 10 s) expires, then it runs again (a job timeout)."""
    from arq.worker import Worker

    from statecache.protocol import JOB_KEY_PREFIX
    from statecache.settings import Settings
    from worker.settings import worker_settings

    monkeypatch.delenv("STATECACHE_JOB_TIMEOUT_S", raising=False)
    settings = Settings()
    mark_s = Worker(**worker_settings(settings)).in_progress_timeout_s  # arq's own figure
    needed_s = mark_s + settings.job_timeout_s

    async def main():
        async with await Client.connect(redis_url, queue_name) as client:  # no worker: the job waits
            task = asyncio.ensure_future(client.answer(ROW))
            key = await asyncio.wait_for(_job_key(client), 10)
            ttl_ms = await client.pool.pttl(key)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return ttl_ms, client.timeout_s

    async def _job_key(client):  # the Client's job, once it is in Redis
        while not (client._waiters and await client.pool.exists(key := JOB_KEY_PREFIX + next(iter(client._waiters)))):
            await asyncio.sleep(0.01)
        return key

    ttl_ms, timeout_s = run(main())
    assert ttl_ms >= (needed_s - 1) * 1000 and timeout_s >= needed_s, (ttl_ms, timeout_s, needed_s)
    from statecache.protocol import IN_PROGRESS_EXTRA_S, job_lifetime_s

    assert mark_s == settings.job_timeout_s + IN_PROGRESS_EXTRA_S  # the protocol's figure is arq's
    assert job_lifetime_s(settings.job_timeout_s) == needed_s


def test_the_client_is_told_at_once_when_redis_refuses_its_password():
    """A wrong password is no outage to the Client either: QueueRefused at once, naming the URL without it."""
    from producer.client import QueueRefused

    with LocalRedis(password="right-pw") as server:
        wrong = server.url.replace("right-pw", "wrong-pw")

        async def main():
            t0 = time.monotonic()
            with pytest.raises(QueueRefused) as e:
                await connect(wrong, "statecache:test:refused", timeout_s=30)
            return time.monotonic() - t0, str(e.value)

        took_s, message = run(main())
    assert took_s < 5 and "redis://:***@127.0.0.1" in message and "wrong-pw" not in message, (took_s, message)
