"""Start-up and capture-after-start-up of the real worker, read from its own metrics (for the GPU; runs on the CPU).

    .venv/bin/python bench/worker_startup.py [--rows 64] [--out bench/results/worker_startup]

Starts `python -m arq worker.WorkerSettings` (the engine the STATECACHE_* settings describe: STATECACHE_MODEL,
or STATECACHE_ENGINE for random 9B weights; STATECACHE_PRECAPTURE on by default) on a private Redis (or
`REDIS_URL`), and reports:
  - start-up: seconds from the process start to its health key (weights loaded, every graph captured);
  - graph captures and their seconds at ready, read from `statecache:graph_captures_total` and
    `statecache:graph_capture_seconds_total`;
  - then `rows` token rows of states of 512..4096 tokens (new states, repeats, grown states) from 8 agents
    through the queue: captures during serving (the goal is none), rows by path, p50/p99 latency per path
    (`statecache:row_latency_seconds`, from the client's clock too), failed jobs.
Prints a summary and writes `worker_startup.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client, ClientError  # noqa: E402
from producer.demo import scrape, started_worker  # noqa: E402
from producer.local_redis import LocalRedis, answers  # noqa: E402
from statecache.settings import Settings  # noqa: E402


def trace(agent: int, rows: int, vocab: int = 400):
    rng = random.Random(agent)
    state = [rng.randrange(20, vocab) for _ in range(rng.choice([512, 1024, 2048, 4096]))]
    for _ in range(rows):
        r = rng.random()
        if r < 0.4:
            pass  # another question about the same state
        elif r < 0.8:
            state = state + [rng.randrange(20, vocab) for _ in range(48)]  # the page grows
        else:
            state = [rng.randrange(20, vocab) for _ in range(rng.choice([512, 1024, 2048, 4096]))]  # a new page
        q = [rng.randrange(20, vocab) for _ in range(24)]
        yield {"ids": state + q, "state_len": len(state), "slots": [len(state) + 23], "nopts": [4]}


async def agents(url: str, queue: str, n_agents: int, rows_each: int) -> tuple[list, int]:
    out, failed = [], 0
    async with await Client.connect(url, queue, timeout_s=600) as client:

        async def one(a: int) -> None:
            nonlocal failed
            for row in trace(a, rows_each):
                t0 = time.perf_counter()
                try:
                    res = await client.answer(row)
                except ClientError as e:
                    failed += 1
                    print(f"agent {a}: {e}", flush=True)
                    continue
                out.append((res["path"], len(row["ids"]), 1e3 * (time.perf_counter() - t0)))

        await asyncio.gather(*[one(a) for a in range(n_agents)])
    return out, failed


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="rows in all (8 agents)")
    p.add_argument("--out", default="bench/results/worker_startup")
    p.add_argument("--ready-timeout-s", type=float, default=1800)
    args = p.parse_args()
    env = Settings.from_env()
    queue = "statecache:bench:startup"
    external = env.redis_url if answers(env.redis_url) else None
    with (LocalRedis() if external is None else _External(external)) as server:
        t0 = time.monotonic()
        with started_worker(server.url, queue, args.ready_timeout_s) as (_, metrics_url):
            startup_s = time.monotonic() - t0
            at_ready = scrape(metrics_url)
            rows, failed = asyncio.run(agents(server.url, queue, 8, max(1, args.rows // 8)))
            after = scrape(metrics_url)
    key = "statecache:graph_captures_total"
    paths = sorted({p for p, _, _ in rows})
    report = {
        "settings": {k: v for k, v in vars(env).items() if k != "redis_url"},
        "startup_s": round(startup_s, 2),
        "captures_at_ready": at_ready.get(key, 0),
        "capture_seconds_at_ready": round(at_ready.get("statecache:graph_capture_seconds_total", 0), 2),
        "captures_while_serving": after.get(key, 0) - at_ready.get(key, 0),
        "rows": len(rows),
        "failed_jobs": failed,
        "per_path": {p: {"rows": sum(1 for q, _, _ in rows if q == p),
                         "p50_ms": round(pct([ms for q, _, ms in rows if q == p], 0.5), 1),
                         "p99_ms": round(pct([ms for q, _, ms in rows if q == p], 0.99), 1),
                         "mean_tokens": round(statistics.mean([n for q, n, _ in rows if q == p]))} for p in paths},
        "tokens_reused": after.get("statecache:tokens_reused_total", 0),
        "tokens_computed": after.get("statecache:tokens_computed_total", 0),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "worker_startup.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 1 if failed else 0


class _External:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


if __name__ == "__main__":
    sys.exit(main())
