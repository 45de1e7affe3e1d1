"""The step scheduler on paper: the closed-loop agent trace through the real scheduler (statecache.sched) and through
a model of today's engine, with GPU time from a cost model fitted to H200 measurements in bench/results/.

    python bench/step_sim.py [--agents 16,64] [--seconds 60] [--warmup-s 10] [--budgets 1024,2048,4096]
                             [--chunks 512,1024,2048] [--padded] [--fit-log RESULTS_JSON ...] [--host-ms fit]
                             [--seed 0] [--out FILE.json]

The trace is load_bench's own (`AgentTrace`: states of 2-6k tokens; a visit asks 1-3 questions; then the page grows
by an action, 75%, or a new page replaces it; each agent sends its next row when its last answer arrives): the k-th
agents count replays the very rows load_bench sends for it with the same --seed (`trace_seed`, `token_range`), so a
run compares with load_bench's on the same trace. Token-exact over the real checkpoint index (statecache.sched.IndexView
over statecache.cache.index.CheckpointIndex, the 9B shape's bytes, a 66 GiB budget as the worker had in s11_run2); the
steps plant fork points as the engine does (statecache.cache.index.CheckpointIndex.fork_point: where a row's tokens leave a
cached state).

The cost model (`fit`): milliseconds of one forward's graph = a + b * tokens + c * sequences + d * attention pairs
(each sequence's query-key pairs, L * (start + L / 2)), least squares over the graph replays measured on the H200:
batched hits of 64-token questions from 4096-token states (gpu_batch.py, s9_run1, s10_run4, s11_run2) and one
uncached row of 2496, 3072, 4160 tokens (gpu_plant.py, s10_run4); the host's share of a forward (wall less graph,
the same gpu_batch runs) = h0 + h1 * sequences. The fit's error on every point is printed. `--fit-log RESULTS_JSON`
reads it instead off the steps a worker ran, on whatever card ran them (load_bench results: the engine logs its last
steps' shapes and device time, statecache.step.STEP_LOG_FIELDS): a step costs what the logged steps of its padded
tokens cost (`fit_log`).

Today's policy (`today`), as statecache.engine and worker.gpu_thread run it: the GPU thread takes every row waiting
as a batch; the engine runs one batched forward for its hits and the first row of each grown state, one for the
rows behind grown states, then each new page alone through its planting graph (1.02x the plain graph, measured) in
arrival order, answering it when its forward ends and the rows behind it in a batched forward after; the planting
graph stops every 4 of the 32 layers (`between`) and a stop answers, in a batched forward of their own, the rows
that arrived meanwhile and continue saved states (the rest wait for the next batch). The steps (`steps`): the
scheduler plans a step, the step costs the model's time for its pieces, `done` answers its finished rows.
Both add `--rtt-ms` between an answer and the agent's next row reaching the worker (Redis and arq). `--host-ms`
puts the GPU thread's own time on the steps' path as worker.gpu_thread turns them (launch a step, finish the one
before it, answer its rows; `host_fit` reads it off the engine's step seconds in load_bench results). How near
each form comes to the worker's measurements, by agents count: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from load_bench import AgentTrace, token_range, trace_seed  # noqa: E402

from statecache.cache.budget import checkpoint_bytes, kv_bytes  # noqa: E402
from statecache.dev.checkpoints import real_shape  # noqa: E402
from statecache.model.config import parse_config  # noqa: E402
from statecache.sched import IndexView, Layout, Row, Scheduler, attn_pairs  # noqa: E402
from statecache.settings import Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LAYERS, BETWEEN_LAYERS = 32, 4  # the 9B shape's layers; today's planting graph stops every 4 (Settings.between_layers)
PLANT_RATIO = 1.02  # planting graph / plain graph of the same row (s10_run4: 1.015-1.028)
CACHE_MB = 66_171  # the worker's budget in s11_run2 (results.md)
LOG_BUCKET_STEPS = 10  # fit_log: logged steps a token bucket needs to be a point of the table


# ---- the cost model --------------------------------------------------------------------------------------------------

def measured_points() -> tuple[list, list]:
    """(graph points, host points) from bench/results: graph (sequences, tokens, attention pairs, ms, source);
    host (sequences, wall - graph ms)."""
    graph, host = [], []
    for run in ("s9_run1/batch", "s10_run4/batchv", "s11_run2/batch"):
        d = json.loads((RESULTS / run / "gpu_batch.json").read_text())
        state, q = d.get("args", {}).get("state", 4096), d.get("args", {}).get("question", 64)
        for k, case in d["cases"].items():
            k = int(k)
            graph.append((k, k * q, k * attn_pairs(state, q), case["batched_graph_ms"], f"{run} {k} hits"))
            host.append((k, case["batched_ms"] - case["batched_graph_ms"]))
    d = json.loads((RESULTS / "s10_run4/plantg/gpu_plant.json").read_text())
    for k, case in d["planting_graph"].items():
        n = case["tokens"]
        graph.append((1, n, attn_pairs(0, n), case["plain_graph_ms"], f"s10_run4/plantg plain {n}"))
    return graph, host


class CostModel:
    def __init__(self, coef, hcoef, floor: int = 0, turn_ms: float = 0.0):
        self.coef, self.hcoef, self.floor = coef, hcoef, floor
        self.turn_ms = turn_ms  # the GPU thread's host time per turn (a batch, a stop that runs rows, a step)
        self.padded = False  # True: a forward's tokens cost as its token bucket's (the batched runner's padding)
        self.table: list | None = None  # fit_log's (padded tokens, device ms) in place of the coefficients

    def graph_ms(self, pieces) -> float:
        """pieces: (start, length) per sequence."""
        a, b, c, d = self.coef
        toks = sum(L for _, L in pieces)
        if self.padded:
            toks = padded_tokens(toks)
        if self.table is not None:
            return self.table_ms(toks)
        pairs = sum(attn_pairs(s, L) for s, L in pieces)
        return a + b * max(toks, self.floor) + c * len(pieces) + d * pairs / 1e6

    def table_ms(self, toks: int) -> float:
        """The table's ms at `toks` padded tokens: linear between its points, the first's below them, the last two's
        slope above them."""
        xs, ys = [k for k, _ in self.table], [ms for _, ms in self.table]
        if toks > xs[-1]:
            return ys[-1] + (toks - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(np.interp(toks, xs, ys))

    def host_ms(self, seqs: int) -> float:
        return self.hcoef[0] + self.hcoef[1] * seqs + (self.turn_ms if seqs else 0.0)

    def step_ms(self, pieces) -> float:
        return self.graph_ms(pieces) + self.host_ms(len(pieces))


def padded_tokens(tokens: int) -> int:
    """The tokens a forward of `tokens` runs on the GPU: its token bucket (statecache.run.batch.TOKENS; that module
    imports torch, which the simulator needs for --padded alone)."""
    from statecache.run.batch import TOKENS, bucket

    return bucket(tokens, TOKENS) or tokens


def _nonnegative(X, y):
    """Least squares with no negative cost: a coefficient that comes out below 0 is 0, the others fitted again."""
    coef = np.maximum(np.linalg.lstsq(X, y, rcond=None)[0], 0)
    if (coef == 0).any():
        keep = coef > 0
        coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
    return coef


def _lstsq(graph, floor: int):
    X = np.array([[1.0, max(t, floor), k, pr / 1e6] for k, t, pr, _, _ in graph])
    y = np.array([ms for *_, ms, _ in graph])
    coef = _nonnegative(X, y)
    return coef, float(np.sum(((X @ coef) - y) ** 2 / y ** 2))


def fit() -> tuple[CostModel, list]:
    graph, host = measured_points()
    # below `floor` tokens a forward costs what `floor` tokens cost: reading the weights bounds it (DESIGN.md 8: 64
    # tokens 4.0 ms of matmuls at 3.5 TB/s), not the arithmetic; the floor is the one that fits best
    floor, coef = min(((f, _lstsq(graph, f)) for f in range(0, 513, 16)), key=lambda t: t[1][1])
    coef = coef[0]
    H = np.array([[1.0, k] for k, _ in host])
    hcoef = _nonnegative(H, np.array([h for _, h in host]))
    model = CostModel(tuple(float(c) for c in coef), tuple(float(c) for c in hcoef), floor)
    rows = []
    for k, t, pr, ms, src in graph:
        pieces = [(4096 if "hits" in src else 0, t // k)] * k
        pred = model.graph_ms(pieces)
        rows.append((src, k, t, ms, pred, 100 * (pred - ms) / ms))
    return model, rows


def fit_log(paths: list) -> tuple[CostModel, dict]:
    """A cost model read off the steps a worker ran (load_bench's results.json: each config's
    worker_stats.engine.step_log, statecache.step.STEP_LOG_FIELDS): a step's device ms is the median of the logged
    steps that ran as many padded tokens (the batched runner's token buckets; a bucket needs LOG_BUCKET_STEPS steps),
    linear between buckets, the smallest's below them and the last two's slope above them. The host's share is off
    the device's path in the pipelined step loop (none). It replaced a linear fit in padded tokens, pieces, attention
    pairs and the longest piece's chunks, whose intercept, set by the long steps, overstated the short ones
    (bench/README.md). The table knows the steps of the logged traffic only: a mix of pieces or attention unlike the
    log's at the same bucket costs as the log's. -> (model, summary: its median error over the logged steps)."""
    by: dict = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        for cfg in d.get("worker", {}).get("configs", {}).values():
            st = cfg.get("worker_stats", {}).get("engine", {}).get("step_log", {})
            f = st.get("fields")
            for row in st.get("steps", ()):
                r = dict(zip(f, row))
                by.setdefault(int(r["padded"]), []).append(float(r["device_ms"]))
    table = [(k, float(np.median(v))) for k, v in sorted(by.items()) if len(v) >= LOG_BUCKET_STEPS]
    if len(table) < 2:
        raise SystemExit(f"step_sim: --fit-log found {sum(map(len, by.values()))} logged steps in {paths}, in "
                         f"{len(table)} token buckets of {LOG_BUCKET_STEPS} steps or more; it needs two (a load_bench "
                         f"run of this tree: the worker logs its last steps)")
    model = CostModel((0.0, 0.0, 0.0, 0.0), (0.0, 0.0), 0)
    model.table, model.padded = table, True
    err = [abs(model.table_ms(k) - ms) / ms for k, v in by.items() for ms in v]
    return model, {"steps": len(err), "median_error": float(np.median(err)), "table": table}


def host_fit(paths: list) -> tuple[tuple, list]:
    """The GPU thread's host time a step, from the engine's step seconds in load_bench results (statecache.step.Steps
    `seconds`, the worker's `busy_s`; each config's counters less the config's before it in the same run): launch =
    plan + restore + forward (planning, bringing restores, launching the forwards), finish = done + evict (the scheduler
    told, planting, the budget) + the rest of the turn (the rows handed to the engine): the turn less launch and its
    waits for the device (`read`, `wait`), each a + b * pieces a step, least squares over the configs. Runs of trees
    before `wait` was counted waited for a step without answers (new pages' chunks alone) inside `done`: there the
    wait is taken as `done` less `plant` (the rest of `done` is the scheduler told and the rows' answers, 0.15-0.21 ms
    a step on the CPU machine; bench/README), and the point's label says so. -> ((launch, finish, launch a piece,
    finish a piece) in seconds, the configs' points: (label, pieces a step, launch ms, finish ms))."""
    points = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        prev = None
        for agents, cfg in d.get("worker", {}).get("configs", {}).items():
            st = cfg.get("worker_stats", {})
            eng, wk = st.get("engine", {}), st.get("worker", {})
            if "steps" not in eng or "busy_s" not in wk:
                continue
            cur = {**eng["steps"]["seconds"], "steps": eng["steps"]["steps"], "pieces": eng["steps"]["pieces"],
                   "busy": wk["busy_s"]}
            dlt = {k: v - (prev or {}).get(k, 0) for k, v in cur.items()}
            prev = cur
            n = dlt["steps"]
            if n < 50:
                continue
            launch = dlt["plan"] + dlt["restore"] + dlt["forward"]
            label = f"{Path(path).parent.parent.name} {agents}"
            if "wait" in cur:
                wait = dlt["wait"]
            else:
                wait, label = dlt["done"] - dlt.get("plant", 0.0), label + " (done as wait)"
            finish = dlt["busy"] - launch - dlt["read"] - wait
            points.append((label, dlt["pieces"] / n, 1e3 * launch / n, 1e3 * finish / n))
    if not points:
        raise SystemExit(f"step_sim: --host-ms fit found no engine step seconds in {paths}")
    X = np.array([[1.0, k] for _, k, _, _ in points])
    coef = []
    for col in (2, 3):
        y = np.array([p[col] for p in points])
        c = _nonnegative(X, y) if len(points) > 1 else np.array([y[0], 0.0])
        coef.append(c / 1e3)
    return (float(coef[0][0]), float(coef[1][0]), float(coef[0][1]), float(coef[1][1])), points


# ---- the simulations -----------------------------------------------------------------------------------------------

def make_view(layout: Layout):
    cfg = parse_config({"model_type": "qwen3_5_text", **real_shape("9B")})
    return IndexView(CACHE_MB * 2**20, checkpoint_bytes(cfg, 2), kv_bytes(cfg, 1, 2), layout)


class Agents:
    """The closed loop: agent i's next row reaches the worker rtt after its last answer."""

    def __init__(self, n: int, seed: int, rtt_s: float, max_jobs: int = 0, intake_s: float = 0.0):
        self.trace = AgentTrace(n, seed, token_range(real_shape("9B")["vocab_size"]))  # load_bench's rows on the 9B
        self.rtt_s = rtt_s
        self.max_jobs = max_jobs  # rows the worker holds at once (STATECACHE_MAX_JOBS; 0: no bound): the rest wait in
        self.queued: list = []  # Redis, first in first out
        self.held = 0
        self.intake_s = intake_s  # an answered row's slot takes the next queued row this much later (arq's result,
        self.freeing: list = []  # its poll and start, the row's check and hand-over to the GPU thread): times
        self.serial = 0
        self.arrivals = []  # (time, Row, agent, submitted)
        for i in range(n):
            self._next(i, 0.0)
        self.records = []  # (submitted, answered, path, reused, n)

    def _next(self, agent: int, t: float) -> None:
        r = self.trace.next_row(agent)
        self.serial += 1
        row = Row(self.serial, r.ids, r.state_len, r.slots)
        row.agent, row.submitted = agent, t  # the simulator's own marks
        self.arrivals.append((t + self.rtt_s / 2, row))

    def due(self, t: float) -> list:
        self.queued += [r for at, r in sorted(self.arrivals, key=lambda a: a[0]) if at <= t]
        self.arrivals = [(at, r) for at, r in self.arrivals if at > t]
        self.held -= sum(1 for at in self.freeing if at <= t)
        self.freeing = [at for at in self.freeing if at > t]
        k = len(self.queued) if not self.max_jobs else max(0, min(len(self.queued), self.max_jobs - self.held))
        out, self.queued = self.queued[:k], self.queued[k:]
        self.held += len(out)
        return out

    def next_arrival(self) -> float:
        return min([at for at, _ in self.arrivals] + self.freeing)

    def answer(self, row, t: float, path: str, reused: int) -> None:
        self.freeing.append(t + self.intake_s)
        self.records.append((row.submitted, t + self.rtt_s / 2, path, reused, row.n))
        self._next(row.agent, t + self.rtt_s / 2)


def run_steps(agents: Agents, model: CostModel, seconds: float, budget: int, chunk: int,
              max_piece: int | None = None, pipelined: bool = False, lead_s: float | None = None,
              busy_budget: tuple[int, int] | None = None, host_s: tuple | None = None) -> dict:
    """The scheduler's steps back to back. pipelined: as statecache.step runs them, the next step is planned (from
    the rows arrived by then) as soon as this one is launched, and runs right after it, so a row arriving while a
    step runs joins the step after the next one; else the next step is planned when this one has ended. lead_s
    (pipelined): the next step is planned this long before this one ends instead (the time its planning and launch
    take), so rows arriving while this one runs join it. busy_budget (tokens, rows): the scheduler's busy_tokens and
    busy_rows (statecache.sched.steps.Scheduler.budget; the worker's: Settings.step_tokens_busy, three quarters of
    max_jobs). host_s (launch, finish, launch a piece, finish a piece), seconds: the GPU thread's own time, as
    worker.gpu_thread turns it (implies pipelined): a turn takes the rows arrived by its start, plans and launches a
    step (launch + pieces * launch a piece of host time; the step runs on the device once that is done and the step
    before it has ended), then waits for the step launched before it to end and finishes it (finish + its pieces *
    finish a piece: its answers read, the scheduler told, the cache's budget enforced, the turn's other work), answering
    its rows then; with nothing in flight and nothing to plan it waits for the next row (`host_fit`)."""
    layout = Layout.from_settings()
    view = make_view(layout)
    busy_tokens, busy_rows = busy_budget or (None, None)
    sched = Scheduler(view, layout, budget_tokens=budget, chunk_tokens=chunk, max_piece=max_piece,
                      busy_tokens=busy_tokens, busy_rows=busy_rows)
    rows: dict = {}
    t, busy, steps, padded = 0.0, 0.0, 0, 0

    def take_and_plan(now: float):
        for r in agents.due(now):
            rows[r.rid] = r
            p = layout.end(r.state_len)
            found = view.lookup(r.ids, p)  # as statecache.step.Steps.add: where its tokens leave a cached state
            fork = view.index.fork_point(r.ids, p, found.pos if found is not None else 0)[1]
            r.forks = (fork,) if fork else ()
            sched.add(r, found)
        return sched.plan()

    if host_s is not None:
        launch_s, finish_s, launch_piece_s, finish_piece_s = host_s
        gpu_end, flight = 0.0, None  # when the device is done with what it was given; (step, its end) in flight
        while t < seconds:
            cur = take_and_plan(t)
            launched = None
            if cur.pieces:
                ms = model.step_ms([(pc.start, pc.tokens) for pc in cur.pieces])
                t += launch_s + launch_piece_s * len(cur.pieces)
                gpu_end = max(t, gpu_end) + ms / 1e3
                launched = (cur, gpu_end)
                busy += ms / 1e3
                steps += 1
                if model.padded:
                    padded += padded_tokens(cur.tokens)
            if flight is not None:
                t = max(t, flight[1]) + finish_s + finish_piece_s * len(flight[0].pieces)
                for f in sched.done(flight[0]):
                    agents.answer(rows.pop(f.row.rid), t, f.path, f.reused)
            elif launched is None:
                t = max(t, agents.next_arrival())
            flight = launched
        return {"steps": steps, "busy_s": busy, "end_s": max(t, gpu_end),
                "tokens_per_step": sched.stats["tokens"] / max(1, steps),
                "padding": 1 - sched.stats["tokens"] / max(1, padded) if model.padded else None}

    cur = take_and_plan(t)
    while t < seconds:
        if not cur.pieces:
            t = max(t, agents.next_arrival())
            cur = take_and_plan(t)
            continue
        ms = model.step_ms([(pc.start, pc.tokens) for pc in cur.pieces])
        if pipelined:  # planned while cur runs, before its `done`
            nxt = take_and_plan(t if lead_s is None else max(t, t + ms / 1e3 - lead_s))
        t += ms / 1e3
        busy += ms / 1e3
        steps += 1
        if model.padded:
            padded += padded_tokens(cur.tokens)
        for f in sched.done(cur):
            agents.answer(rows.pop(f.row.rid), t, f.path, f.reused)
        cur = nxt if pipelined else take_and_plan(t)
    return {"steps": steps, "busy_s": busy, "end_s": t, "tokens_per_step": sched.stats["tokens"] / max(1, steps),
            "padding": 1 - sched.stats["tokens"] / max(1, padded) if model.padded else None}


def run_today(agents: Agents, model: CostModel, seconds: float) -> dict:
    layout = Layout.from_settings()
    view = make_view(layout)
    clock = {"t": 0.0, "busy": 0.0}
    queue: list = []
    serial = [0]

    def gpu(pieces, extra_ms: float = 0.0) -> None:
        ms = model.step_ms(pieces) + extra_ms
        clock["t"] += ms / 1e3
        clock["busy"] += ms / 1e3

    def lookup(row):
        p = layout.end(row.state_len)
        found = view.lookup(row.ids, p)
        return found, (found.pos if found is not None else 0), p

    def plant(row, start):
        serial[0] += 1
        pos = layout.positions(start, row.state_len)
        if pos:
            view.planted(("today", serial[0]), row.ids, layout.end(row.state_len), pos, last=True)

    def batched(items) -> None:
        """One rows_batched call: (row, start) pieces [start, n); grown rows plant their new end."""
        if not items:
            return
        gpu([(c, r.n - c) for r, c, _ in items])
        for r, c, p in items:
            if c < p:
                plant(r, c)
            agents.answer(r, clock["t"], "hit" if c == p else "partial", c)

    def ready(rows) -> tuple[list, list]:
        """Rows that continue saved states (batched now) and the others; one per state (the rest behind it)."""
        now, behind, rest, seen = [], [], [], {}
        for r in rows:
            found, c, p = lookup(r)
            if c == 0:
                rest.append(r)
                continue
            key = tuple(r.ids[:p])
            if key in seen and c < p:
                behind.append(r)
            else:
                seen[key] = True
                now.append((r, c, p))
        return now, behind, rest

    while clock["t"] < seconds:
        queue += agents.due(clock["t"])
        if not queue:
            clock["t"] = max(clock["t"], agents.next_arrival())
            continue
        batch, queue = queue, []
        now, behind, new = ready(batch)
        batched(now)  # hits and the first row of each grown state
        b2, behind2, _ = ready(behind)
        batched(b2 + [(r, *lookup(r)[1:]) for r in behind2])  # the rows behind grown states, now hits
        pages, follow = [], {}
        for r in new:
            key = tuple(r.ids[: layout.end(r.state_len)])
            if key in follow:
                follow[key].append(r)
            else:
                follow[key] = []
                pages.append((key, r))
        declined: set = set()
        for key, r in pages:
            total = model.graph_ms([(0, r.n)]) * PLANT_RATIO + model.host_ms(1)
            stops = LAYERS // BETWEEN_LAYERS
            for _ in range(stops):
                gpu([], total / stops - model.step_ms([]))
                queue += agents.due(clock["t"])
                offered = [q for q in queue if q.rid not in declined]
                if not offered:
                    continue
                now, behind, rest = ready(offered)
                taken = {r_.rid for r_, _, _ in now}
                declined |= {q.rid for q in rest + behind}
                queue = [q for q in queue if q.rid not in taken]
                batched(now)
            plant(r, 0)
            agents.answer(r, clock["t"], "cold", 0)
            batched([(b, *lookup(b)[1:]) for b in follow[key]])
    return {"busy_s": clock["busy"], "end_s": clock["t"]}


def summary(agents: Agents, warmup_s: float, seconds: float, busy_s: float, end_s: float) -> dict:
    recs = [r for r in agents.records if warmup_s <= r[1] < seconds]
    span = seconds - warmup_s

    def lat(path=None):
        xs = sorted(1e3 * (b - a) for a, b, p, _, _ in recs if path is None or p == path)
        if not xs:
            return {"n": 0}
        q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
        return {"n": len(xs), "p50": round(q(0.5), 1), "p99": round(q(0.99), 1), "mean": round(statistics.mean(xs), 1)}

    reused = sum(r[3] for r in recs) / max(1, sum(r[4] for r in recs))
    computed = sum(r[4] - r[3] for r in recs) / max(1, len(recs))  # tokens computed a row (load_bench's "tokens a row")
    return {"rows_per_s": round(len(recs) / span, 1), "all": lat(), "hit": lat("hit"), "partial": lat("partial"),
            "cold": lat("cold"), "reused": round(reused, 3), "tokens_per_row": round(computed),
            "gpu_busy": round(busy_s / end_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="16,64")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--budgets", default="1024,2048,4096")
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--rtt-ms", type=float, default=8.0,
                    help="an answer to the agent and its next row to the worker (s56_run1, one agent on an H100 host: "
                         "6.0 ms from enqueue to the GPU thread, 1.9 ms from the answer to the agent)")
    ap.add_argument("--turn-ms", type=float, default=4.8,
                    help="the GPU thread's host time per turn that runs rows, beyond the forward's own host share "
                         "(s11_run2, 16 agents: between stops took 18.7 s over 1603 calls, 11.7 ms each, where a "
                         "batched forward of one hit takes 6.9 ms wall: 4.8 ms of taking, checking, answering)")
    ap.add_argument("--step-turn-ms", type=float, default=None,
                    help="the same for a step of the scheduler (default: --turn-ms; 0: a step loop that prepares the "
                         "next step while the GPU runs this one)")
    ap.add_argument("--max-piece", type=int, default=None,
                    help="the most tokens one row advances in a step (the batched runner's longest piece: 512)")
    ap.add_argument("--pipelined", action="store_true",
                    help="steps as statecache.step runs them: the next planned while this one runs (use with "
                         "--step-turn-ms 0)")
    ap.add_argument("--lead-ms", type=float, default=None,
                    help="with --pipelined: plan the next step this long before the running one ends (default: as "
                         "soon as it is launched)")
    ap.add_argument("--host-ms", default=None, metavar="fit|LAUNCH,FINISH[,LAUNCH_PIECE,FINISH_PIECE]",
                    help="steps: the GPU thread's host time a step in ms, launch and finish, plus each per piece of the "
                         "step, as worker.gpu_thread turns (implies --pipelined; `host_fit`); fit: from the engine's "
                         "step seconds in the --fit-log results")
    ap.add_argument("--intake-ms", type=float, default=0.0,
                    help="with --max-jobs: an answered row's place takes the next row queued in Redis this much later "
                         "(arq's result and poll, the job's start, the row's hand-over to the GPU thread)")
    ap.add_argument("--busy-budget", default=None, metavar="TOKENS@ROWS",
                    help="steps: a step planned while the scheduler holds at least ROWS rows gets a budget of TOKENS "
                         "(Scheduler.budget; the worker's default: 3072@18 with --max-jobs 24)")
    ap.add_argument("--policies", default="today,steps", help="which of today,steps to run")
    ap.add_argument("--max-jobs", type=int, default=0,
                    help="rows the worker takes from Redis at once, the rest waiting there in order (the worker's "
                         f"STATECACHE_MAX_JOBS, {Settings.from_env({}).max_jobs}; default 0: every row goes straight "
                         "to the scheduler)")
    ap.add_argument("--padded", action="store_true",
                    help="a step's tokens cost as its token bucket's, as the batched runner pads its forwards, and the "
                         "table gives the share of padding (the fit's points are whole buckets but for the one-row "
                         "graphs of 2496 and 4160 tokens; needs torch, for the buckets)")
    ap.add_argument("--fit-log", nargs="+", default=None, metavar="RESULTS_JSON",
                    help="read the cost model off the steps a worker logged in these load_bench results (device ms by "
                         "padded tokens; implies --padded) instead of the H200 graph timings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.fit_log:
        model, info = fit_log(args.fit_log)
        errors = []
        args.padded = True
        print(f"[fit-log] {info['steps']} logged steps, median |error| {100 * info['median_error']:.1f}%")
    else:
        model, errors = fit()
    host = None
    if args.host_ms == "fit":
        if not args.fit_log:
            raise SystemExit("step_sim: --host-ms fit reads the --fit-log results")
        host, points = host_fit(args.fit_log)
        print("| host of | pieces a step | launch ms | finish ms |\n| --- | ---: | ---: | ---: |")
        for label, k, la, fi in points:
            print(f"| {label} | {k:.2f} | {la:.2f} | {fi:.2f} |")
    elif args.host_ms:
        ms = [float(x) for x in args.host_ms.split(",")]
        if len(ms) not in (2, 4):
            raise SystemExit("step_sim: --host-ms takes fit, LAUNCH,FINISH or LAUNCH,FINISH,LAUNCH_PIECE,FINISH_PIECE")
        host = tuple(x / 1e3 for x in ms + [0.0, 0.0][: 4 - len(ms)])
    if host is not None:
        print(f"[host] launch {1e3 * host[0]:.2f} + {1e3 * host[2]:.2f} * pieces ms, finish {1e3 * host[1]:.2f} + "
              f"{1e3 * host[3]:.2f} * pieces ms a step")
    a, b, c, d = model.coef
    model.turn_ms = args.turn_ms
    model.padded = args.padded
    if args.step_turn_ms is None:
        args.step_turn_ms = args.turn_ms
    graph = (f"{a:.3f} + {b * 1e3:.4f} us/token * max(tokens, {model.floor}) + {c:.4f} * seqs + {d:.4f} * M "
             f"attention pairs") if model.table is None else \
        "by padded tokens " + ", ".join(f"{k}: {ms:.1f}" for k, ms in model.table)
    print(f"[fit] graph ms = {graph}; host ms = {model.hcoef[0]:.3f} + {model.hcoef[1]:.4f} * seqs + {args.turn_ms} "
          f"a turn of the GPU thread")
    if errors:  # the graph points of the H200 fit
        print("| point | seqs | tokens | measured ms | model ms | error |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for src, k, t, ms, pred, err in errors:
        print(f"| {src} | {k} | {t} | {ms:.2f} | {pred:.2f} | {err:+.1f}% |")
    out = {"fit": {"coef": model.coef, "table": model.table, "host": model.hcoef, "points": errors}, "runs": []}
    policies = args.policies.split(",")
    busy_budget = None if args.busy_budget is None else tuple(int(x) for x in args.busy_budget.split("@"))
    configs = [("today", None, None)] * ("today" in policies) + [
        ("steps", B, C) for B in map(int, args.budgets.split(",")) for C in map(int, args.chunks.split(","))
        if C <= B and "steps" in policies]
    print("\n| agents | policy | budget | chunk | rows/s | p50 ms | p99 ms | hit p50 / p99 | partial p50 / p99 | "
          "cold p50 / p99 | reused | tokens a row | GPU busy | tokens a step | padding |\n| ---: | --- | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, n in enumerate(map(int, args.agents.split(","))):
        for policy, B, C in configs:
            t0 = time.perf_counter()
            agents = Agents(n, trace_seed(args.seed, i), args.rtt_ms / 1e3, args.max_jobs,  # load_bench's i-th trace
                            args.intake_ms / 1e3)
            model.turn_ms = args.turn_ms if policy == "today" else args.step_turn_ms
            info = run_today(agents, model, args.seconds) if policy == "today" else \
                run_steps(agents, model, args.seconds, B, C, args.max_piece, args.pipelined,
                          None if args.lead_ms is None else args.lead_ms / 1e3, busy_budget, host)
            s = summary(agents, args.warmup_s, args.seconds, info["busy_s"], info["end_s"])
            s.update(agents=n, policy=policy, budget=B, chunk=C, sim_s=round(time.perf_counter() - t0, 1),
                     turn_ms=model.turn_ms, tokens_per_step=round(info.get("tokens_per_step", 0)),
                     padding=None if info.get("padding") is None else round(info["padding"], 4))
            out["runs"].append(s)
            pp = lambda k: f"{s[k].get('p50', '-')} / {s[k].get('p99', '-')}"  # noqa: E731
            fill = (f"{s['tokens_per_step']:,} | " + ("-" if s["padding"] is None else f"{s['padding']:.1%}")
                    if policy == "steps" else "- | -")
            print(f"| {n} | {policy} | {B or '-'} | {C or '-'} | {s['rows_per_s']} | {s['all']['p50']} | "
                  f"{s['all']['p99']} | {pp('hit')} | {pp('partial')} | {pp('cold')} | {s['reused']:.0%} | "
                  f"{s['tokens_per_row']} | {s['gpu_busy']:.0%} | {fill} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
