"""Workers coming and going (issue 32's must-show), on the CPU with the tiny model and a private append-only
redis-server: 3 workers, agents through a bare arq pool and through producer's Client; during the run one worker is
SIGTERMed, one SIGKILLed, a new one started, Redis restarted, one SIGSTOPped for 15 s. Prints rows sent and answered.

    PYTHONPATH=$PWD python bench/churn.py [--agents 8] [--rows 10] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arq.connections import RedisSettings, create_pool  # noqa: E402

from producer.client import Client  # noqa: E402
from producer.local_redis import LocalRedis  # noqa: E402
from statecache.protocol import deserialize, serialize  # noqa: E402
from tests.harness import WorkerProcess  # noqa: E402
from tests.test_routing import agent_state, row, start_workers  # noqa: E402


async def churn(url: str, server: LocalRedis, queue: str, tmp: Path, agents: int, rows: int) -> tuple[int, int, list]:
    procs = dict(zip("abc", start_workers(url, queue, tmp, list("abc"), STATECACHE_DRAIN_S=10)))
    events: list[str] = []
    pool = await create_pool(RedisSettings.from_dsn(url), job_serializer=serialize, job_deserializer=deserialize,
                             default_queue_name=queue)
    client = await Client.connect(url, queue, timeout_s=300)
    sent, answered = 0, 0

    async def agent(a: int):
        nonlocal sent, answered
        state = agent_state(1000 + a)
        for q in range(rows):
            sent += 1
            try:
                if a % 2:
                    res = await client.answer(row(state, q))
                else:
                    j = await pool.enqueue_job("answer", row(state, q))
                    res = await j.result(timeout=300, poll_delay=0.05)
            except Exception as e:  # noqa: BLE001 - counted as not answered
                events.append(f"agent {a} row {q}: {type(e).__name__}: {e}"[:200])
                continue
            answered += "probs" in res
            await asyncio.sleep(0.2)

    async def chaos():
        steps = [(3, "SIGTERM a", lambda: procs["a"].signal(signal.SIGTERM)),
                 (3, "SIGKILL b", lambda: procs["b"].signal(signal.SIGKILL)),
                 (1, "start d", lambda: procs.__setitem__("d", WorkerProcess(
                     url, queue, tmp / "d.log", STATECACHE_WORKER_ID="d", STATECACHE_ROUTE_TTL_S="2",
                     OMP_NUM_THREADS="1", STATECACHE_JOB_TIMEOUT_S="60").launch())),
                 (8, "restart Redis", lambda: (server.stop(), time.sleep(2), server.start())),
                 (5, "SIGSTOP c", lambda: procs["c"].signal(signal.SIGSTOP)),
                 (15, "SIGCONT c", lambda: procs["c"].signal(signal.SIGCONT))]
        for wait_s, what, act in steps:
            await asyncio.sleep(wait_s)
            await asyncio.to_thread(act)
            events.append(f"{time.strftime('%H:%M:%S')} {what}")

    try:
        await asyncio.gather(chaos(), *[agent(a) for a in range(agents)])
    finally:
        await client.close()
        await pool.aclose()
        for p in procs.values():
            p.stop()
    return sent, answered, events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    for run in range(args.runs):
        with LocalRedis(appendonly=True) as server, tempfile.TemporaryDirectory() as tmp:
            sent, answered, events = asyncio.run(churn(server.url, server, f"statecache:churn:{run}", Path(tmp),
                                                       args.agents, args.rows))
        print(f"run {run + 1}: {answered} of {sent} rows answered, {sent - answered} lost")
        for e in events:
            print("  ", e)


if __name__ == "__main__":
    main()
