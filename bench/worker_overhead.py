"""What the worker itself costs per row, without a model: the real `arq worker.WorkerSettings` process and Redis,
an engine that answers at once (`InstantEngine`), and N closed-loop agents sending 4k-token rows.

    python bench/worker_overhead.py [--agents 16] [--seconds 10] [--tokens 4000] [--engine-ms 0] [--env K=V ...]

Prints rows/s, latency p50 (enqueue to answer, all transport), and the worker process's CPU milliseconds per row
(user + system, from /proc): the CPU its event loop (arq, Redis, msgpack, logging) takes per row, which on a GPU host
competes for the GIL with the thread that drives the GPU (bench/gpu_profile.py's `contention` step measures what
that costs the engine). `--env` passes settings to the worker (e.g. STATECACHE_POLL_DELAY_S=0.05) to compare.
Linux only (/proc). Knows the worker only through its environment and Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class InstantEngine:
    """The engine contract the GPU thread drives (`submit`, `step`, `pending`, `stats`: worker.gpu_thread), answering
    every row in its submission with uniform probabilities; --engine-ms holds each submission that long first."""

    def __init__(self, settings=None):
        self.rows = 0
        self.busy_s = float(os.environ.get("OVERHEAD_ENGINE_MS", "0")) / 1e3  # a batch's time (GIL released)

    def submit(self, rows, tags, waiting_rows=0):
        self.rows += len(rows)
        if self.busy_s:
            time.sleep(self.busy_s)
        out = []
        for tag, r in zip(tags, rows):
            n = r.get("nopts", [4]) if isinstance(r, dict) else [4]
            out.append((tag, {"probs": [[1.0 / k] * k for k in n], "path": "hit", "reused": 0, "computed": 0}))
        return out

    def step(self):
        return []

    def pending(self):
        return 0

    def stats(self):
        return {"rows": self.rows}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


async def run(url: str, queue: str, agents: int, seconds: float, tokens: int, pid: int) -> dict:
    from producer.client import Client

    lat: list[float] = []
    async with await Client.connect(url, queue, timeout_s=30) as client:
        await client.answer({"ids": list(range(10, 300)), "state_len": 256, "slots": [289], "nopts": [4]})  # warm

        async def agent(i: int, t_end: float) -> None:
            rng = random.Random(i)
            while time.perf_counter() < t_end:
                ids = [rng.randrange(10, 500) for _ in range(tokens)]
                t0 = time.perf_counter()
                await client.answer({"ids": ids, "state_len": tokens - 40, "slots": [tokens - 1], "nopts": [4]})
                lat.append(time.perf_counter() - t0)

        c0, t0 = cpu_s(pid), time.perf_counter()
        await asyncio.gather(*[agent(i, t0 + seconds) for i in range(agents)])
        el, c1 = time.perf_counter() - t0, cpu_s(pid)
    return {"agents": agents, "rows": len(lat), "rows_per_s": round(len(lat) / el, 1),
            "p50_ms": round(1e3 * statistics.median(lat), 2), "worker_cpu_ms_per_row": round(1e3 * (c1 - c0) / len(lat), 3),
            "worker_cpu_share": round((c1 - c0) / el, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--env", nargs="*", default=[])
    ap.add_argument("--engine-ms", type=float, default=0.0,
                    help="the engine holds each batch this long (GIL released, as a GPU wait): jobs stay in flight")
    args = ap.parse_args(argv)
    from producer.local_redis import LocalRedis

    with LocalRedis() as redis_server:
        queue = f"statecache:overhead:{os.getpid()}"
        env = {**os.environ, "REDIS_URL": redis_server.url, "STATECACHE_QUEUE": queue,
               "STATECACHE_ENGINE": "worker_overhead:InstantEngine", "STATECACHE_METRICS_PORT": "0",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.update(kv.split("=", 1) for kv in args.env)
        env["OVERHEAD_ENGINE_MS"] = str(args.engine_ms)
        prof = ["-m", "cProfile", "-o", os.environ["WORKER_PROFILE"]] if os.environ.get("WORKER_PROFILE") else []
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, *prof, "-m", "arq", "worker.WorkerSettings"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            time.sleep(3)
            res = asyncio.run(run(redis_server.url, queue, args.agents, args.seconds, args.tokens, proc.pid))
        except Exception:
            log.seek(0)
            print("the worker's log ends:\n" + log.read().decode(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(10)
    res["env"], res["engine_ms"] = args.env, args.engine_ms
    print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
