"""The worker's parts without Redis: the GPU thread, the backlog rule, the job function, the serialiser pair."""

import asyncio
import pickle
import threading

import pytest
from arq.worker import Retry

from producer.serial import RemoteJobError, deserialize, serialize
from tests.fakes import FakeEngine
from worker.backlog import Backlog
from worker.gpu_thread import GpuThread, Stopping
from worker.jobs import answer, import_callable

ROW = {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [2]}


def row(state: int, q: int = 0) -> dict:
    return {"ids": [state, state, state, 10 + q], "state_len": 3, "slots": [3], "nopts": [3]}


def run(coro):
    return asyncio.run(coro)


def started(engine, **kw) -> GpuThread:
    gpu = GpuThread(lambda: engine, **kw)
    gpu.start()
    return gpu


def test_rows_wait_on_one_thread_and_come_back_in_order():
    engine = FakeEngine(delay_s=0.05)
    gpu = started(engine)

    async def main():
        first = asyncio.ensure_future(gpu.answer(row(1)))
        await asyncio.sleep(0.01)  # the thread is busy with the first row; the rest queue up
        rest = [gpu.answer(row(s, q)) for s in (2, 3) for q in range(3)]
        return [await first] + list(await asyncio.gather(*rest))

    results = run(main())
    assert gpu.stop(5)
    assert engine.threads == {"statecache-gpu"}
    assert [n for n, _ in engine.calls] == [1, 6]  # everything that was ready went in one call
    assert [r["path"] for r in results] == ["cold", "cold", "hit", "hit", "cold", "hit", "hit"]
    assert gpu.counters["batches"] == 2 and gpu.counters["largest_batch"] == 6


def test_backed_up_is_asked_with_the_rows_waiting():
    seen = []
    engine = FakeEngine()
    engine.release.clear()
    gpu = started(engine, backed_up=lambda n: seen.append(n) or n > 2)

    async def main():
        tasks = [asyncio.ensure_future(gpu.answer(row(0)))]
        await asyncio.sleep(0.02)  # the first row's batch is blocked in the engine
        tasks += [asyncio.ensure_future(gpu.answer(row(s))) for s in range(1, 5)]
        await asyncio.sleep(0.02)
        engine.release.set()
        return await asyncio.gather(*tasks)

    results = run(main())
    gpu.stop(5)
    assert seen == [1, 4] and engine.calls == [(1, False), (4, True)]
    assert [r["path"] for r in results[1:]] == ["cold"] * 4  # a backlog no longer sends new states plain


def test_engine_exception_costs_only_the_bad_row(caplog):
    gpu = started(FakeEngine(fail_on_state_len=1))
    bad = {"ids": [5, 6], "state_len": 1, "slots": [1], "nopts": [2]}

    async def main():
        return await asyncio.gather(*[gpu.answer(r) for r in (row(1), bad, row(2))])

    good1, err, good2 = run(main())
    gpu.stop(5)
    assert err["error"]["code"] == "internal" and "fake engine failure" in err["error"]["message"]
    assert "probs" in good1 and "probs" in good2
    assert gpu.counters["engine_errors"] == 1
    assert "engine failed" in caplog.text


def test_bad_rows_get_error_results():
    gpu = started(FakeEngine(vocab_size=50))

    async def main():
        return await asyncio.gather(gpu.answer({**ROW, "ids": [1, 2, 3, 99]}), gpu.answer(ROW))

    bad, good = run(main())
    gpu.stop(5)
    assert bad["error"]["code"] == "id_out_of_range" and "probs" in good


def test_call_runs_on_the_thread_and_cancelled_rows_are_skipped():
    engine = FakeEngine()
    engine.release.clear()
    gpu = started(engine)

    async def main():
        blocker = asyncio.ensure_future(gpu.answer(row(1)))
        await asyncio.sleep(0.02)
        doomed = asyncio.ensure_future(gpu.answer(row(2)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        name = asyncio.ensure_future(gpu.call(lambda e: threading.current_thread().name))
        await asyncio.sleep(0.01)
        engine.release.set()
        return await blocker, await name

    _, name = run(main())
    gpu.stop(5)
    assert name == "statecache-gpu" and engine.calls == [(1, False)]


def test_start_failure_is_raised():
    def broken():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        GpuThread(broken).start()


def test_stop_cancels_rows_still_waiting():
    engine = FakeEngine()
    engine.release.clear()
    gpu = started(engine)

    async def main():
        first = asyncio.ensure_future(gpu.answer(row(1)))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(gpu.answer(row(2)))
        await asyncio.sleep(0.01)
        stopper = asyncio.ensure_future(asyncio.to_thread(gpu.stop, 5))
        await asyncio.sleep(0.02)
        engine.release.set()
        assert await stopper
        assert (await first)["path"] == "cold"  # the running batch finished
        with pytest.raises(asyncio.CancelledError):
            await second  # the waiting one is cancelled: arq re-queues its job
        with pytest.raises(Stopping):
            await gpu.answer(row(3))
        with pytest.raises(Retry):
            await answer({"gpu": gpu}, row(3))  # arq puts the job back on the queue

    run(main())


def test_backlog_rule():
    b = Backlog(redis=None, queue_name="q", threshold_rows=8)
    assert not b.backed_up(8) and b.backed_up(9)
    b.queued = 5
    assert b.waiting(3) == 8 and not b.backed_up(3) and b.backed_up(4)


def test_answer_job_checks_its_call_shape():
    class Gpu:
        async def answer(self, r):
            return {"got": r}

    ctx = {"gpu": Gpu()}
    assert run(answer(ctx, ROW)) == {"got": ROW}
    assert run(answer(ctx, row=ROW)) == {"got": ROW}
    assert run(answer(ctx))["error"]["code"] == "bad_job"
    assert run(answer(ctx, ROW, ROW))["error"]["code"] == "bad_job"
    assert run(answer(ctx, [1, 2]))["error"]["code"] == "bad_row"


def test_answer_job_turns_exceptions_into_results():
    class Gpu:
        async def answer(self, r):
            raise KeyError("boom")

    assert run(answer({"gpu": Gpu()}, ROW))["error"]["code"] == "internal"


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


def test_import_callable():
    assert import_callable("tests.fakes:FakeEngine") is FakeEngine
    assert import_callable("os.path:join.__name__") == "join"
