"""Where the engine's time goes under agents' load, on one GPU, in one process (no Redis: the worker's GPU-thread
logic replayed synchronously, so what is measured is the engine's own ceiling).

    python3 bench/gpu_profile.py --model CKPT --out DIR [--agents 16] [--seconds 20] [--budget 540]

Steps (each in try/except; results.json rewritten after every step; --budget seconds stops starting new steps):
1. `Engine.from_settings` with precapture, as the worker builds it: start-up seconds per part.
2. `packed`: the packed forward (statecache.plain) of 1, 4 and 8 new states of 2.5-4.5k tokens, with and without
   planting, synchronised wall clock (median of 3).
3. `hits`: N in 1, 4, 16, 64 hits (64-token questions) from N different saved 4096-token states, through
   StateCache.rows_batched (one batched call) and through Engine.answer (the host path included); plus one lone
   hit through Engine.answer (what `statecache score` pays per hit).
4. `closed_loop`: --agents agents of bench/load_bench.py's trace, each sending its next row when answered; a loop
   hands every ready row to `Engine.submit` and runs one `Engine.step`, as worker/gpu_thread.py does. rows/s,
   per-path latency, the engine's phases, and a per-turn timeline (rows, paths, milliseconds) of the first turns.
5. `profile`: torch.profiler over a few seconds of the same loop: the top CUDA kernels and CPU ops (text tables).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

R: dict = {}
T0 = time.perf_counter()
OUT: Path


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f} s]", *a, flush=True)


def save():
    (OUT / "profile.json").write_text(json.dumps(R, indent=1, default=str))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step(name, fn, budget):
    if time.perf_counter() - T0 > budget:
        R.setdefault("skipped", []).append(name)
        log(f"{name}: skipped (budget)")
        return
    log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        R[name] = fn()
    except Exception:  # noqa: BLE001
        R.setdefault("errors", {})[name] = traceback.format_exc()
        log(f"{name} failed:\n{traceback.format_exc()}")
    log(f"{name} done in {time.perf_counter() - t0:.1f} s: {json.dumps(R.get(name), default=str)[:1500]}")
    save()


def phases_since(engine, before: dict) -> dict:
    """The engine's phase counters (Engine.phases) accumulated since the snapshot `before`."""
    return {k: round(v - before.get(k, 0), 3) for k, v in engine.phases.items()}


def rand_ids(rng, n, vocab):
    return [rng.randrange(vocab[0], vocab[1]) for _ in range(n)]


def packed(engine, vocab):
    rng = random.Random(1)
    res = {}
    for N in (1, 4, 8):
        rows = []
        for _ in range(N):
            n = rng.randint(2500, 4500)
            rows.append((rand_ids(rng, n, vocab), [n - 1], [4]))
        tokens = sum(len(r[0]) for r in rows)
        for plant in (False, True):
            calls = [0]

            def between():
                calls[0] += 1

            plans = [engine.cache.plan(len(r[0]) - 40) for r in rows] if plant else None
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                engine.plain.run(rows, plans, between=between)
                sync()
                times.append(time.perf_counter() - t0)
            key = f"{N}_{'plant' if plant else 'plain'}"
            res[key] = {"tokens": tokens, "ms": round(1e3 * statistics.median(times), 2),
                        "all_ms": [round(1e3 * t, 1) for t in times], "ms_per_4k": round(4096e3 * statistics.median(times) / tokens, 2),
                        "between_calls_per_run": calls[0] // 3}
            log(key, res[key])
    from torch.profiler import ProfilerActivity, profile

    rows = rows[:1]
    plans = [engine.cache.plan(len(rows[0][0]) - 40)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.plain.run(rows, plans)
        sync()
    ka = prof.key_averages()
    (OUT / "plant_profile.txt").write_text(ka.table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
                                           + ka.table(sort_by="cuda_time_total", row_limit=30))
    return res


def hits(engine, vocab):
    rng = random.Random(2)
    states = [rand_ids(rng, 4096, vocab) for _ in range(64)]
    t0 = time.perf_counter()
    for k in range(0, 64, 8):  # plant the 64 states (cold rows, 8 per packed forward)
        engine.answer([{"ids": s + rand_ids(rng, 64, vocab), "state_len": 4096, "slots": [4159], "nopts": [4]}
                       for s in states[k:k + 8]])
    sync()
    res = {"plant_64_states_s": round(time.perf_counter() - t0, 2)}

    def rows(n):
        return [{"ids": s + rand_ids(rng, 64, vocab), "state_len": 4096, "slots": [4159], "nopts": [4]} for s in states[:n]]

    for n in (1, 4, 16, 64):
        bt, et = [], []
        for _ in range(5):
            rs = rows(n)
            sync()
            t0 = time.perf_counter()
            got = engine.cache.rows_batched([(r["ids"], r["state_len"], r["slots"], r["nopts"]) for r in rs])
            sync()
            bt.append(time.perf_counter() - t0)
            assert all(a is not None and a.path == "hit" for a in got), [None if a is None else a.path for a in got]
            rs = rows(n)
            sync()
            t0 = time.perf_counter()
            out = engine.answer(rs)
            sync()
            et.append(time.perf_counter() - t0)
            assert all(o.get("path") == "hit" for o in out), [o.get("path") for o in out]
        res[f"{n}_rows_batched_ms"] = round(1e3 * statistics.median(bt[1:]), 2)
        res[f"{n}_engine_answer_ms"] = round(1e3 * statistics.median(et[1:]), 2)
        log(n, res[f"{n}_rows_batched_ms"], res[f"{n}_engine_answer_ms"])
    # the host part of a lone hit: the answer's wall time against a profile of it
    lone = []
    for _ in range(20):
        rs = rows(1)
        t0 = time.perf_counter()
        engine.answer(rs)
        lone.append(time.perf_counter() - t0)
    res["lone_hit_ms_p50"] = round(1e3 * statistics.median(lone), 2)
    res["lone_hit_ms_mean"] = round(1e3 * statistics.mean(lone), 2)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.answer(rows(1))
    (OUT / "lone_hit_profile.txt").write_text(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
        + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    return res


def closed_loop(engine, vocab, agents, seconds, seed, timeline_calls=60, prof=None):
    from load_bench import AgentTrace, lat_summary

    trace = AgentTrace(agents, seed=seed, vocab=vocab)
    ready = []  # (agent, row, ready_at)
    for a in range(agents):
        ready.append((a, trace.next_row(a), time.perf_counter()))
    lat: dict = {}
    paths = Counter()
    timeline = []
    done = [0]
    phases0 = dict(engine.phases)

    def finish(items, results):
        now = time.perf_counter()
        for (a, row, t_ready), res in zip(items, results):
            p = res.get("path", "error")
            paths[p] += 1
            lat.setdefault(p, []).append(1e3 * (now - t_ready))
            done[0] += 1
            ready.append((a, trace.next_row(a), now))

    t_start = time.perf_counter()
    tag = [0]
    inflight: dict = {}  # tag -> (agent, row, ready_at)
    while time.perf_counter() - t_start < seconds:
        items = ready[:]
        ready.clear()
        t0 = time.perf_counter()
        tags = []
        for it in items:
            tag[0] += 1
            inflight[tag[0]] = it
            tags.append(tag[0])
        got = engine.submit([r.wire() for _, r, _ in items], tags, waiting_rows=0) if items else []
        got += engine.step()
        sync()
        if len(timeline) < timeline_calls:
            timeline.append({"kind": "step", "new_rows": len(items), "answered": len(got),
                             "paths": dict(Counter(g.get("path") for _, g in got)),
                             "ms": round(1e3 * (time.perf_counter() - t0), 1)})
        finish([inflight.pop(t) for t, _ in got], [g for _, g in got])
        if prof is not None:
            prof.step()
    el = time.perf_counter() - t_start
    while engine.pending():  # rows still in the schedule are answered (uncounted): the next loop starts empty
        engine.step()
    ph = phases_since(engine, phases0)
    summ = {p: lat_summary(v) for p, v in lat.items()}
    return {"agents": agents, "seconds": round(el, 2), "rows": done[0], "rows_per_s": round(done[0] / el, 2),
            "paths": dict(paths), "latency": summ, "phases": ph, "timeline": timeline,
            "batch_stats": engine.cache.batch.stats if engine.cache.batch is not None else None}


class FakeLoop:
    """A thread running an asyncio loop that wakes every `every_s` and does `work_ms` of Python (msgpack of a
    4k-token row, as arq's job handling does): the GIL contention the worker's event loop puts on the GPU thread."""

    def __init__(self, every_s=0.01, rows_per_wake=1):
        import threading

        self.every_s, self.rows_per_wake, self.stop, self.wakes = every_s, rows_per_wake, False, 0
        self.cpu = 0.0
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        import asyncio

        import msgpack

        row = {"ids": list(range(1000, 5000)), "state_len": 3900, "slots": [3999], "nopts": [4]}

        async def main():
            while not self.stop:
                for _ in range(self.rows_per_wake):
                    msgpack.unpackb(msgpack.packb(row))
                    repr(row)[:80]
                self.wakes += 1
                await asyncio.sleep(self.every_s)
            self.cpu = time.thread_time()

        asyncio.run(main())

    def close(self):
        self.stop = True
        self.t.join(5)


def contention(engine, vocab, agents, seconds):
    out = {}
    base_switch = sys.getswitchinterval()
    for name, loop_kw, switch in (("alone", None, None), ("loop_100hz", {}, None),
                                  ("loop_100hz_x8", {"rows_per_wake": 8}, None),
                                  ("loop_100hz_x8_switch_0.5ms", {"rows_per_wake": 8}, 0.0005),
                                  ("loop_100hz_x8_switch_20ms", {"rows_per_wake": 8}, 0.02)):
        if switch is not None:
            sys.setswitchinterval(switch)
        fake = FakeLoop(**loop_kw) if loop_kw is not None else None
        try:
            got = closed_loop(engine, vocab, agents, seconds, seed=11 + len(out))
        finally:
            if fake is not None:
                fake.close()
            sys.setswitchinterval(base_switch)
        got.pop("timeline", None)
        got["fake_loop"] = None if fake is None else {"wakes": fake.wakes, "cpu_s": round(fake.cpu, 2)}
        out[name] = got
        log(name, got["rows_per_s"], got["phases"], got["fake_loop"])
    return out


def gputhread(engine, vocab, agents, seconds):
    """The worker's GPU thread (worker/gpu_thread.py) with in-process asyncio agents: no Redis, no arq."""
    import asyncio

    from load_bench import AgentTrace, lat_summary

    from worker.gpu_thread import GpuThread

    gpu = GpuThread(lambda: engine)
    gpu.start()
    trace = AgentTrace(agents, seed=21, vocab=vocab)
    lat, paths = {}, Counter()
    phases0 = dict(engine.phases)

    async def agent(i, t_end):
        n = 0
        while time.perf_counter() < t_end:
            row = trace.next_row(i)
            t0 = time.perf_counter()
            res = await gpu.answer(row.wire())
            p = res.get("path", "error")
            paths[p] += 1
            lat.setdefault(p, []).append(1e3 * (time.perf_counter() - t0))
            n += 1
        return n

    async def main():
        t0 = time.perf_counter()
        ns = await asyncio.gather(*[agent(i, t0 + seconds) for i in range(agents)])
        return sum(ns), time.perf_counter() - t0

    rows, el = asyncio.run(main())
    gpu.stop(5)
    ph = phases_since(engine, phases0)
    return {"rows": rows, "seconds": round(el, 2), "rows_per_s": round(rows / el, 2), "paths": dict(paths),
            "latency": {p: lat_summary(v) for p, v in lat.items()},
            "phases": ph, "counters": gpu.counters}


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--steps", default="closed_loop,closed_loop_late,packed,hits,profile")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    from statecache.engine import Engine
    from statecache.settings import Settings

    t0 = time.perf_counter()
    import dataclasses

    s = dataclasses.replace(Settings.from_env(), model=args.model)
    engine = Engine.from_settings(s)
    R["startup_s"] = round(time.perf_counter() - t0, 2)
    R["precapture"] = engine.precapture_info
    R["budget"] = str(engine.budget)
    log("engine ready", R["startup_s"], engine.precapture_info)
    save()
    vocab = (min(1000, engine.vocab_size // 4), engine.vocab_size)
    steps = args.steps.split(",")
    if "packed" in steps:
        step("packed", lambda: packed(engine, vocab), args.budget)
    if "hits" in steps:
        step("hits", lambda: hits(engine, vocab), args.budget)
    if "closed_loop" in steps:
        step("closed_loop", lambda: closed_loop(engine, vocab, args.agents, args.seconds, seed=7), args.budget)
    if "contention" in steps:
        step("contention", lambda: contention(engine, vocab, args.agents, args.seconds), args.budget)
    if "gputhread" in steps:
        step("gputhread", lambda: gputhread(engine, vocab, args.agents, args.seconds), args.budget)
    if "profile" in steps:
        def prof_run():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                got = closed_loop(engine, vocab, args.agents, 4, seed=8)
            ka = prof.key_averages()
            (OUT / "loop_profile.txt").write_text(ka.table(sort_by="cpu_time_total", row_limit=60) + "\n\n"
                                                   + ka.table(sort_by="cuda_time_total", row_limit=40))
            got.pop("timeline", None)
            return got
        step("profile", prof_run, args.budget)
    R["stats"] = engine.stats()
    save()
    log("all done")


if __name__ == "__main__":
    main()
