"""A simulation of routing over many workers with the real routing code and workers as cost models.

    python bench/route_sim.py [--agents 1000] [--workers 8] [--visits 12] [--kill-at 0.5] [--out FILE]

The trace is bench/load_bench.py's `AgentTrace` (token rows of 2-6k tokens; pages that grow or are replaced).
Each agent sends its next row an exponential think time (--think-s) after its answer. What is real: each worker's
cache is a statecache.cache.index.CheckpointIndex (token-exact lookups, LRU eviction in bytes) planted at
statecache.cache.index.plan_chunks's positions, its observer feeds a statecache.cache.routing.FingerprintLedger whose drained
fingerprints are "advertised" (a dict standing in for the Redis hash), and every row is routed by
statecache.cache.routing (prefix_fingerprints, home_key, choose; take_from for an idle worker's taking). What is a model:
a worker serves its queue one row at a time, a row costing --row-s plus --token-s per token it computes (the tokens
past its restored checkpoint); a checkpoint's bytes are --ckpt-mb (recurrent state) and a group's --kv-kb per state
token (attention K/V); advertising is instant and a dead worker's claims vanish --ttl-s after it dies.

Configurations: one worker with N times the memory and N times the speed (the reference for reuse), N routed
workers, N workers taking rows round-robin (no routing, for contrast), and N routed workers of which one dies at
--kill-at of the run (its queued rows go back to the others once its heartbeat expires; its cache is lost).
Reported: tokens reused (and against the reference), each worker's busy time against the mean, rows per reason,
rows shed and taken, the p50/p99 of the time from a row's send to its answer, and for the kill: rows lost (must be
0), rows re-routed, reuse before and after.

Knows statecache.cache.routing, statecache.cache.index and the trace; no Redis, no torch, no model.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import Counter, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.load_bench import AgentTrace  # noqa: E402
from statecache.cache.index import CheckpointIndex, plan_chunks  # noqa: E402
from statecache.cache.routing import FingerprintLedger, choose, home_key, prefix_fingerprints, take_from  # noqa: E402

ALIGN, STRIDE, TAIL, MAX_CHUNK = 64, 2048, 16, 4096


class SimWorker:
    def __init__(self, name: str, budget_mb: float, speed: float, args):
        self.name, self.speed, self.args = name, speed, args
        self.index = CheckpointIndex(int(budget_mb * 2**20), align=ALIGN)
        self.ledger = FingerprintLedger(ALIGN)
        self.index.observer = self.ledger.observe
        self.advertised: set[str] = set()
        self.queue: deque = deque()  # (row, agent, sent_at, enqueued_at)
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.alive = True
        self.running = None

    def advertise(self) -> None:
        fresh, gone = self.ledger.drain()
        self.advertised |= fresh
        self.advertised -= gone

    def serve(self, row) -> tuple[int, float]:
        """Run a row through the cache model: (tokens reused, service seconds); plants its new checkpoints."""
        ids = np.asarray(row.ids, dtype=np.int64)
        p = row.state_len - row.state_len % ALIGN
        best = self.index.lookup(ids, limit=p)
        start = best.pos if best is not None else 0
        if best is not None:
            self.index.touch(best)
        ends = plan_chunks(start, row.state_len, stride=STRIDE, tail=TAIL, align=ALIGN, max_chunk=MAX_CHUNK)
        if ends:
            g = self.index.add_group(ids[:p], None, int(p * self.args.kv_kb * 1024))
            for e in ends:
                self.index.add_checkpoint(g, e, None, int(self.args.ckpt_mb * 2**20))
            self.index.evict()
        self.advertise()
        computed = len(row.ids) - start
        return start, (self.args.row_s + self.args.token_s * computed) / self.speed


def simulate(args, n_workers: int, mode: str, kill_at: float | None = None, mem_x: float = 1.0) -> dict:
    rng = random.Random(args.seed)
    trace = AgentTrace(args.agents, seed=args.seed, vocab=(10, 248000))
    workers = {f"w{k}": SimWorker(f"w{k}", args.budget_mb * mem_x, mem_x, args) for k in range(n_workers)}
    live = set(workers)
    events: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    left = {i: args.visits for i in range(args.agents)}
    for i in range(args.agents):
        push(rng.expovariate(1 / args.think_s), "send", i)
    rr = 0
    stats = Counter()
    reasons = Counter()
    lat: list[float] = []
    reused_total = tokens_total = 0
    by_phase = {"before": [0, 0], "after": [0, 0]}
    pending_recovery: list = []
    killed = None
    kill_t = None
    total_rows = args.agents * args.visits
    answered = 0

    def route(item, now):
        nonlocal rr
        row = item[0]
        names = sorted(live)
        if mode == "round_robin":
            rr += 1
            return names[rr % len(names)], "round_robin"
        loads = {w: len(workers[w].queue) + (workers[w].running is not None) for w in names}
        p = row.state_len - row.state_len % ALIGN
        fps = prefix_fingerprints(row.ids, p, ALIGN)
        held = {}
        for w in names:  # the Redis hashes: a dead worker's claims stay until its TTL (it is still in `live`)
            depth = max((d + 1 for d, fp in enumerate(fps) if fp in workers[w].advertised), default=0)
            if depth:
                held[w] = depth
        d = choose(loads, held, home_key(row.ids, row.state_len, ALIGN), args.shed_rows)
        return d.worker, d.reason

    def start_next(w: SimWorker, now):
        if w.running is not None or not w.alive:
            return
        if not w.queue and mode != "round_robin" and len(live) > 1:  # idle: take from others past the grace
            cands = [(x.queue[-1][3], x) for x in workers.values() if x is not w and x.alive and x.queue]
            for enq, x in sorted(cands, key=lambda c: c[0]):
                oldest = min(x.queue, key=lambda it: it[3])
                if take_from(0, now - oldest[3], args.grace_s):
                    x.queue.remove(oldest)
                    w.queue.append(oldest)
                    stats["taken"] += 1
                    break
        if not w.queue:
            return
        item = w.queue.popleft()
        reused, service = w.serve(item[0])
        w.running = (item, reused)
        w.busy_s += service
        push(now + service, "done", w.name)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "send":
            i = payload
            row = trace.next_row(i)
            item = (row, i, now, now)
            w, reason = route(item, now)
            reasons[reason] += 1
            workers[w].queue.append(item)
            start_next(workers[w], now)
        elif kind == "done":
            w = workers[payload]
            if not w.alive:
                continue
            (row, i, sent, _), reused = w.running
            w.running = None
            answered += 1
            lat.append(now - sent)
            reused_total += reused
            tokens_total += len(row.ids)
            ph = by_phase["after" if kill_t is not None and now >= kill_t else "before"]
            ph[0] += reused
            ph[1] += len(row.ids)
            left[i] -= 1
            if left[i] > 0:
                push(now + rng.expovariate(1 / args.think_s), "send", i)
            start_next(w, now)
            for x in workers.values():  # an idle worker may now take a row that waited
                if x.running is None and x.alive:
                    start_next(x, now)
            if kill_at is not None and killed is None and answered >= kill_at * total_rows:
                killed = workers[sorted(workers)[n_workers // 2]]
                kill_t = now
                killed.alive = False
                lost = ([killed.running[0]] if killed.running else []) + list(killed.queue)
                killed.running, killed.queue = None, deque()
                stats["in_flight_at_kill"] = len(lost)
                push(now + args.ttl_s, "expire", (killed.name, lost))
        elif kind == "expire":
            name, lost = payload
            live.discard(name)
            lost += list(workers[name].queue)  # rows routed to it before its heartbeat expired
            workers[name].queue.clear()
            stats["rerouted"] += len(lost)
            for item in lost:
                w, reason = route(item, now)
                reasons[reason] += 1
                workers[w].queue.append(item)
                start_next(workers[w], now)
        if kind != "expire":
            for x in workers.values():
                if x.alive and x.running is None and x.queue:
                    start_next(x, now)
            if killed is not None and not killed.alive and killed.queue:  # rows routed to the dead one, waiting
                pass
    busy = {w.name: round(w.busy_s, 1) for w in workers.values()}
    alive_busy = [w.busy_s for w in workers.values() if w is not killed]
    mean = sum(alive_busy) / len(alive_busy)
    lat.sort()
    out = {
        "mode": mode, "workers": n_workers, "memory_x": mem_x, "rows": answered, "rows_lost": total_rows - answered,
        "tokens": tokens_total, "tokens_reused": reused_total, "reuse": round(reused_total / tokens_total, 4),
        "busy_s": busy, "busiest_vs_mean": round(max(alive_busy) / mean, 3) if mean else None,
        "reasons": dict(reasons), "shed": reasons.get("shed", 0), "taken": stats["taken"],
        "latency_p50_s": round(lat[len(lat) // 2], 2), "latency_p99_s": round(lat[int(0.99 * len(lat))], 2),
        "sim_seconds": round(now, 1),
    }
    if kill_at is not None:
        out.update(killed=killed.name if killed else None, killed_at_s=round(kill_t or 0, 1),
                   in_flight_at_kill=stats["in_flight_at_kill"], rerouted=stats["rerouted"],
                   reuse_before_kill=round(by_phase["before"][0] / max(1, by_phase["before"][1]), 4),
                   reuse_after_kill=round(by_phase["after"][0] / max(1, by_phase["after"][1]), 4))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--visits", type=int, default=12, help="rows per agent")
    ap.add_argument("--budget-mb", type=float, default=24000, help="one worker's cache")
    ap.add_argument("--ckpt-mb", type=float, default=50.0, help="a checkpoint's recurrent state")
    ap.add_argument("--kv-kb", type=float, default=32.0, help="a group's attention K/V per state token")
    ap.add_argument("--row-s", type=float, default=0.02, help="a row's fixed cost on one worker")
    ap.add_argument("--token-s", type=float, default=0.00005, help="a computed token's cost on one worker")
    ap.add_argument("--think-s", type=float, default=15.0, help="an agent's mean time between answer and next row")
    ap.add_argument("--shed-rows", type=int, default=8)
    ap.add_argument("--grace-s", type=float, default=5.0)
    ap.add_argument("--ttl-s", type=float, default=10.0)
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the rows answered when one worker dies")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    n = args.workers
    runs = [simulate(args, 1, "single", mem_x=n)]
    print(json.dumps(runs[-1]), flush=True)
    for mode, kill in (("routed", None), ("round_robin", None), ("routed", args.kill_at)):
        runs.append(simulate(args, n, mode, kill))
        runs[-1]["reuse_vs_single"] = round(runs[-1]["tokens_reused"] / runs[0]["tokens_reused"], 4)
        print(json.dumps(runs[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
