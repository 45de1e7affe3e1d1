"""The real worker with the real engine on the built-in tiny model, through a real Redis.

In-process workers (arq's Worker with `worker_settings`, the engine behind a gate so a test can hold rows
back and make a backlog) for answers, grouping, backlog and bad input; worker subprocesses
(`python -m arq worker.WorkerSettings`) for SIGKILL and SIGTERM.
"""

import asyncio
import logging
import signal
import time
import uuid

import pytest
import redis as redis_sync
from arq.connections import RedisSettings, create_pool

from producer.client import Client, RowRejected, WorkerError
from statecache.engine import Engine
from tests.fakes import GatedEngine
from tests.harness import InProcessWorker, WorkerProcess, health_key, wait_for

Q = [
    {"text": "Which link leads to the checkout?", "options": ["the blue button", "the menu", "the search box"]},
    {"text": "Is the form complete?", "options": ["yes", "no"]},
    {"text": "What should the agent do next?", "options": ["click", "type", "scroll", "go back"]},
]


def state(agent: str, steps: int = 16) -> str:
    """About 20 tokens a step with the tiny tokenizer: 16 steps is past the cache's 256-token minimum."""
    return f"goal of agent {agent}: book a table\n" + "\n".join(
        f"step {i}: {agent} clicked the button and typed a name" for i in range(steps)
    )


def run(coro):
    return asyncio.run(coro)


def close(a: dict, b: dict, tol: float = 1e-4) -> bool:
    return len(a["probs"]) == len(b["probs"]) and all(
        abs(x - y) <= tol for pa, pb in zip(a["probs"], b["probs"]) for x, y in zip(pa, pb)
    )


@pytest.fixture(scope="module")
def module_queue() -> str:
    return f"statecache:test:{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def live(redis_url, module_queue):
    """One in-process worker on the tiny model for the module, engine gated, max row size 600 tokens."""
    with InProcessWorker(redis_url, module_queue, lambda: GatedEngine(Engine()), max_row_tokens=600) as w:
        yield w


async def held_batch(client: Client, w: InProcessWorker, rows: list) -> list:
    """Hold the engine on a cheap plug row, let `rows` pile up in the worker, then release: one batch."""
    w.engine.gate.clear()
    entered = w.engine.entered
    plug = asyncio.ensure_future(client.answer({"ids": [1, 2, 3], "state_len": 0, "slots": [2], "nopts": [2]}))
    await asyncio.to_thread(wait_for, lambda: w.engine.entered > entered, 10, "the plug to hold the engine")
    tasks = [asyncio.ensure_future(client.answer(r)) for r in rows]
    await asyncio.to_thread(wait_for, lambda: w.gpu.pending() >= len(rows), 10, "rows to pile up")
    w.engine.calls.clear()
    w.engine.gate.set()
    await plug
    results = await asyncio.gather(*tasks)
    assert w.engine.calls[0][0] == 1  # the plug
    del w.engine.calls[0]
    return results


def client_of(w: InProcessWorker):
    return Client.connect(w.settings.redis_url, w.settings.queue, timeout_s=60)


def test_concurrent_agents_match_the_engine(live):
    """Three agents at once, each: a new state, the same state again, a grown state; answers = the engine's."""
    agents = ["ann", "bob", "cy"]

    def rows_of(a):
        return [
            {"state": state(a), "questions": [Q[0]]},
            {"state": state(a), "questions": [Q[1]]},
            {"state": state(a) + f"\nstep 16: {a} scrolled down", "questions": [Q[2]]},
        ]

    async def agent(client, a):
        return [await client.answer(r) for r in rows_of(a)]

    async def main():
        async with await client_of(live) as client:
            return await asyncio.gather(*[agent(client, a) for a in agents])

    got = run(main())
    direct = Engine()
    for a, results in zip(agents, got):
        want = [direct.answer([r])[0] for r in rows_of(a)]
        assert all(close(g, w) for g, w in zip(results, want)), (a, results, want)
        assert [r["path"] for r in results[:2]] == ["cold", "hit"]
        assert results[2]["path"] in ("hit", "partial") and results[2]["reused"] > 0
        assert all(abs(sum(p) - 1) < 1e-5 for r in results for p in r["probs"])


def test_followers_of_a_new_state_are_hits(live):
    rows = [{"state": state("dee"), "questions": [q]} for q in Q]

    async def main():
        async with await client_of(live) as client:
            return await held_batch(client, live, rows)

    results = run(main())
    assert [n for n, _ in live.engine.calls] == [3]  # one batch
    # the jobs reach the worker in whatever order their enqueues finished: one of them plants the state
    cold = [r for r in results if r["path"] == "cold"]
    hits = [r for r in results if r["path"] == "hit"]
    assert len(cold) == 1 and len(hits) == 2
    assert all(h["reused"] > 0 and h["computed"] < cold[0]["computed"] for h in hits)


def test_backlog_still_plants_every_new_state(redis_url, queue_name):
    with InProcessWorker(redis_url, queue_name, lambda: GatedEngine(Engine())) as w:
        rows = [
            {"state": state("eve"), "questions": [Q[0]]},
            {"state": state("fay"), "questions": [Q[0]]},
            {"state": state("gus"), "questions": [Q[0]]},
            {"state": state("gus"), "questions": [Q[1]]},
        ]

        async def main():
            async with await client_of(w) as client:
                under_load = await held_batch(client, w, rows)
                w.engine.calls.clear()
                alone = await client.answer({"state": state("hal"), "questions": [Q[0]]})
                return under_load, alone

        under_load, alone = run(main())
        # one call of one row; its waiting count is the backlog reader's last sample (it may still count the row's
        # own job, read before the job started), so only the row count is fixed
        assert [n for n, _ in w.engine.calls] == [1]
    paths = [r["path"] for r in under_load]
    assert paths[:2] == ["cold", "cold"] and sorted(paths[2:]) == ["cold", "hit"], paths  # every forward plants
    assert alone["path"] == "cold"


BAD_ROWS = [
    ([1, 2, 3], "bad_row"),
    ("ids", "bad_row"),
    (None, "bad_row"),
    ({"ids": [1, True, 3], "state_len": 0, "slots": [2], "nopts": [2]}, "bad_type"),
    ({"ids": [1, 2, 3], "state_len": 1.5, "slots": [2], "nopts": [2]}, "bad_type"),
    ({"ids": [1, [2], 3], "state_len": 0, "slots": [2], "nopts": [2]}, "bad_type"),
    ({"ids": [1, 2, 512], "state_len": 0, "slots": [2], "nopts": [2]}, "id_out_of_range"),
    ({"ids": [-1, 2, 3], "state_len": 0, "slots": [2], "nopts": [2]}, "id_out_of_range"),
    ({"ids": [1, 2, 3], "state_len": 0, "slots": [3], "nopts": [2]}, "slot_out_of_range"),
    ({"ids": [1, 2, 3], "state_len": 4, "slots": [2], "nopts": [2]}, "state_len_out_of_range"),
    ({"ids": [1, 2, 3], "state_len": 0, "slots": [2], "nopts": [1]}, "bad_nopts"),
    ({"ids": [1, 2, 3], "state_len": 0, "slots": [2], "nopts": [27]}, "bad_nopts"),
    ({"ids": [1, 2, 3], "state_len": 0, "slots": [1, 2], "nopts": [2]}, "length_mismatch"),
    ({"ids": [], "state_len": 0, "slots": [0], "nopts": [2]}, "empty"),
    ({"ids": [1], "state_len": 0, "slots": [], "nopts": []}, "empty"),
    ({"ids": [1] * 601, "state_len": 0, "slots": [0], "nopts": [2]}, "too_long"),
    ({"ids": [1, 2], "state_len": 0, "slots": [1], "nopts": [2], "extra": 1}, "bad_row"),
    ({"ids": [1, 2], "state_len": 0, "slots": [1], "nopts": [2], "state": "x"}, "bad_row"),
    ({"state": "s", "questions": []}, "empty"),
    ({"state": "s", "questions": [{"text": "q", "options": ["only one"]}]}, "bad_nopts"),
    ({"state": "s", "questions": [{"text": "q", "options": [str(i) for i in range(27)]}]}, "bad_nopts"),
    ({"state": 7, "questions": [Q[0]]}, "bad_type"),
    ({"state": "s", "questions": [{"text": 1.5, "options": ["a", "b"]}]}, "bad_type"),
    ({"state": state("ivy", 40), "questions": [Q[0]]}, "too_long"),
]


def test_bad_input_matrix(live, caplog):
    caplog.set_level(logging.INFO)

    async def refused(client, row):
        try:
            result = await client.answer(row)
        except RowRejected as e:
            return e.code, e.message
        return "answered", result

    async def main():
        async with await client_of(live) as client:
            got = await asyncio.gather(*[refused(client, row) for row, _ in BAD_ROWS])
            wrong_shape = await client.pool.enqueue_job("answer", {"ids": [1]}, {"ids": [2]}, _queue_name=live.settings.queue)
            assert (await wrong_shape.result(timeout=30, poll_delay=0.01))["error"]["code"] == "bad_job"
            pickler = await create_pool(RedisSettings.from_dsn(live.settings.redis_url))
            pickled = await pickler.enqueue_job("answer", BAD_ROWS[3][0], _queue_name=live.settings.queue)
            try:
                with pytest.raises(RuntimeError, match="msgpack serialiser pair"):
                    await pickled.result(timeout=30, poll_delay=0.01)
            finally:
                await pickler.aclose(close_connection_pool=True)
            with pytest.raises(WorkerError, match="not found"):
                await client._run("no_such_function", (), 30)
            after = await client.answer({"ids": [5, 6, 7, 8], "state_len": 2, "slots": [3], "nopts": [4]})
            return got, after

    got, after = run(main())
    for (row, expected), (code, message) in zip(BAD_ROWS, got):
        assert code == expected, (row if len(repr(row)) < 200 else "long row", code, message)
        assert message
    assert len(after["probs"][0]) == 4  # the worker goes on
    assert "refused: a pickled job" in caplog.text


# --- worker processes --------------------------------------------------------------------------------------------


def plain_rows(tag: str, n: int, steps: int) -> list[dict]:
    """Distinct rows below the cache's minimum state (about 60 + 20 * steps tokens): plain-path work."""
    return [{"state": f"{tag} {i}: " + state(tag, steps), "questions": [Q[i % 3]]} for i in range(n)]


def jobs_started(proc: WorkerProcess) -> int:
    return proc.log().count(" → ")


async def answers_across(redis_url, queue, rows, during):
    """Agents wait for every row while `during()` (blocking: kills, restarts) runs in a thread."""
    async with await Client.connect(redis_url, queue, timeout_s=120) as client:
        tasks = [asyncio.ensure_future(client.answer(r)) for r in rows]
        await asyncio.to_thread(during, tasks)
        return await asyncio.gather(*tasks)


def test_killed_worker_loses_no_job(redis_url, queue_name, tmp_path):
    # lost in-progress jobs come back after 15 + 10 s; 15 s leaves room for the CPU's first call at each new shape
    env = dict(STATECACHE_MAX_JOBS=4, STATECACHE_JOB_TIMEOUT_S=15)
    rows = plain_rows("kill", 16, steps=3)
    first = WorkerProcess(redis_url, queue_name, tmp_path / "w1.log", **env).start()
    second = WorkerProcess(redis_url, queue_name, tmp_path / "w2.log", **env)
    done_at_kill = []

    def during(tasks):
        wait_for(lambda: any(t.done() for t in tasks), 60, "a first answer")
        first.signal(signal.SIGKILL)
        first.wait(10)
        done_at_kill.append(sum(t.done() for t in tasks))
        second.start()
        assert second.check() == 0  # the health check the compose file uses

    try:
        results = run(answers_across(redis_url, queue_name, rows, during))
    finally:
        first.stop()
        second.stop()
    assert 0 < done_at_kill[0] < len(rows)  # killed mid-queue
    for result, row in zip(results, rows):  # every row answered (equality with the engine: test above)
        (probs,) = result["probs"]
        assert len(probs) == len(row["questions"][0]["options"]) and abs(sum(probs) - 1) < 1e-5


def test_sigterm_drains_in_flight_rows(redis_url, queue_name, tmp_path):
    rows = plain_rows("term", 8, steps=4)
    env = dict(STATECACHE_DRAIN_S=30, STATECACHE_ENGINE="tests.fakes:slow_engine")  # the tiny model, 0.5 s a batch more
    proc = WorkerProcess(redis_url, queue_name, tmp_path / "w.log", **env).start()
    timing = {}

    def during(tasks):
        wait_for(lambda: jobs_started(proc) >= len(rows), 60, "every job to be taken")
        assert not all(t.done() for t in tasks)
        timing["sent"] = time.monotonic()
        proc.signal(signal.SIGTERM)
        timing["rc"] = proc.wait(60)
        timing["exit_s"] = time.monotonic() - timing["sent"]

    try:
        results = run(answers_across(redis_url, queue_name, rows, during))
    finally:
        proc.stop()
    log = proc.log()
    assert timing["rc"] == 0 and timing["exit_s"] < 30, log
    assert all("probs" in r for r in results)  # every in-flight row was answered before the exit
    assert "shutdown on SIGTERM" in log and "wait complete" in log and "GPU thread stopped" in log
    r = redis_sync.Redis.from_url(redis_url)
    assert r.zcard(queue_name) == 0 and not r.exists(health_key(queue_name))
    r.close()
    assert proc.check() == 1  # no worker: unhealthy


def test_sigterm_wait_is_bounded_and_the_rest_requeues(redis_url, queue_name, tmp_path):
    """A short drain: rows still waiting when it ends are cancelled back to the queue; the next worker answers them."""
    rows = plain_rows("bound", 8, steps=3)
    env = dict(STATECACHE_DRAIN_S=0.3, STATECACHE_ENGINE="tests.fakes:slow_engine", STATECACHE_MAX_JOBS=2)
    first = WorkerProcess(redis_url, queue_name, tmp_path / "w1.log", **env).start()
    second = WorkerProcess(redis_url, queue_name, tmp_path / "w2.log", **env)
    timing = {}

    def during(tasks):
        wait_for(lambda: jobs_started(first) >= 2, 60, "two jobs to be taken")
        t0 = time.monotonic()
        first.signal(signal.SIGTERM)
        timing["rc"] = first.wait(30)
        timing["exit_s"] = time.monotonic() - t0
        timing["done"] = sum(t.done() for t in tasks)
        second.start()

    try:
        results = run(answers_across(redis_url, queue_name, rows, during))
    finally:
        first.stop()
        second.stop()
    log = first.log()
    assert timing["rc"] == 0 and timing["exit_s"] < 5, (timing, log)  # 0.3 s drain + the batch it was running
    assert timing["done"] < len(rows) and "cancelled, will be run again" in log
    assert all("probs" in r for r in results)  # nothing lost: the second worker answered the rest
