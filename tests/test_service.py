"""The worker as operators run it, on the tiny model through real Redis: metrics scraped while rows flow, a
Redis restart ridden out, a batch that outlives the drain, readiness only after the engine (and its graphs)
is built, and 16 agents at once."""

import asyncio
import random
import signal
import time
import urllib.request

import pytest
import redis as redis_sync
from prometheus_client.parser import text_string_to_metric_families

from producer.client import Client
from producer.local_redis import LocalRedis, free_port
from statecache.engine import Engine
from statecache.protocol import health_key
from tests.harness import InProcessWorker, WorkerProcess, wait_for

FAMILIES = [
    "statecache:rows", "statecache:row_errors", "statecache:tokens_reused", "statecache:tokens_computed",
    "statecache:cache_used_bytes", "statecache:cache_budget_bytes", "statecache:cache_checkpoints",
    "statecache:cache_evictions", "statecache:graph_captures", "statecache:graph_capture_seconds",
    "statecache:queue_waiting_rows", "statecache:batch_size_rows", "statecache:row_latency_seconds",
    "statecache:queue_time_seconds", "statecache:engine_time_seconds", "statecache:cache_inert",
    "statecache:worker_ready", "statecache:redis_up", "statecache:cache_budget_states_4k",
    "statecache:engine_load_seconds", "statecache:precapture_seconds", "statecache:batched_forwards",
    "statecache:batched_sequences",
]


def run(coro):
    return asyncio.run(coro)


def long_row(state: int, q: int = 0, n: int = 300) -> dict:
    return {"ids": [state] * n + [10 + q], "state_len": n, "slots": [n], "nopts": [3]}


def scrape(port: int) -> tuple[set, dict]:
    """(family names, {(sample name, frozenset(labels)): value})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    names, samples = set(), {}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return names, samples


def test_metrics_scraped_while_rows_flow(redis_url, queue_name):
    port = free_port()
    rows = [long_row(31), long_row(31, 1), long_row(31, 2), long_row(31),  # cold, hit, hit, memo
            {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [2]},  # plain
            {"ids": [5, 6, 7, 8], "state_len": 2, "slots": [3], "nopts": [2]},  # plain
            {"ids": [1, 2, 10**6], "state_len": 0, "slots": [2], "nopts": [2]}]  # error: id_out_of_range
    with InProcessWorker(redis_url, queue_name, Engine, metrics_port=port):
        names, during = scrape(port)
        assert during[("statecache:worker_ready", frozenset())] == 1

        async def main():
            async with await Client.connect(redis_url, queue_name, timeout_s=60) as client:
                scrapes = []
                results = []
                for row in rows:  # one at a time, scraping between: the counts move with the rows
                    try:
                        results.append(await client.answer(row))
                    except Exception as e:  # RowRejected
                        results.append({"error": {"code": e.code}})
                    scrapes.append(await asyncio.to_thread(scrape, port))
                return results, scrapes

        results, scrapes = run(main())
    names, m = scrapes[-1]
    assert set(FAMILIES) <= names, set(FAMILIES) - names
    paths = [r.get("path", "error") for r in results]
    assert paths == ["cold", "hit", "hit", "memo", "plain", "plain", "error"]
    for path in ("memo", "hit", "partial", "cold", "plain", "error"):
        assert m[("statecache:rows_total", frozenset({("path", path)}))] == paths.count(path), path
        count = m.get(("statecache:row_latency_seconds_count", frozenset({("path", path)})), 0)
        assert count == paths.count(path), path
    for k, (_, s) in enumerate(scrapes):  # after the k-th answer, k + 1 rows counted
        assert sum(v for (n, _), v in s.items() if n == "statecache:rows_total") == k + 1
    assert m[("statecache:row_errors_total", frozenset({("code", "id_out_of_range")}))] == 1
    assert m[("statecache:tokens_reused_total", frozenset())] == sum(r.get("reused", 0) for r in results) > 0
    assert m[("statecache:tokens_computed_total", frozenset())] == sum(r.get("computed", 0) for r in results)
    assert m[("statecache:batch_size_rows_sum", frozenset())] == len(rows)
    assert m[("statecache:queue_time_seconds_count", frozenset())] == len(rows)
    assert m[("statecache:engine_time_seconds_count", frozenset())] == len(rows)
    assert m[("statecache:cache_checkpoints", frozenset())] > 0 and m[("statecache:cache_used_bytes", frozenset())] > 0
    assert m[("statecache:cache_budget_bytes", frozenset())] == 1024 * 2**20
    assert m[("statecache:cache_inert", frozenset())] == 0 and m[("statecache:redis_up", frozenset())] == 1


def plain_text_rows(tag: str, n: int) -> list[dict]:
    return [{"state": f"{tag} row {i}: the page shows a form", "questions": [{"text": "Next?", "options": ["a", "b"]}]}
            for i in range(n)]


def test_worker_rides_out_a_redis_restart(tmp_path):
    """Redis (append-only) stops for 3 s while jobs are queued and in flight, then starts again: the worker,
    never restarted, answers every job, and rows sent afterwards too."""
    with LocalRedis(appendonly=True) as server:
        queue = "statecache:test:restart"
        proc = WorkerProcess(server.url, queue, tmp_path / "w.log", STATECACHE_ENGINE="tests.fakes:slow_engine",
                             STATECACHE_MAX_JOBS=2).start()
        try:

            async def main():
                async with await Client.connect(server.url, queue, timeout_s=90) as client:
                    tasks = [asyncio.ensure_future(client.answer(r)) for r in plain_text_rows("before", 8)]
                    await asyncio.to_thread(wait_for, lambda: " → " in proc.log(), 60, "a job in flight")
                    assert not all(t.done() for t in tasks)
                    await asyncio.to_thread(server.stop)
                    await asyncio.sleep(3)
                    assert proc.proc.poll() is None
                    await asyncio.to_thread(server.start)
                    before = await asyncio.gather(*tasks)
                    after = await asyncio.gather(*[client.answer(r) for r in plain_text_rows("after", 3)])
                    return before, after

            before, after = run(main())
            assert proc.proc.poll() is None, proc.log()
            wait_for(lambda: proc.check() == 0, 30, "the worker healthy again")
        finally:
            proc.stop()
    log = proc.log()
    assert all("probs" in r for r in before + after) and len(before) == 8
    assert "Redis unreachable" in log and "Redis is back" in log, log
    assert "Traceback" not in log, log


def test_a_batch_that_outlives_the_drain_exits_cleanly(redis_url, queue_name, tmp_path):
    proc = WorkerProcess(redis_url, queue_name, tmp_path / "w.log", STATECACHE_ENGINE="tests.fakes:stuck_engine",
                         STATECACHE_DRAIN_S=0.5).start()
    try:

        async def main():
            async with await Client.connect(redis_url, queue_name, timeout_s=60) as client:
                await client.pool.enqueue_job("answer", plain_text_rows("stuck", 1)[0], _queue_name=queue_name)

        run(main())
        wait_for(lambda: " → " in proc.log(), 60, "the job to start")
        time.sleep(0.3)  # inside the engine's 30 s batch
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        rc = proc.wait(20)
        exit_s = time.monotonic() - t0
    finally:
        proc.stop()
    log = proc.log()
    assert rc == 0 and exit_s < 10, (rc, exit_s, log)
    assert "still running a batch" in log and "terminate called" not in log and "Traceback" not in log, log
    r = redis_sync.Redis.from_url(redis_url)
    try:
        assert r.zcard(queue_name) == 1  # the row is back in the queue for the next worker
        assert not r.exists(health_key(queue_name))
    finally:
        r.close()


def test_not_ready_before_the_engine_is_built(redis_url, queue_name, tmp_path):
    """The health key (what `arq --check` and the compose file read) appears only after the engine, graphs
    captured, is built: here a construction 2 s longer, as a precapture on a GPU."""
    built_at = tmp_path / "built_at"
    proc = WorkerProcess(redis_url, queue_name, tmp_path / "w.log", STATECACHE_ENGINE="tests.fakes:slow_start_engine",
                         TEST_BUILT_AT=built_at).launch()
    r = redis_sync.Redis.from_url(redis_url)
    unready_polls = 0
    try:
        deadline = time.monotonic() + 120
        while not r.exists(health_key(queue_name)):
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.log()
            unready_polls += 1
            time.sleep(0.02)
        seen_at = time.time()
        assert built_at.exists(), "health key up before the engine was built"
        assert float(built_at.read_text()) <= seen_at
        assert proc.check() == 0
    finally:
        r.close()
        proc.stop()
    assert unready_polls > 50  # at least the 2 s of the slow construction


def agent_trace(seed: int, visits: int = 4):
    """One agent's rows, visit by visit: a goal and steps (kept), a page (grows by an action, 75%, or is
    replaced, 25%), 1-3 questions per visit about the same state."""
    rng = random.Random(seed)
    words = lambda k: [rng.randrange(20, 500) for _ in range(k)]  # noqa: E731
    goal, steps, page = words(60), words(120), words(160)
    for _ in range(visits):
        state = goal + steps + page
        yield [{"ids": state + words(6), "state_len": len(state), "slots": [len(state) + 5], "nopts": [3]}
               for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.75:
            page = page + words(30)
        else:
            steps, page = steps + words(20), words(160)


def test_sixteen_agents_through_the_worker(redis_url, queue_name):
    """16 agents at once, each sending its next row after the previous answer, through Redis and the worker
    with default settings: no job fails and most tokens are reused."""
    with InProcessWorker(redis_url, queue_name, Engine) as w:

        async def agent(client, seed):
            out = []
            for visit in agent_trace(seed):
                for row in visit:
                    out.append(await client.answer(row))
            return out

        async def main():
            async with await Client.connect(redis_url, queue_name, timeout_s=120) as client:
                return await asyncio.gather(*[agent(client, s) for s in range(16)], return_exceptions=True)

        got = run(main())
        failed = w.worker.jobs_failed
    failures = [g for g in got if isinstance(g, BaseException)]
    assert not failures and failed == 0, failures[:3]
    results = [r for rows in got for r in rows]
    reused = sum(r["reused"] for r in results)
    computed = sum(r["computed"] for r in results)
    assert reused / (reused + computed) > 0.5, (reused, computed, [r["path"] for r in results])
