"""The worker's parts without Redis, around the real engine on the tiny model: the GPU thread, the job
functions, the worker's serialiser pair, the metrics."""

import asyncio
import pickle
import threading

import pytest
from arq.worker import Retry

from statecache.engine import Engine
from statecache.protocol import JOB_UNDECODABLE, RemoteJobError, deserialize, serialize
from statecache.settings import Settings
from tests.fakes import GatedEngine
from worker.backlog import Backlog
from worker.gpu_thread import GpuThread, Stopping
from worker.jobs import answer, import_callable, undecodable
from worker.metrics import WorkerMetrics, engine_figures
from worker.serial import JobRefused, job_deserializer, job_serializer

ROW = {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [2]}
SETTINGS = Settings(metrics_port=0)


def row(state: int, q: int = 0, n: int = 300) -> dict:
    """A row of a state of `n` tokens (cacheable past the tiny model's 256-token minimum) and one question."""
    return {"ids": [state] * n + [10 + q], "state_len": n, "slots": [n], "nopts": [3]}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engine():
    return Engine()


async def entered(gated: GatedEngine, n: int = 1) -> None:
    """Wait until the thread has taken `n` batches into the (gated) engine."""
    for _ in range(1000):
        if gated.entered >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the GPU thread never reached the engine")


def started(engine, **kw) -> GpuThread:
    gpu = GpuThread(lambda: engine, **kw)
    gpu.start()
    return gpu


def test_rows_wait_on_one_thread_and_come_back_in_order(engine):
    gated = GatedEngine(engine)
    gated.gate.clear()
    gpu = started(gated)

    async def main():
        first = asyncio.ensure_future(gpu.answer(row(101)))
        await entered(gated)  # the first row is in the engine, held at the gate
        rest = [asyncio.ensure_future(gpu.answer(row(s, q))) for s in (102, 103) for q in range(3)]
        await asyncio.sleep(0.05)  # the thread is held on the first row; the rest queue up
        gated.gate.set()
        return [await first] + list(await asyncio.gather(*rest))

    results = run(main())
    assert gpu.stop(5)
    assert gated.threads == {"statecache-gpu"}
    assert [n for n, _ in gated.calls] == [1, 6]  # everything that was ready went in one call
    assert [r["path"] for r in results] == ["cold", "cold", "hit", "hit", "cold", "hit", "hit"]
    assert gpu.counters["batches"] == 2 and gpu.counters["largest_batch"] == 6
    direct = Engine()
    assert results[3]["probs"][0] == pytest.approx(direct.answer([row(102, 2)])[0]["probs"][0], abs=1e-5)


def test_waiting_rows_reach_the_engine(engine):
    seen = []
    gated = GatedEngine(engine)
    gated.gate.clear()
    gpu = started(gated, waiting=lambda pending: seen.append(pending) or pending + 10)

    async def main():
        tasks = [asyncio.ensure_future(gpu.answer(row(200)))]
        await entered(gated)  # the first row's batch is blocked in the engine
        tasks += [asyncio.ensure_future(gpu.answer(row(s))) for s in range(201, 205)]
        await asyncio.sleep(0.05)
        gated.gate.set()
        return await asyncio.gather(*tasks)

    results = run(main())
    gpu.stop(5)
    # the first batch saw 4 rows queued behind it (when it asked, after the gate) or none; the second none
    assert gated.calls[-1] == (4, 10) and seen[-1] == 0
    assert [r["path"] for r in results[1:]] == ["cold"] * 4  # a backlog does not send new states plain


def test_engine_exception_costs_only_the_bad_row(engine, caplog):
    gpu = started(GatedEngine(engine, fail_when=lambda r: r["ids"][0] == 5))
    bad = {"ids": [5, 6], "state_len": 1, "slots": [1], "nopts": [2]}

    async def main():
        return await asyncio.gather(*[gpu.answer(r) for r in (row(301), bad, row(302))])

    good1, err, good2 = run(main())
    gpu.stop(5)
    assert err["error"]["code"] == "internal" and "engine failure (test)" in err["error"]["message"]
    assert "probs" in good1 and "probs" in good2
    assert gpu.counters["engine_errors"] >= 1
    assert "engine failed" in caplog.text


def test_bad_rows_get_error_results(engine):
    gpu = started(engine)

    async def main():
        return await asyncio.gather(gpu.answer({**ROW, "ids": [1, 2, 3, 10**6]}), gpu.answer(ROW))

    bad, good = run(main())
    gpu.stop(5)
    assert bad["error"]["code"] == "id_out_of_range" and "probs" in good


def test_call_runs_on_the_thread_and_cancelled_rows_are_skipped(engine):
    gated = GatedEngine(engine)
    gated.gate.clear()
    gpu = started(gated)

    async def main():
        blocker = asyncio.ensure_future(gpu.answer(row(401)))
        await entered(gated)
        doomed = asyncio.ensure_future(gpu.answer(row(402)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        name = asyncio.ensure_future(gpu.call(lambda e: threading.current_thread().name))
        await asyncio.sleep(0.01)
        gated.gate.set()
        return await blocker, await name

    _, name = run(main())
    gpu.stop(5)
    assert name == "statecache-gpu" and [n for n, _ in gated.calls] == [1]


def test_start_failure_is_raised():
    def broken():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        GpuThread(broken).start()


def test_stop_cancels_rows_still_waiting(engine):
    gated = GatedEngine(engine)
    gated.gate.clear()
    gpu = started(gated)

    async def main():
        first = asyncio.ensure_future(gpu.answer(row(501)))
        await entered(gated)
        second = asyncio.ensure_future(gpu.answer(row(502)))
        await asyncio.sleep(0.01)
        stopper = asyncio.ensure_future(asyncio.to_thread(gpu.stop, 5))
        await asyncio.sleep(0.02)
        gated.gate.set()
        assert await stopper
        assert (await first)["path"] == "cold"  # the running batch finished
        with pytest.raises(asyncio.CancelledError):
            await second  # the waiting one is cancelled: arq re-queues its job
        with pytest.raises(Stopping):
            await gpu.answer(row(503))
        with pytest.raises(Retry):
            await answer({"gpu": gpu, "settings": SETTINGS}, row(503))  # arq puts the job back on the queue

    run(main())


def test_a_row_that_does_not_reach_the_model_goes_back_to_the_queue(engine, redis_url):
    """A job is never failed for waiting: past half its timeout without reaching the model it is re-queued, and
    the try arq counted when it took the job (arq:retry:<id>) is given back."""
    import uuid

    from arq.connections import RedisSettings, create_pool
    from arq.constants import retry_key_prefix

    gated = GatedEngine(engine)
    gated.gate.clear()
    gpu = started(gated)
    job_id = uuid.uuid4().hex

    async def main():
        redis = await create_pool(RedisSettings.from_dsn(redis_url))
        await redis.set(retry_key_prefix + job_id, 3)  # arq took it for its third try
        ctx = {"gpu": gpu, "settings": Settings(metrics_port=0, job_timeout_s=0.4), "redis": redis, "job_id": job_id}
        try:
            blocker = asyncio.ensure_future(gpu.answer(row(61)))
            await entered(gated)
            with pytest.raises(Retry):
                await answer(ctx, row(62))
            assert gpu.pending() == 1  # withdrawn: only the blocker is left, in the engine's hands
            assert await redis.get(retry_key_prefix + job_id) == b"2"  # that try given back
            gated.gate.set()
            return await blocker
        finally:
            await redis.delete(retry_key_prefix + job_id)
            await redis.aclose(close_connection_pool=True)

    assert "probs" in run(main())
    gpu.stop(5)
    assert [n for n, _ in gated.calls] == [1]


def test_backlog_counts():
    b = Backlog(redis=None, queue_name="q")
    b.queued = 5
    assert b.waiting(3) == 8


def test_answer_job_checks_its_call_shape(engine):
    gpu = started(engine)
    ctx = {"gpu": gpu, "settings": SETTINGS}
    assert "probs" in run(answer(ctx, ROW)) and "probs" in run(answer(ctx, row=ROW))
    assert run(answer(ctx))["error"]["code"] == "bad_job"
    assert run(answer(ctx, ROW, ROW))["error"]["code"] == "bad_job"
    assert run(answer(ctx, [1, 2]))["error"]["code"] == "bad_row"
    gpu.stop(5)


def test_serial_round_trip_and_pickle_refused():
    job = {"t": 1, "f": "answer", "a": [ROW], "k": {}, "et": 123}
    assert deserialize(serialize(job)) == job
    with pytest.raises(Exception):
        deserialize(pickle.dumps(job))
    with pytest.raises(Exception):
        deserialize(pickle.dumps(job, protocol=0))
    err = deserialize(serialize({"r": ValueError("bad thing")}))["r"]
    assert isinstance(err, RemoteJobError) and err.kind == "ValueError" and err.message == "bad thing"
    np = pytest.importorskip("numpy")
    assert deserialize(serialize({"p": np.array([0.5, 0.5])})) == {"p": [0.5, 0.5]}


def test_worker_decoding_never_fails_and_names_the_fix():
    decode = job_deserializer(1000)
    job = {"t": 1, "f": "answer", "a": [ROW], "k": {}, "et": 123}
    assert decode(serialize(job)) == job
    for bad in (pickle.dumps(job), pickle.dumps(job, protocol=0), b"\xc1garbage", serialize([1, 2]), serialize({"f": 1})):
        stand_in = decode(bad)
        assert stand_in["f"] == JOB_UNDECODABLE and "job_serializer=statecache.protocol.serialize" in stand_in["k"]["message"]
    assert decode(pickle.dumps(job))["k"]["pickled"] is True
    big = decode(serialize({**job, "a": [{"ids": list(range(1000))}]}))
    assert big["k"]["code"] == "job_too_large" and "STATECACHE_MAX_JOB_BYTES" in big["k"]["message"]
    assert run(undecodable({}, **big["k"]))["error"]["code"] == "job_too_large"
    with pytest.raises(JobRefused, match="msgpack serialiser pair"):
        run(undecodable({}, **decode(pickle.dumps(job))["k"]))


def test_results_carry_no_row_and_pickled_jobs_hear_back_in_pickle():
    result = {"t": 1, "s": True, "r": {"probs": [[1.0]]}, "f": "answer", "a": [ROW], "k": {"x": 1}, "et": 1, "st": 2, "ft": 3}
    stored = deserialize(job_serializer(result))
    assert stored["a"] == [] and stored["k"] == {} and stored["r"] == result["r"]
    refused = {**result, "s": False, "r": JobRefused("use the msgpack pair", pickled=True)}
    back = pickle.loads(job_serializer(refused))  # what arq's default (pickle) client reads
    assert isinstance(back["r"], RuntimeError) and "msgpack pair" in str(back["r"])


def test_metrics_read_engine_stats_defensively():
    assert engine_figures({})["cache_used_bytes"] == 0
    f = engine_figures({"cache": {"bytes": 10, "mb": 1, "evicted": 2, "rows": 4}, "batch": {"captures": 4},
                        "new_key": object()})
    assert f["cache_budget_bytes"] == 2**20 and f["graph_captures"] == 4 and f["graph_capture_seconds"] == 0
    assert f["device_memory_bytes"] == {} and f["batched_forwards"] == 0 and f["cache_evictions"] == 2
    # the engine's budget, the batched runner's graphs and forwards, precapture and device memory (Engine.stats)
    f = engine_figures({"cache": {"mb": 1}, "batch": {"captures": 5, "capture_s": 2.5, "forwards": 5, "sequences": 9},
                        "budget": {"mb": 3, "states_4k": 2.5}, "load_s": 4.0,
                        "precapture": {"batch": {"graphs": 5, "seconds": 2.5}},
                        "device_memory_mb": {"allocated": 2.0, "total": 8.0}})
    assert f["cache_budget_bytes"] == 3 * 2**20 and f["cache_budget_states_4k"] == 2.5
    assert (f["graph_captures"], f["graph_capture_seconds"], f["batched_forwards"], f["batched_sequences"]) == (5, 2.5, 5, 9)
    assert f["engine_load_seconds"] == 4.0 and f["precapture_seconds"] == 2.5
    assert f["device_memory_bytes"] == {"allocated": 2 * 2**20, "total": 8 * 2**20}
    m = WorkerMetrics(inert_rows=3)
    m.batch([{}], {"cache": {"mb": 1, "rows": 1, "cold": 1}})
    assert m.inert._value.get() == 0
    m.batch([{}], {"cache": {"mb": 1, "rows": 5, "cold": 1}})  # 4 rows asked, nothing planted or reused
    assert m.inert._value.get() == 1
    m.batch([{}], {"cache": {"mb": 1, "rows": 6, "cold": 1, "hits": 1}})
    assert m.inert._value.get() == 0
    m.batch([{}], {"cache": {"mb": 0}})
    assert m.inert._value.get() == 1


def test_metrics_carry_the_cache_tiers():
    """statecache:cache_tier_* and the host tier's copies from engine.stats()['cache'] (statecache.cache.store.info)."""
    from prometheus_client import generate_latest

    stats = {"cache": {"bytes": 10, "host_bytes": 30, "device_checkpoints": 2, "host_checkpoints": 5,
                       "restored_device": 7, "restored_host": 3, "tokens_lost": 128,
                       "tiers": {"demoted": 4, "dropped_device": 1, "dropped_host": 2, "replaced": 0},
                       "host": {"copies_up": 3, "up_ms": 1500.0}}}
    f = engine_figures(stats)
    assert f["tier_bytes"] == {"device": 10, "host": 30} and f["tier_restores"] == {"device": 7, "host": 3}
    assert f["host_copy_back_seconds"] == 1.5 and f["tokens_lost_no_checkpoint"] == 128
    assert f["tier_evictions"][("device", "to_host")] == 4 and f["tier_evictions"][("host", "dropped")] == 2
    assert engine_figures({})["tier_bytes"] == {"device": 0, "host": 0}
    m = WorkerMetrics(engine_stats=lambda: stats)
    text = generate_latest(m.registry).decode()
    assert 'statecache:cache_tier_bytes{tier="host"} 30.0' in text
    assert 'statecache:cache_tier_evictions_total{reason="to_host",tier="device"} 4.0' in text
    assert 'statecache:cache_restores_total{tier="host"} 3.0' in text
    assert "statecache:cache_tokens_lost_total 128.0" in text


def test_import_callable():
    assert import_callable("tests.fakes:GatedEngine") is GatedEngine
    assert import_callable("os.path:join.__name__") == "join"


def test_decoded_rows_are_dicts_with_a_short_repr():
    """arq logs every job's arguments with repr(): a decoded row is a dict whose repr is a short summary."""
    decode = job_deserializer(10**6)
    job = {"t": 1, "f": "answer", "a": [{**ROW, "ids": list(range(4000))}], "k": {"row": ROW}, "et": 123}
    got = decode(serialize(job))
    assert got == job and isinstance(got["a"][0], dict) and isinstance(got["k"]["row"], dict)
    assert repr(got["a"][0]) == "<row: 4000 ids>" and len(repr(got["k"])) < 40
    assert deserialize(serialize(got["a"][0])) == job["a"][0]  # it encodes as the map it is


def test_the_poll_skips_jobs_running_here(redis_url, queue_name):
    """ResilientRedis.zrangebyscore drops the ids of jobs this worker runs (arq would check each in a transaction on
    every poll); without that hook, or asked for scores, it answers as Redis does."""
    from worker.resilient import ResilientRedis

    async def main():
        pool = ResilientRedis.from_dsn(redis_url)
        try:
            await pool.zadd(queue_name, {"a": 1, "b": 2, "c": 3})
            plain = await pool.zrangebyscore(queue_name, min=float("-inf"), max=10, start=0, num=10)
            pool.running_here = lambda: {"a", "c"}
            skipped = await pool.zrangebyscore(queue_name, min=float("-inf"), max=10, start=0, num=10)
            scored = await pool.zrangebyscore(queue_name, float("-inf"), 10, withscores=True)
            await pool.delete(queue_name)
            return plain, skipped, scored
        finally:
            await pool.aclose()

    plain, skipped, scored = run(main())
    assert plain == [b"a", b"b", b"c"] and skipped == [b"b"] and len(scored) == 3


def test_a_cancelled_redis_call_is_cancelled(redis_url, queue_name):
    """A task cancelled inside any of the worker's Redis calls stops there. Cancels are thrown at every few steps of
    the event loop into tasks that do nothing but call Redis (commands, pipelines, scripts); with redis-py's socket
    timeout on, about one in four returned as if never cancelled (Python 3.11's wait_for), and a stopping worker's
    poll loop or router went on after shutdown had cancelled it (worker.resilient)."""
    from worker.resilient import ResilientRedis

    async def main():
        pool = ResilientRedis.from_dsn(redis_url)
        script = pool.register_script("return redis.call('get', KEYS[1])")

        async def calls(kind: int):
            while True:
                if kind == 0:
                    await pool.get(queue_name)
                elif kind == 1:
                    async with pool.pipeline(transaction=False) as p:
                        p.get(queue_name)
                        p.zcard(queue_name)
                        await p.execute()
                else:
                    await script(keys=[queue_name])

        lost = 0
        try:
            for i in range(150):
                task = asyncio.create_task(calls(i % 3))
                for _ in range(i % 7 + 1):
                    await asyncio.sleep(0)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=0.1)
                while not task.done():
                    lost += 1 if not done else 0
                    done = True
                    task.cancel()
                    await asyncio.wait({task}, timeout=0.1)
            return lost
        finally:
            await pool.aclose()

    assert run(main()) == 0
