"""What the queue costs: the same rows answered by the engine called directly and through Redis + the worker.

    .venv/bin/python bench/queue_latency.py [--states 8] [--questions 6] [--agents 16] [--out bench/results/queue_latency_cpu.json]

One worker process (`python -m arq worker.WorkerSettings`, the engine of STATECACHE_MODEL / STATECACHE_DEVICE,
default: the tiny model on the CPU) serves a private Redis (or `REDIS_URL`). The workload is `states` agent
states (~450 tokens with the tiny tokenizer) times `questions` questions, in text form.

1. Sequential, one row at a time, same order both ways: each state's first question is cold, the rest hit its
   checkpoint, then every row again (memo). For row i, `added` = latency through the queue minus the engine's
   own time for the same row: what Redis, arq, the GPU-thread hop and the result path add (p50, p99).
2. Throughput: `agents` concurrent producers send every row of fresh states through the queue (jobs/s), and
   the engine gets the same rows in one `answer` call, and rows of other fresh states one call each (rows/s); then the same rows four times over, all
   answered from the memo: the rate of the queue itself on this machine.

Both the worker's engine and the direct one are warmed up first on other states (on the CPU the first call
at each new shape is slow), and the direct engine runs while the worker is idle (no sharing of the 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client  # noqa: E402
from producer.demo import started_worker  # noqa: E402
from producer.local_redis import LocalRedis, answers  # noqa: E402
from statecache.settings import Settings  # noqa: E402

QUESTIONS = [
    ("Which part of the page should the agent use next?", ["the blue button", "the menu", "the search box", "a link"]),
    ("Is the goal reached?", ["yes", "no"]),
    ("What should the agent do next?", ["click", "type", "scroll", "go back", "stop and report"]),
    ("Does the page show what the goal needs?", ["yes", "partly", "no"]),
    ("Is the form complete?", ["yes", "no"]),
    ("Which restaurant should the agent choose?", ["the first", "the second", "the third", "none of them"]),
    ("Did the search return the item we wanted?", ["yes", "no", "not sure"]),
    ("Where is the checkout link?", ["top", "bottom", "left menu"]),
]


def state(tag: str) -> str:
    steps = "\n".join(f"{i + 1}. agent {tag} clicked the blue button and typed a name." for i in range(18))
    return f"Goal: book a table for two near the park ({tag}).\nSteps taken:\n{steps}\nCurrent page: a form."


def rows_for(tags: list[str], questions: int) -> list[dict]:
    return [{"state": state(t), "questions": [{"text": q, "options": o}]} for t in tags for q, o in QUESTIONS[:questions]]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(pct(xs, 0.5), 3), "p99": round(pct(xs, 0.99), 3), "mean": round(statistics.fmean(xs), 3)}


def direct_times(engine, rows: list[dict]) -> tuple[list[float], list[str]]:
    ms, paths = [], []
    for row in rows:
        t0 = time.perf_counter()
        (result,) = engine.answer([row])
        ms.append(1e3 * (time.perf_counter() - t0))
        paths.append(result["path"])
    return ms, paths


async def queue_times(client: Client, rows: list[dict]) -> tuple[list[float], list[str]]:
    ms, paths = [], []
    for row in rows:
        t0 = time.perf_counter()
        result = await client.answer(row)
        ms.append(1e3 * (time.perf_counter() - t0))
        paths.append(result["path"])
    return ms, paths


async def queue_throughput(client: Client, rows: list[dict], agents: int) -> float:
    lanes = [rows[i::agents] for i in range(agents)]

    async def lane(rs):
        for r in rs:
            await client.answer(r)

    t0 = time.perf_counter()
    await asyncio.gather(*[lane(rs) for rs in lanes])
    return len(rows) / (time.perf_counter() - t0)


async def through_queue(url: str, queue: str, warm: list, seq: list, burst: list, agents: int) -> dict:
    async with await Client.connect(url, queue, timeout_s=600) as client:
        await queue_times(client, warm)
        ms, paths = await queue_times(client, seq)
        busy0 = (await client.stats())["worker"]["busy_s"]
        jobs_per_s = await queue_throughput(client, burst, agents)
        busy_s = (await client.stats())["worker"]["busy_s"] - busy0
        memo_jobs_per_s = await queue_throughput(client, burst * 4, agents)  # answered from the memo: the queue's own rate
        stats = await client.stats()
    return {"ms": ms, "paths": paths, "jobs_per_s": jobs_per_s, "memo_jobs_per_s": memo_jobs_per_s,
            "burst_engine_busy_s": busy_s, "worker_stats": stats}


def by_path(ms: list[float], paths: list[str]) -> dict:
    return {p: summary([m for m, q in zip(ms, paths) if q == p]) for p in sorted(set(paths))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--states", type=int, default=8)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "queue_latency_cpu.json"))
    args = p.parse_args(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews every number here

    warm = rows_for([f"warm{i}" for i in range(3)], args.questions)
    seq = rows_for([f"s{i}" for i in range(args.states)], args.questions)
    seq = seq + seq  # the second pass is answered from the memo
    burst = rows_for([f"b{i}" for i in range(args.states)], args.questions)
    burst_again = rows_for([f"c{i}" for i in range(args.states)], args.questions)  # same shapes, fresh states
    queue = f"statecache:bench:{os.getpid()}"

    with LocalRedis() if not (os.environ.get("REDIS_URL") and answers(os.environ["REDIS_URL"])) else _external() as server:
        url = server.url
        with started_worker(url, queue, 600):
            q = asyncio.run(through_queue(url, queue, warm, seq, burst, args.agents))

    from statecache.engine import Engine  # after the worker is gone: the cores are the engine's alone

    engine = Engine.from_settings(Settings.from_env(precapture=False))
    direct_times(engine, warm)
    d_ms, d_paths = direct_times(engine, seq)
    t0 = time.perf_counter()
    engine.answer(burst)
    direct_rows_per_s = len(burst) / (time.perf_counter() - t0)
    one_ms, _ = direct_times(engine, burst_again)

    if d_paths != q["paths"]:
        print("warning: paths differ between the worker and the direct engine", file=sys.stderr)
    added = [a - b for a, b in zip(q["ms"], d_ms)]
    result = {
        "what": "the same rows through Redis + arq + the worker vs engine.answer called directly",
        "command": "python bench/queue_latency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": load_at_start},
        "model": os.environ.get("STATECACHE_MODEL") or "built-in tiny model",
        "device": str(engine.device),
        "worker_settings": {k: getattr(Settings.from_env(), k) for k in ("poll_delay_s", "max_jobs", "batch")},
        "rows": {"states": args.states, "questions": args.questions, "sequential": len(seq), "burst": len(burst)},
        "sequential_ms": {
            "direct": summary(d_ms),
            "queue": summary(q["ms"]),
            "added_by_queue": summary(added),
            "direct_by_path": by_path(d_ms, d_paths),
            "queue_by_path": by_path(q["ms"], q["paths"]),
            "added_by_path": by_path(added, q["paths"]),
        },
        "throughput": {
            "agents": args.agents,
            "queue_jobs_per_s": round(q["jobs_per_s"], 2),
            "queue_engine_busy_fraction": round(q["burst_engine_busy_s"] * q["jobs_per_s"] / len(burst), 3),
            "direct_rows_per_s_one_call": round(direct_rows_per_s, 2),
            "direct_rows_per_s_one_at_a_time": round(1e3 * len(one_ms) / sum(one_ms), 2),
            "queue_jobs_per_s_memo_rows": round(q["memo_jobs_per_s"], 2),
        },
        "worker_stats": q["worker_stats"]["worker"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    s = result["sequential_ms"]
    print(f"sequential, ms: direct p50 {s['direct']['p50']:.1f} p99 {s['direct']['p99']:.1f} | queue p50 {s['queue']['p50']:.1f} "
          f"p99 {s['queue']['p99']:.1f} | added p50 {s['added_by_queue']['p50']:.1f} p99 {s['added_by_queue']['p99']:.1f}")
    for path, a in s["added_by_path"].items():
        print(f"  {path:<7} direct p50 {s['direct_by_path'][path]['p50']:.1f}  queue p50 {s['queue_by_path'][path]['p50']:.1f}  added p50 {a['p50']:.1f} p99 {a['p99']:.1f}  (n={a['n']})")
    t = result["throughput"]
    print(f"throughput: {t['queue_jobs_per_s']} jobs/s through the queue ({t['agents']} agents), "
          f"engine direct {t['direct_rows_per_s_one_call']} rows/s (one call), {t['direct_rows_per_s_one_at_a_time']} rows/s "
          f"(one row a call); memo rows through the queue: "
          f"{t['queue_jobs_per_s_memo_rows']} jobs/s")
    print(f"wrote {args.out}")
    return 0


class _external:
    """REDIS_URL as a context manager, like LocalRedis."""

    def __enter__(self):
        self.url = os.environ["REDIS_URL"]
        return self

    def __exit__(self, *exc):
        pass


if __name__ == "__main__":
    sys.exit(main())
