"""A job the router moves to its own worker's queue starts at once (worker.jobs._start_routed_jobs_at_once), not at
arq's next poll of that queue: as many as arq has slots free, through arq's own start transaction, and none once
arq stops picking jobs. A real Router and a real arq Worker (not polling: its poll would start the jobs itself) on
a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as redis_async
from arq.worker import Worker, func

from statecache.cache.routing import FingerprintLedger
from statecache.protocol import IN_PROGRESS_KEY_PREFIX, JOB_KEY_PREFIX, deserialize, private_queue, serialize
from statecache.settings import Settings
from tests.harness import IdleGpu, answer_job
from worker.jobs import _start_routed_jobs_at_once
from worker.routing import Router


def test_jobs_routed_here_start_without_waiting_for_arqs_poll(redis_url):
    q = f"statecache:start:{uuid.uuid4().hex[:10]}"
    settings = Settings(redis_url=redis_url, queue=q, metrics_port=0, route_ttl_s=60, route_grace_s=0,
                        health_interval_s=1)
    release = asyncio.Event()
    ran: list[dict] = []

    async def answer(ctx, row):  # holds its arq slot until released
        ran.append(row)
        await release.wait()
        return {"ok": True}

    async def main():
        r = redis_async.Redis.from_url(redis_url)
        ids = [f"j{n}-{uuid.uuid4().hex[:6]}" for n in range(5)]
        try:
            arq_worker = Worker(functions=[func(answer, name="answer")], redis_pool=r, queue_name=private_queue(q, "w0"),
                                max_jobs=2, poll_delay=3600, job_serializer=serialize, job_deserializer=deserialize,
                                handle_signals=False, keep_result=5)
            router = Router(r, settings, "w0", IdleGpu(), FingerprintLedger(64))
            _start_routed_jobs_at_once(arq_worker, router)
            await router.beat()
            for n, j in enumerate(ids[:3]):
                await r.set(JOB_KEY_PREFIX + j, answer_job(n))
                await r.zadd(q, {j: int(time.time() * 1000) - 1000})
            assert await router.dispatch() == 3  # all three to w0, the one live worker
            for _ in range(1000):  # up to 10 s
                if len(ran) == 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            started = {j for j in ids[:3] if await r.exists(IN_PROGRESS_KEY_PREFIX + j)}
            assert len(ran) == 2 and len(started) == 2 and set(arq_worker.tasks) == started  # two slots, two started
            left = set(ids[:3]) - started
            assert {m.decode() for m in await r.zrange(private_queue(q, "w0"), 0, -1)} >= left  # the third waits

            arq_worker.allow_pick_jobs = False  # a drain: nothing new starts
            release.set()
            await asyncio.gather(*arq_worker.tasks.values())
            for n, j in enumerate(ids[3:], 3):
                await r.set(JOB_KEY_PREFIX + j, answer_job(n))
                await r.zadd(q, {j: int(time.time() * 1000) - 1000})
            assert await router.dispatch() == 2
            await asyncio.sleep(0.2)
            assert len(ran) == 2 and not any([await r.exists(IN_PROGRESS_KEY_PREFIX + j) for j in ids[3:]])
        finally:
            keys = [k async for k in r.scan_iter(match=f"*{q}*")]
            keys += [p + j for j in ids for p in (JOB_KEY_PREFIX, IN_PROGRESS_KEY_PREFIX, "arq:retry:", "arq:result:")]
            await r.delete(*keys)
            await r.aclose()

    asyncio.run(main())


def test_a_row_sent_through_the_client_wakes_the_router(redis_url):
    """producer.Client announces each job it enqueues (the enqueued channel); the router's loop, napping between
    rounds, wakes at once and routes it; here it starts at once too. Polls of an hour (the router's and arq's)
    leave the announcement as the only way the row could be answered within the test."""
    from producer.client import Client

    q = f"statecache:wake:{uuid.uuid4().hex[:10]}"
    settings = Settings(redis_url=redis_url, queue=q, metrics_port=0, route_ttl_s=60, route_grace_s=0,
                        health_interval_s=1, poll_delay_s=3600)
    row = {"ids": list(range(10, 90)), "state_len": 70, "slots": [79], "nopts": [3]}

    async def answer(ctx, row):
        return {"probs": [[1.0, 0.0, 0.0]], "path": "hit", "echo": row["state_len"]}

    async def main():
        r = redis_async.Redis.from_url(redis_url)
        arq_worker = Worker(functions=[func(answer, name="answer")], redis_pool=r, queue_name=private_queue(q, "w0"),
                            max_jobs=4, poll_delay=3600, job_serializer=serialize, job_deserializer=deserialize,
                            handle_signals=False, keep_result=5)
        router = Router(r, settings, "w0", IdleGpu(), FingerprintLedger(64))
        _start_routed_jobs_at_once(arq_worker, router)
        try:
            await router.start()  # its first round finds nothing, then it naps (an hour at most)
            await asyncio.sleep(0.3)
            async with await Client.connect(redis_url, q, timeout_s=30) as client:
                results = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    results.append((await asyncio.wait_for(client.answer(row), 20), time.perf_counter() - t0))
            assert all(res["echo"] == 70 for res, _ in results)
        finally:
            await router.close()
            await asyncio.gather(*arq_worker.tasks.values(), return_exceptions=True)
            keys = [k async for k in r.scan_iter(match=f"*{q}*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()
        return results

    results = asyncio.run(main())
    print("answered in " + ", ".join(f"{s * 1e3:.1f} ms" for _, s in results))
