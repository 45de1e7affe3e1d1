"""Workers coming and going on one Redis (issue 32): real worker processes on the tiny model, agents sending rows
through a bare arq pool while one worker is SIGTERMed and another SIGKILLed; a key of arq's of the wrong Redis type
(a hash at arq:retry:<id>) fails its job without the worker exiting."""

from __future__ import annotations

import asyncio
import signal
import time

import msgpack
import redis as redis_sync
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job

from statecache.protocol import (JOB_KEY_PREFIX, RETRY_KEY_PREFIX, deserialize, draining_key, live_key, private_queue,
                                 serialize, workers_key)
from tests.harness import WorkerProcess, wait_for
from tests.test_routing import agent_state, row, start_workers


def test_a_wrong_type_retry_key_fails_its_job_and_the_worker_serves_on(redis_url, queue_name, tmp_path):
    """A hash at arq:retry:<id> made arq's run_job raise WRONGTYPE out of the job's task, and the worker exited 1, on
    every restart. Now that job fails (its result says why) and the worker answers the others."""
    r = redis_sync.Redis.from_url(redis_url)
    job = {"f": "answer", "a": [row(agent_state(1, 100), 0)], "k": {}, "t": None, "et": int(time.time() * 1000)}
    r.set(JOB_KEY_PREFIX + "bad-retry", msgpack.packb(job, use_bin_type=True))
    r.hset(RETRY_KEY_PREFIX + "bad-retry", mapping={"n": 1})
    r.zadd(queue_name, {"bad-retry": 1000})
    w = WorkerProcess(redis_url, queue_name, tmp_path / "w.log", STATECACHE_WORKER_ID="w", OMP_NUM_THREADS="1")
    try:
        w.start()

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            try:
                jobs = [await pool.enqueue_job("answer", row(agent_state(2, 100), q)) for q in range(8)]
                good = [await j.result(timeout=60, poll_delay=0.02) for j in jobs]
                try:
                    bad = await Job("bad-retry", pool, queue_name, _deserializer=deserialize).result(timeout=30, poll_delay=0.02)
                except Exception as e:  # noqa: BLE001 - the failed job's exception
                    bad = e
                return good, bad
            finally:
                await pool.aclose()

        good, bad = asyncio.run(main())
        assert w.proc.poll() is None, w.log()[-3000:]
        assert all("probs" in g for g in good), good
        assert not isinstance(bad, dict) and "could not be used" in str(bad), bad
        assert "WRONGTYPE" in w.log()
    finally:
        w.stop()
        r.close()


def test_three_workers_one_sigtermed_one_sigkilled_while_agents_send_lose_no_row(redis_url, queue_name, tmp_path):
    """Issue 32, 1: three workers, 12 agents x 8 rows through a bare pool. A third of the way in one worker is
    SIGTERMed: from that moment its heartbeat is a draining one (nothing is routed to it, its queued rows go back);
    two thirds in, another is SIGKILLed. Every row is answered; the stopped worker exits on its own, its queue empty."""
    names = ["a", "b", "c"]
    procs = dict(zip(names, start_workers(redis_url, queue_name, tmp_path, names, STATECACHE_MAX_JOBS=2,
                                          STATECACHE_DRAIN_S=20)))
    r = redis_sync.Redis.from_url(redis_url)
    agents, per = 12, 8
    try:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            answered: list[dict] = []

            async def agent(a: int):
                state = agent_state(200 + a)
                for q in range(per):
                    j = await pool.enqueue_job("answer", row(state, q))
                    answered.append(await j.result(timeout=120, poll_delay=0.02))

            try:
                tasks = [asyncio.ensure_future(agent(a)) for a in range(agents)]
                await asyncio.to_thread(wait_for, lambda: len(answered) >= agents * per // 3, 120, "a third answered")
                procs["a"].signal(signal.SIGTERM)
                told = time.monotonic()

                def draining():
                    return not r.exists(live_key(queue_name, "a")) and r.exists(draining_key(queue_name, "a"))

                await asyncio.to_thread(wait_for, lambda: draining() or procs["a"].proc.poll() is not None, 10,
                                        "a's heartbeat to turn draining")
                took_s = time.monotonic() - told
                await asyncio.to_thread(wait_for, lambda: len(answered) >= 2 * agents * per // 3, 120, "two thirds")
                procs["b"].signal(signal.SIGKILL)
                await asyncio.gather(*tasks)
                return answered, took_s
            finally:
                await pool.aclose()

        answered, took_s = asyncio.run(main())
        assert len(answered) == agents * per and all("probs" in x for x in answered), answered
        assert procs["a"].wait(30) == 0, procs["a"].log()[-3000:]
        assert not r.zcard(private_queue(queue_name, "a"))
        wait_for(lambda: not r.zcard(private_queue(queue_name, "b")) and b"b" not in r.smembers(workers_key(queue_name)),
                 10, "the killed worker recovered")
        print(f"SIGTERM a (draining within {took_s:.2f} s), SIGKILL b: {len(answered)} of {agents * per} answered")
    finally:
        for p in procs.values():
            p.stop()
        r.close()
