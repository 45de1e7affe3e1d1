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
from statecache.settings import Settings
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
        # a batch is counted when its engine call ends, and a row answered early (a hit before the batch's other
        # work: worker.gpu_thread) reaches its agent before that: the last batch may be counted after its row
        batches = ("statecache:batch_size_rows_sum", frozenset())
        wait_for(lambda: scrape(port)[1].get(batches) == len(rows), 10, "every batch counted")
        scrapes[-1] = scrape(port)
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


def test_a_stop_during_a_jobs_end_still_shuts_down(redis_url, queue_name, monkeypatch):
    """A stop whose cancellation reaches a job after its function, in our after_job_end hook (publishing the job
    done, held here), used to end arq's close() with that CancelledError: on_shutdown never ran (the router kept its
    queue, the GPU thread ran on, the health key stayed) and the worker's run raised. It stops cleanly now."""
    from arq.connections import RedisSettings, create_pool

    from statecache.protocol import RESULT_KEY_PREFIX, deserialize, serialize, workers_key
    from worker.resilient import ResilientRedis

    async def held(self, *args, **kwargs):
        await asyncio.sleep(60)

    monkeypatch.setattr(ResilientRedis, "publish", held)
    r = redis_sync.Redis.from_url(redis_url)
    try:
        with InProcessWorker(redis_url, queue_name, Engine) as w:

            async def enqueue():
                pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                         job_deserializer=deserialize, default_queue_name=queue_name)
                try:
                    return (await pool.enqueue_job("answer", long_row(1))).job_id
                finally:
                    await pool.aclose(close_connection_pool=True)

            job_id = run(enqueue())
            wait_for(lambda: r.exists(RESULT_KEY_PREFIX + job_id), 60, "the job's result")
            time.sleep(0.2)  # in the held publish
            gpu = w.gpu
        assert w.error is None, w.error_trace
        assert not gpu._thread.is_alive() and not r.exists(health_key(queue_name))
        assert not r.smembers(workers_key(queue_name))  # the router handed its queue back and left
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


def test_metrics_listen_on_the_configured_address(redis_url, queue_name):
    """STATECACHE_METRICS_ADDR: the real worker's metrics socket is bound there and nowhere else (loopback by
    default; 127.0.0.2 is another loopback address, so a scrape of 127.0.0.1 is refused when bound to it)."""
    assert Settings().metrics_addr == "127.0.0.1"
    port = free_port()
    with InProcessWorker(redis_url, queue_name, Engine, metrics_port=port, metrics_addr="127.0.0.2") as w:
        assert w.metrics.server.server_address[0] == "127.0.0.2"
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as resp:
            assert b"statecache:worker_ready 1.0" in resp.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    port = free_port()
    with InProcessWorker(redis_url, queue_name, Engine, metrics_port=port) as w:  # the default
        assert w.metrics.server.server_address[0] == "127.0.0.1"


def test_no_password_in_the_workers_log(queue_name, tmp_path):
    """A worker on a Redis that requires a password (in REDIS_URL) serves rows; its log names the Redis without
    the password."""
    with LocalRedis(password="s3cr3t-pw") as server:
        proc = WorkerProcess(server.url, queue_name, tmp_path / "w.log").start()
        try:
            async def main():
                async with await Client.connect(server.url, queue_name, timeout_s=60) as client:
                    return await client.answer(plain_text_rows("pw", 1)[0])

            assert "probs" in run(main())
        finally:
            proc.stop()
    log = proc.log()
    assert "redis://:***@127.0.0.1" in log and "s3cr3t" not in log, log


def test_wrong_redis_credentials_stop_the_worker(queue_name, tmp_path):
    """Redis refusing the password is no outage: a worker with a wrong password in REDIS_URL exits at start-up,
    non-zero and quickly, with a message naming REDIS_URL (and not the password); a running worker whose password
    Redis stops accepting exits the same way instead of waiting for Redis forever."""
    with LocalRedis(password="right-pw") as server:
        wrong = server.url.replace("right-pw", "wrong-pw")
        proc = WorkerProcess(server.url, queue_name, tmp_path / "wrong.log", REDIS_URL=wrong).launch()
        t0 = time.monotonic()
        try:
            rc = proc.wait(30)
        finally:
            proc.stop()
        log = proc.log()
        assert rc == 78 and time.monotonic() - t0 < 30, (rc, log)
        assert "Redis refused this worker" in log and "REDIS_URL=redis://:***@127.0.0.1" in log, log
        assert "wrong-pw" not in log and "right-pw" not in log and "Traceback" not in log, log

        proc = WorkerProcess(server.url, queue_name, tmp_path / "later.log").start()
        try:
            r = redis_sync.Redis.from_url(server.url)
            try:
                r.config_set("requirepass", "changed-pw")
                r.execute_command("CLIENT", "KILL", "TYPE", "normal")  # the worker reconnects, with the old password
            finally:
                r.close()
            rc = proc.wait(30)
        finally:
            proc.stop()
        log = proc.log()
        assert rc == 78 and "Redis refused this worker" in log, log
        # the killed connections may read as lost once (a command was in flight: the routing heartbeat, a poll); the
        # reconnect's refusal then stops the worker, never another round of waiting
        after = log.split("Redis refused this worker", 1)[1]
        assert log.count("Redis unreachable") <= 1 and "Redis unreachable" not in after, log


def test_sigkill_with_rows_in_flight_loses_none(queue_name, tmp_path, monkeypatch, capsys):
    """At-least-once for every producer: 20 rows in flight, 6 through the Client and 14 through a bare arq pool,
    when the worker is SIGKILLed; a worker started again answers all 20 (the killed worker's jobs run again once
    arq's in-progress marks expire, and the Client's jobs live that long: statecache.protocol.job_lifetime_s). A
    6 s job timeout (the STATECACHE_JOB_TIMEOUT_S setting, read by the worker and the Client alike) keeps it short."""
    from arq.connections import RedisSettings, create_pool

    from statecache.protocol import IN_PROGRESS_KEY_PREFIX, RESULT_KEY_PREFIX, deserialize, serialize

    job_timeout_s = 6
    monkeypatch.setenv("STATECACHE_JOB_TIMEOUT_S", str(job_timeout_s))  # the Client's default timeout follows it
    rows = plain_text_rows("kill", 20)
    with LocalRedis() as server:
        r = redis_sync.Redis.from_url(server.url)
        first = WorkerProcess(server.url, queue_name, tmp_path / "first.log", STATECACHE_ENGINE="tests.fakes:held_engine",
                              TEST_ENGINE_DELAY_S=60, STATECACHE_JOB_TIMEOUT_S=job_timeout_s,
                              STATECACHE_MAX_JOBS=32).start()  # takes all 20 at once
        again = WorkerProcess(server.url, queue_name, tmp_path / "again.log", STATECACHE_ENGINE="tests.fakes:held_engine",
                              TEST_ENGINE_DELAY_S=0.1, STATECACHE_JOB_TIMEOUT_S=job_timeout_s)
        try:

            async def main():
                pool = await create_pool(RedisSettings.from_dsn(server.url), job_serializer=serialize,
                                         job_deserializer=deserialize)
                async with await Client.connect(server.url, queue_name) as client:
                    bare = [await pool.enqueue_job("answer", row, _queue_name=queue_name) for row in rows[:14]]
                    via_client = [asyncio.ensure_future(client.answer(row)) for row in rows[14:]]
                    await asyncio.to_thread(wait_for, lambda: len(r.keys(IN_PROGRESS_KEY_PREFIX + "*")) == 20, 10,
                                            "all 20 jobs taken")
                    assert not r.keys(RESULT_KEY_PREFIX + "*")  # none answered: all 20 in flight
                    first.signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
                    await asyncio.to_thread(again.start)
                    answers = await asyncio.gather(*via_client, *[job.result(timeout=60, poll_delay=0.05) for job in bare])
                    await pool.aclose(close_connection_pool=True)
                    return answers, client.timeout_s, time.monotonic() - killed_at

            answers, client_timeout_s, took_s = run(main())
        finally:
            first.stop()
            again.stop()
            r.close()
    assert len(answers) == 20 and all("probs" in a for a in answers), answers
    with capsys.disabled():
        print(f"\nSIGKILL with 20 rows in flight (6 Client, 14 bare pool): {sum('probs' in a for a in answers)} of 20 "
              f"answered, the last {took_s:.1f} s after the kill (job timeout {job_timeout_s} s, Client timeout "
              f"{client_timeout_s:g} s)")


def test_a_stuck_engine_makes_the_worker_exit_and_its_rows_go_back(queue_name, tmp_path):
    """The GPU thread hangs inside the engine: the worker stays healthy while the step is younger than
    STATECACHE_ENGINE_STUCK_S, then withdraws its health key, exits with status 70 and a clear log line; the rows
    that waited behind the hung one are back in the queue with their tries given back (arq:retry 0), the hung
    one with its try spent; a healthy worker then answers all three."""
    from arq.connections import RedisSettings, create_pool
    from arq.constants import retry_key_prefix as RETRY_KEY_PREFIX  # arq's own count of a job's tries
    from arq.jobs import Job

    from statecache.protocol import IN_PROGRESS_KEY_PREFIX, deserialize, serialize

    rows = plain_text_rows("hung", 3)
    with LocalRedis() as server:
        r = redis_sync.Redis.from_url(server.url)

        async def enqueue(batch):
            pool = await create_pool(RedisSettings.from_dsn(server.url), job_serializer=serialize,
                                     job_deserializer=deserialize)
            try:
                return [(await pool.enqueue_job("answer", row, _queue_name=queue_name)).job_id for row in batch]
            finally:
                await pool.aclose(close_connection_pool=True)

        proc = WorkerProcess(server.url, queue_name, tmp_path / "stuck.log", STATECACHE_ENGINE="tests.fakes:hung_engine",
                             STATECACHE_ENGINE_STUCK_S=5, STATECACHE_JOB_TIMEOUT_S=30).start()  # 5 s: `--check` starts a
        # Python process, which a busy CI host can take seconds over
        try:
            hung = run(enqueue(rows[:1]))
            wait_for(lambda: " → " in proc.log(), 30, "the first job to start")
            time.sleep(0.5)  # its row is in the engine, which never returns
            behind = run(enqueue(rows[1:]))
            wait_for(lambda: all(r.exists(IN_PROGRESS_KEY_PREFIX + j) for j in behind), 10, "the rows behind it taken")
            assert proc.check() == 0  # healthy: the step is younger than the bound
            rc = proc.wait(30)
        finally:
            proc.stop()
        log = proc.log()
        assert rc == 70 and "the engine is stuck" in log and "exits with status 70" in log, (rc, log)
        assert not r.exists(health_key(queue_name))
        assert r.get(RETRY_KEY_PREFIX + hung[0]) == b"1"  # the hung row's try is spent: it may be what hangs it
        assert [r.get(RETRY_KEY_PREFIX + j) for j in behind] == [b"0", b"0"]  # the waiting rows' are given back
        assert r.zcard(queue_name) == 3 and not r.keys(IN_PROGRESS_KEY_PREFIX + "*")  # all back in the queue

        again = WorkerProcess(server.url, queue_name, tmp_path / "again.log").start()
        try:
            async def results():
                pool = await create_pool(RedisSettings.from_dsn(server.url), job_serializer=serialize,
                                         job_deserializer=deserialize)
                try:
                    return [await Job(j, pool, queue_name, _deserializer=deserialize).result(timeout=60, poll_delay=0.05)
                            for j in hung + behind]
                finally:
                    await pool.aclose(close_connection_pool=True)

            answers = run(results())
        finally:
            again.stop()
            r.close()
    assert all("probs" in a for a in answers), answers


def test_worker_ready_and_the_health_key_follow_the_engines_progress(redis_url, queue_name):
    """In-process, with metrics: `statecache:worker_ready` reads 1 and the health key is up while the engine makes
    progress; once one step has run longer than STATECACHE_ENGINE_STUCK_S both go, and the worker stops."""
    from arq.connections import RedisSettings, create_pool

    from statecache.protocol import deserialize, serialize
    from tests.fakes import GatedEngine

    gated = GatedEngine(Engine())
    gated.gate.clear()
    port = free_port()
    r = redis_sync.Redis.from_url(redis_url)
    try:
        with InProcessWorker(redis_url, queue_name, lambda: gated, metrics_port=port, engine_stuck_s=3,
                             health_interval_s=0.2) as w:
            assert scrape(port)[1][("statecache:worker_ready", frozenset())] == 1

            async def enqueue():
                pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                         job_deserializer=deserialize)
                await pool.enqueue_job("answer", plain_text_rows("ready", 1)[0], _queue_name=queue_name)
                await pool.aclose(close_connection_pool=True)

            run(enqueue())
            wait_for(lambda: gated.entered, 10, "the engine to hang")
            time.sleep(1.0)
            assert r.exists(health_key(queue_name)) and scrape(port)[1][("statecache:worker_ready", frozenset())] == 1
            wait_for(lambda: w.metrics.ready._value.get() == 0, 10, "worker_ready 0")
            wait_for(lambda: not r.exists(health_key(queue_name)), 5, "the health key gone")
            wait_for(lambda: not w._thread.is_alive(), 20, "the worker to stop")
            assert w.worker.ctx.get("stuck")
    finally:
        gated.gate.set()  # the hung GPU thread may end now
        r.close()
