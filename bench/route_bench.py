"""Several workers on one Redis, routed (worker.routing): the same agent trace through one worker and through N, each
agent's rows sent with the bare arq `enqueue_job("answer", row)` and `job.result()`; tokens reused, paths, failures.

    python bench/route_bench.py [--agents 16] [--rows-per-agent 24] [--workers 1,2] [--out bench/results/route]

Each configuration gets a fresh private redis-server (producer.local_redis) and fresh workers (`python -m arq
worker.WorkerSettings`, OMP_NUM_THREADS=1 each, STATECACHE_WORKER_ID w0, w1, ...), then the trace of
bench/load_bench.py (`AgentTrace`, the same seed for every configuration): each agent sends its next row when the
previous answer arrives, --rows-per-agent rows each, so every configuration answers the same rows (only the order
between agents differs). Reported per configuration: rows, failed jobs, paths, tokens reused (and against an
unbounded cache), new-page rows (cold + partial: rows that ran a state's tokens beyond what they restored), the jobs each worker
answered (arq's log lines), the fingerprints each advertises at the end (Redis), and tokens reused against the first
configuration's. --kill-after-s: the last worker is SIGKILLed that long after the agents start (every row must
still be answered, by the others); with --replace a new worker is started right after the kill, while the others
serve (its seconds to ready are reported).

Knows the worker through its environment, Redis and results only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from arq.connections import create_pool  # noqa: E402

from bench.load_bench import AgentTrace, Worker, model_vocab, unbounded_reuse  # noqa: E402
from producer.local_redis import LocalRedis  # noqa: E402
from statecache.protocol import QUEUE_NAME, deserialize, fingerprints_key, live_key, private_queue, serialize  # noqa: E402
from statecache.redis_url import arq_settings  # noqa: E402


async def agents(url: str, trace: AgentTrace, rows_per_agent: int, timeout_s: float) -> list[dict]:
    pool = await create_pool(arq_settings(url), job_serializer=serialize, job_deserializer=deserialize)
    out: list[dict] = []

    async def agent(i: int) -> None:
        for _ in range(rows_per_agent):
            row = trace.next_row(i)
            t0 = time.perf_counter()
            rec = {"agent": i, "row": row, "n": len(row.ids)}
            try:
                job = await pool.enqueue_job("answer", row.wire())
                res = await job.result(timeout=timeout_s, poll_delay=0.02)
                if "error" in res:
                    rec["error"] = res["error"]["code"]
                else:
                    rec.update(path=res["path"], reused=int(res["reused"]))
            except Exception as e:  # noqa: BLE001 - a failed job is what this counts
                rec["error"] = f"{type(e).__name__}: {e}"[:160]
            rec["ms"] = 1e3 * (time.perf_counter() - t0)
            out.append(rec)

    try:
        await asyncio.gather(*[agent(i) for i in range(len(trace.agents))])
    finally:
        await pool.aclose()
    return out


async def worker_stats(url: str, alive: list[int]) -> list:
    """Each worker's routing counters: a `stats` job put on the worker's own queue (bench only: agents never do)."""
    pool = await create_pool(arq_settings(url), job_serializer=serialize, job_deserializer=deserialize)
    out = []
    try:
        for k in alive:
            job = await pool.enqueue_job("stats", _queue_name=private_queue(QUEUE_NAME, f"w{k}"))
            st = await job.result(timeout=60, poll_delay=0.05)
            out.append({key: v for key, v in st["worker"].get("routing", {}).items() if key != "live"})
    finally:
        await pool.aclose()
    return out


def start_ready(w: Worker, k: int, r) -> None:
    """Start worker w{k} and wait until it is ready: `Worker.start` returns once the queue's health key is up, which
    the first worker already wrote, so wait for this worker's own heartbeat (its router runs once it is ready)."""
    w.start(300)
    t_ready = time.time()
    while not r.exists(live_key(QUEUE_NAME, f"w{k}")):
        if w.proc.poll() is not None or time.time() - t_ready > 300:
            raise RuntimeError(f"worker w{k} did not come up; see {w.log_path}")
        time.sleep(0.05)


def run_config(n_workers: int, args, vocab: tuple[int, int], logdir: Path) -> dict:
    with LocalRedis() as server:
        workers = []

        def new_worker(k: int) -> Worker:
            w = Worker(server.url, QUEUE_NAME, args.model, args.cache_mb, logdir / f"w{n_workers}_{k}.log")
            w.env.update(STATECACHE_WORKER_ID=f"w{k}", OMP_NUM_THREADS="1", STATECACHE_METRICS_PORT="0")
            workers.append(w)
            return w

        try:
            for k in range(n_workers):
                new_worker(k)
            import redis as redis_sync

            r = redis_sync.Redis.from_url(server.url)
            for k, w in enumerate(workers):
                start_ready(w, k, r)
            trace = AgentTrace(args.agents, seed=args.seed, vocab=vocab, min_state=args.min_state,
                               max_state=args.max_state)
            killer = None
            replaced: dict = {}
            if args.kill_after_s and n_workers > 1:  # SIGKILL the last worker while the agents run
                import threading

                def kill() -> None:
                    workers[-1].proc.kill()
                    if not args.replace:
                        return
                    k = len(workers)  # a new worker in its place, started while the others serve
                    w = new_worker(k)
                    t = time.perf_counter()
                    try:
                        rk = redis_sync.Redis.from_url(server.url)  # this thread's own connection
                        start_ready(w, k, rk)
                        rk.close()
                        replaced["ready_s"] = round(time.perf_counter() - t, 1)
                    except Exception as e:  # noqa: BLE001 - reported with the results
                        replaced["error"] = f"{type(e).__name__}: {e}"[:300]

                killer = threading.Thread(target=lambda: (time.sleep(args.kill_after_s), kill()), daemon=True)
                killer.start()
            t0 = time.perf_counter()
            recs = asyncio.run(agents(server.url, trace, args.rows_per_agent, args.timeout_s))
            if killer is not None:  # the kill (and the new worker's start) happened, or happens now
                killer.join()
            elapsed = time.perf_counter() - t0
            alive = [k for k, w in enumerate(workers) if w.proc.poll() is None]
            routing = asyncio.run(worker_stats(server.url, alive))
            held = {f"w{k}": r.hlen(fingerprints_key(QUEUE_NAME, f"w{k}")) for k in range(len(workers))}
            r.close()
        finally:
            for w in workers:
                w.stop()
    ok = [x for x in recs if "error" not in x]
    ideal = unbounded_reuse([x["row"] for x in recs])
    paths = Counter(x["path"] for x in ok)
    logs = [(logdir / f"w{n_workers}_{k}.log").read_text(errors="replace") for k in range(len(workers))]
    return {
        "workers": n_workers, "killed_after_s": args.kill_after_s if n_workers > 1 else None,
        "replacement": replaced or None, "rows": len(ok), "failed": len(recs) - len(ok),
        "errors": Counter(x["error"] for x in recs if "error" in x).most_common(3),
        "seconds": round(elapsed, 1), "rows_per_s": round(len(ok) / elapsed, 2),
        "paths": dict(sorted(paths.items())), "new_page_rows": paths["cold"] + paths["partial"],
        "tokens": sum(x["n"] for x in ok), "tokens_reused": sum(x["reused"] for x in ok),
        "tokens_reused_unbounded": sum(i for i, x in zip(ideal, recs) if "error" not in x),
        "fingerprints_held": held, "routing": routing,
        "jobs_done_per_worker": [sum(1 for line in log.splitlines() if " ← " in line and ":answer" in line)
                                 for log in logs],
        "p50_ms": round(sorted(x["ms"] for x in ok)[len(ok) // 2], 1) if ok else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--rows-per-agent", type=int, default=24)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--cache-mb", type=int, default=None)
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--min-state", type=int, default=2000)
    ap.add_argument("--max-state", type=int, default=6000)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--kill-after-s", type=float, default=0.0,
                    help="SIGKILL the last worker this long after the agents start (0: never)")
    ap.add_argument("--replace", action="store_true",
                    help="with --kill-after-s: start a new worker right after the kill, while the others serve")
    ap.add_argument("--out", default=None, help="folder for results.json and the workers' logs")
    args = ap.parse_args(argv)
    if args.model is None:
        from statecache.dev.tiny import tiny_model_dir

        args.model = str(tiny_model_dir())
    vocab = (10, model_vocab(args.model))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="route_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    res = []
    for n in [int(x) for x in args.workers.split(",")]:
        print(f"[route] {n} worker(s), {args.agents} agents x {args.rows_per_agent} rows ...", file=sys.stderr, flush=True)
        c = run_config(n, args, vocab, out)
        if res:
            c["reused_vs_first"] = round(c["tokens_reused"] / max(1, res[0]["tokens_reused"]), 4)
        res.append(c)
        print(json.dumps(c), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "configs": res}, indent=1))
    print(f"[route] results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
