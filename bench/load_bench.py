"""Agents under load: a synthetic agent trace through the real worker and Redis, one row at a time through
`statecache score`, and transformers on a sample of the same rows; JSON, a markdown table and plots in --out.

    python bench/load_bench.py --out DIR [--model CKPT] [--agents 1,4,16,64] [--seconds 30] [--warmup-s 10] [--rows 0]
                               [--score-rows 200] [--score-warmup 40] [--hf-rows 16] [--cache-mb N] [--profile-s S]

The trace (`AgentTrace`): each agent has a state `goal | steps | page` of 2-6k tokens (token rows: random ids from
a seeded RNG below the model's vocabulary). A visit asks 1-3 questions about the state (10-90 tokens each, 1-2
answer slots in the question, 2-6 options each); after the visit the page grows by an action (75%: tokens appended
at the end) or is replaced (25%: a new step line, a new page: a change in the middle). Each agent sends its next
row when the previous answer arrives. Every configuration (agents count) and the `score` run use their own seed,
so no two share a state (random ids: two states share no 64-token prefix), over one worker started once.

What runs (in this order, so only one model is on the device at a time):
1. a private redis-server (producer.local_redis) and `python -m arq worker.WorkerSettings` (env REDIS_URL,
   STATECACHE_QUEUE, STATECACHE_MODEL, STATECACHE_PRECAPTURE=1, STATECACHE_CACHE_MB when --cache-mb is given;
   STATECACHE_ENGINE / STATECACHE_DEVICE / STATECACHE_DTYPE pass through from the environment). Start-up: the
   process's start to its health key (arq writes it after the worker's start-up hook: engine built, graphs
   captured), and the engine's own weight-load time when its stats report it.
2. for each agents count: agents run for --warmup-s, untimed, then for --seconds (or until --rows answers): rows/s
   (answers in the timed stretch over its length), per-path counts, latency p50/p99 per path (from enqueue to
   answer: queueing included) of the rows sent in it, tokens reused against an unbounded cache on the same trace
   (`unbounded_reuse`), failed jobs (exceptions and error results), the worker's counters. The warm-up keeps the
   agents' synchronised first visits (every agent's first page is new, all at once: at 64 agents ~250k tokens,
   every one of the run's slowest rows) out of a figure meant for a service in its steady state; the same figures
   over every row from the start are kept beside them (`from_start`).
3. the worker stops; `python -m statecache.cli score` (its own engine, precaptured) gets a trace of 4 agents'
   rows interleaved, one JSON line at a time, each timed from write to answer; the first --score-warmup rows
   are not timed.
4. transformers (`Qwen3_5ForCausalLM.from_pretrained`, bf16 on CUDA, float32 on the CPU), uncached, on --hf-rows
   rows of the score trace: batches of 8 (right-padded: causal, so the answers at real positions are exact) and
   one at a time; the LM head is applied at the answer slots only. Its answers are compared with score's.

Knows the worker only through its environment, Redis and its results; imports neither worker nor the engine
into this process (transformers and the tiny model's maker aside).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from producer.client import AnswerTimeout, Client, RowRejected, WorkerError  # noqa: E402
from producer.local_redis import LocalRedis, answers  # noqa: E402
from producer.demo import worker_alive  # noqa: E402

ALIGN = 64  # the cache's checkpoint alignment (CacheSettings.align): what any cache of this design can restore to
PATHS = ("memo", "hit", "partial", "cold", "plain")


# ---- the trace ----------------------------------------------------------------------------------------------------


@dataclass
class Row:
    agent: int
    ids: list[int]
    state_len: int
    slots: list[int]
    nopts: list[int]
    new_page: bool = False  # the first row of a visit to a page no earlier row had (the agent's first, or replaced)

    def wire(self) -> dict:
        return {"ids": self.ids, "state_len": self.state_len, "slots": self.slots, "nopts": self.nopts}


class AgentState:
    """One agent: goal, steps, page as token lists; `visit()` gives the rows of one visit, then moves on."""

    def __init__(self, index: int, rng: random.Random, vocab: tuple[int, int], min_state: int = 2000,
                 max_state: int = 6000):
        self.index, self.rng, self.vocab = index, rng, vocab
        self.min_state, self.max_state = min_state, max_state
        self.goal = self._tokens(rng.randint(40, 200))
        self.steps = [self._tokens(rng.randint(20, 80)) for _ in range(rng.randint(2, 8))]
        self.page = self._new_page()
        self.fresh = True  # the page is new: the next visit's first row computes it
        self.moves: Counter = Counter()

    def _tokens(self, n: int) -> list[int]:
        lo, hi = self.vocab
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def _head(self) -> int:
        return len(self.goal) + sum(map(len, self.steps))

    def _new_page(self) -> list[int]:
        target = self.rng.randint(self.min_state, max(self.min_state, self.max_state - 1000))
        return self._tokens(max(200, target - self._head()))

    def state(self) -> list[int]:
        return self.goal + [t for s in self.steps for t in s] + self.page

    def visit(self) -> list[Row]:
        state = self.state()
        rows = []
        for _ in range(self.rng.randint(1, 3)):
            q = self._tokens(self.rng.randint(10, 90))
            n = len(state) + len(q)
            slots = [n - 1]
            if self.rng.random() < 0.5 and len(q) > 4:
                slots.insert(0, len(state) + self.rng.randrange(1, len(q) - 1))
            rows.append(Row(self.index, state + q, len(state), slots, [self.rng.randint(2, 6) for _ in slots],
                            new_page=self.fresh and not rows))
        self._move()
        return rows

    def _move(self) -> None:
        action = self._tokens(self.rng.randint(30, 150))
        if self.rng.random() < 0.75 and len(self.state()) + len(action) <= self.max_state:
            self.page += action  # the page grows at its end
            self.fresh = False
            self.moves["grow"] += 1
        else:
            self.steps.append(self._tokens(self.rng.randint(20, 80)))  # a step taken, a new page
            if self._head() > self.max_state // 2:
                self.steps = self.steps[-4:]  # an agent's history is summarised now and then
            self.page = self._new_page()
            self.fresh = True
            self.moves["replace"] += 1


class AgentTrace:
    """`agents` agents, seeded; `next_rows(i)` gives agent i's next visit's rows (generated lazily, recorded)."""

    def __init__(self, agents: int, seed: int, vocab: tuple[int, int], min_state: int = 2000, max_state: int = 6000):
        self.agents = [AgentState(i, random.Random(f"{seed}/{i}"), vocab, min_state, max_state) for i in range(agents)]
        self.pending: list[list[Row]] = [[] for _ in range(agents)]

    def next_row(self, i: int) -> Row:
        if not self.pending[i]:
            self.pending[i] = self.agents[i].visit()
        return self.pending[i].pop(0)

    def interleaved(self, n: int) -> list[Row]:
        """n rows, agents taking turns (a sequential user of several agents)."""
        return [self.next_row(k % len(self.agents)) for k in range(n)]


def token_range(vocab_size: int) -> tuple[int, int]:
    """The ids the agents' rows draw from: above the special tokens of small tokenizers, below the vocabulary."""
    return (min(1000, vocab_size // 4), vocab_size)


def trace_seed(seed: int, k: int) -> int:
    """The seed of the trace of a run's k-th agents count: bench/step_sim.py replays the same rows for the same --seed,
    --agents order and vocabulary (token_range)."""
    return seed * 1000 + 1 + k


def unbounded_reuse(rows: list[Row], align: int = ALIGN) -> list[int]:
    """For each row in order: the tokens an unbounded cache could restore, the longest prefix it shares with any
    earlier row's state (and within its own state): a whole earlier state as it is (a state's end is a checkpoint),
    else aligned down (as if a checkpoint sat at every aligned position). Rows of different agents share no prefix
    (random ids), so only the same agent's earlier states are compared."""
    seen: dict[int, list[np.ndarray]] = {}
    out = []
    for r in rows:
        ids = np.asarray(r.ids, dtype=np.int64)
        best = 0
        for prev in seen.get(r.agent, ()):
            m = min(len(prev), r.state_len)
            if m <= best:
                continue
            diff = np.flatnonzero(prev[:m] != ids[:m])
            shared = int(diff[0]) if len(diff) else m
            whole = shared == len(prev)  # the earlier state is a prefix of this one: its end checkpoint serves
            best = max(best, shared if whole else shared - shared % align)
        out.append(best)
        states = seen.setdefault(r.agent, [])
        if not states or len(states[-1]) != r.state_len or not np.array_equal(states[-1], ids[: r.state_len]):
            states.append(ids[: r.state_len])
            del states[:-8]  # older states of the agent are covered by the newer ones' shared prefixes
    return out


# ---- statistics ---------------------------------------------------------------------------------------------------


def pct(xs, q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def lat_summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99),
            "mean_ms": round(statistics.fmean(ms), 2) if ms else None}


@dataclass
class Record:
    agent: int
    state_len: int
    n: int
    ms: float
    path: str | None = None
    sent_s: float = 0.0  # from the agents' start
    done_s: float = 0.0
    reused: int = 0
    computed: int = 0
    probs: list | None = None
    error: str | None = None
    ideal: int = 0
    new_page: bool = False  # Row.new_page


def summarise(records: list[Record], elapsed_s: float, answered: int | None = None) -> dict:
    """answered: the answers that rows/s counts over elapsed_s (default: every answered record's)."""
    ok = [r for r in records if r.error is None]
    by_path: dict[str, list[float]] = {}
    for r in ok:
        by_path.setdefault(r.path, []).append(r.ms)
    reused = sum(r.reused for r in ok)
    ideal = sum(r.ideal for r in ok)
    tokens = sum(r.n for r in ok)
    return {
        "rows": len(ok), "failed": len(records) - len(ok), "seconds": round(elapsed_s, 2),
        "rows_per_s": round((len(ok) if answered is None else answered) / elapsed_s, 3) if elapsed_s > 0 else None,
        "paths": {p: len(by_path.get(p, [])) for p in sorted(set(PATHS) | set(by_path))},
        "latency": lat_summary([r.ms for r in ok]),
        "latency_by_path": {p: lat_summary(v) for p, v in sorted(by_path.items())},
        "latency_new_page": lat_summary([r.ms for r in ok if r.new_page]),
        "tokens": tokens, "tokens_reused": reused, "tokens_reused_unbounded": ideal,
        "reused_vs_unbounded": round(reused / ideal, 4) if ideal else None,
        "reused_of_all_tokens": round(reused / tokens, 4) if tokens else None,
        "tokens_computed_per_row": round((tokens - reused) / len(ok)) if ok else None,
        "errors": Counter(r.error for r in records if r.error).most_common(5),
    }


def steady_summary(records: list[Record], elapsed_s: float, warmup_s: float) -> dict:
    """summarise over the timed stretch after warmup_s: latency of the rows sent in it, rows/s of the answers that
    came in it; the whole run's figures beside (`from_start`, as every run before --warmup-s counted)."""
    whole = summarise(records, elapsed_s)
    if warmup_s <= 0:
        return {**whole, "warmup_s": 0.0}
    timed = [r for r in records if r.sent_s >= warmup_s]
    answered = sum(1 for r in records if r.error is None and r.done_s >= warmup_s)
    s = summarise(timed, max(elapsed_s - warmup_s, 1e-9), answered)
    s["warmup_s"] = warmup_s
    s["from_start"] = {k: whole[k] for k in ("rows", "failed", "seconds", "rows_per_s", "paths", "latency",
                                             "latency_by_path", "latency_new_page", "reused_of_all_tokens")}
    return s


# ---- the worker ---------------------------------------------------------------------------------------------------


def model_vocab(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


class Worker:
    """`python -m arq worker.WorkerSettings` as a subprocess, its log in a file; `start()` waits for its health key."""

    def __init__(self, url: str, queue: str, model: str, cache_mb: int | None, log_path: Path):
        self.url, self.queue, self.log_path = url, queue, log_path
        self.env = {**os.environ, "REDIS_URL": url, "STATECACHE_QUEUE": queue, "STATECACHE_MODEL": model,
                    "STATECACHE_PRECAPTURE": os.environ.get("STATECACHE_PRECAPTURE", "1"),
                    "STATECACHE_HEALTH_INTERVAL_S": "1"}
        if cache_mb is not None:
            self.env["STATECACHE_CACHE_MB"] = str(cache_mb)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> dict:
        self.log = open(self.log_path, "w")
        t0 = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "arq", "worker.WorkerSettings"], cwd=ROOT, env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        while not worker_alive(self.url, self.queue):
            if self.proc.poll() is not None or time.time() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"the worker did not come up; its log ends:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        return {"spawn_to_ready_s": round(time.time() - t0, 2), "spawned_at": t0, "ready_at": time.time()}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


async def run_agents(client: Client, trace: AgentTrace, seconds: float, max_rows: int, timeout_s: float) -> tuple[list[Record], float]:
    records: list[Record] = []
    t_start = time.perf_counter()
    until = t_start + seconds
    last_done = [t_start]

    async def agent(i: int) -> None:
        while time.perf_counter() < until and (not max_rows or len(records) < max_rows):
            row = trace.next_row(i)
            t0 = time.perf_counter()
            rec = Record(i, row.state_len, len(row.ids), 0.0, new_page=row.new_page)
            try:
                res = await client.answer(row.wire(), timeout_s=timeout_s)
                rec.path, rec.reused, rec.computed = res["path"], int(res["reused"]), int(res["computed"])
                rec.probs = res["probs"]
            except (RowRejected, AnswerTimeout, WorkerError) as e:
                rec.error = f"{type(e).__name__}: {str(e)[:120]}"
            t1 = time.perf_counter()
            rec.ms, rec.sent_s, rec.done_s = 1e3 * (t1 - t0), t0 - t_start, t1 - t_start
            rec._row = row  # type: ignore[attr-defined]
            records.append(rec)
            last_done[0] = time.perf_counter()
            if rec.error and "AnswerTimeout" in rec.error:
                return

    await asyncio.gather(*[agent(i) for i in range(len(trace.agents))])
    rows = [r._row for r in records]  # type: ignore[attr-defined]
    # the unbounded cache sees the rows in the order they were answered (what the worker saw, near enough)
    for rec, ideal in zip(records, unbounded_reuse(rows)):
        rec.ideal = ideal if rec.error is None else 0
    return records, last_done[0] - t_start


class GpuBusy:
    """nvidia-smi's utilization.gpu (the share of each ~1/6 s sample in which some kernel ran), sampled every 200 ms
    while a configuration's agents run: how much of the time the worker kept the device busy. `mean` is None where
    there is no nvidia-smi (the CPU)."""

    def __init__(self):
        self.proc = None
        self.samples: list[float] = []

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.samples = [float(x) for x in out.split() if x.replace(".", "", 1).isdigit()]
        return False

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 1) if self.samples else None


CHECK_ROWS = 24  # the worker's answers to this many rows of its first configuration are asked again of score


async def worker_phase(url: str, queue: str, args, vocab: tuple[int, int], out: dict, save=lambda: None,
                       check: list | None = None) -> dict:
    """The agents' configurations through the worker; check (a list): filled with (row, the worker's answer) for
    CHECK_ROWS answered rows of the first configuration, spread over it, for `score_phase` to answer again."""
    out.setdefault("configs", {})
    async with await Client.connect(url, queue, timeout_s=args.job_timeout_s) as client:
        try:
            st = await client.stats(timeout_s=60)
            out["engine_at_start"] = {k: v for k, v in st.get("engine", {}).items() if k not in ("cache",)}
            out["cache_at_start"] = st.get("engine", {}).get("cache")
        except Exception as e:  # noqa: BLE001
            out["engine_at_start"] = {"error": str(e)}
        steps_before = out["engine_at_start"].get("steps", {}).get("steps") or 0
        for k, n in enumerate(args.agents):
            trace = AgentTrace(n, seed=trace_seed(args.seed, k), vocab=vocab, min_state=args.min_state,
                               max_state=args.max_state)
            print(f"[load] {n} agents for {args.seconds} s ...", file=sys.stderr, flush=True)
            with GpuBusy() as busy:
                records, elapsed = await run_agents(client, trace, args.warmup_s + args.seconds, args.rows,
                                                    args.job_timeout_s)
            s = steady_summary(records, elapsed, args.warmup_s)
            s["gpu_busy_pct"] = busy.mean  # nvidia-smi's utilization.gpu over the run, warm-up too (None: no GPU)
            s["device_us_per_computed_token"] = device_us_per_token(s)
            if args.profile_s > 0:  # after the timed stretch, the agents going on (untimed): the profiler slows it
                prof = asyncio.ensure_future(client.profile(args.profile_s, rows=40))
                await run_agents(client, trace, args.profile_s + 1.0, 0, args.job_timeout_s)
                try:
                    s["worker_profile"] = await prof
                    print(f"[load] {n} agents, worker profile: phases {s['worker_profile']['phases']}\n"
                          f"{s['worker_profile']['device_table']}", file=sys.stderr, flush=True)
                except Exception as e:  # noqa: BLE001 - the numbers stand without it
                    s["worker_profile"] = {"error": f"{type(e).__name__}: {e}"}
            try:
                st = await client.stats(timeout_s=60)
                s["worker_stats"] = st
            except Exception as e:  # noqa: BLE001
                s["worker_stats"] = {"error": str(e)}
            ran = s["worker_stats"].get("engine", {}).get("steps", {}).get("steps")  # steps since start-up
            s["device_idle"] = device_idle(s, None if ran is None else ran - steps_before)
            steps_before = ran or 0
            s["moves"] = dict(sum((a.moves for a in trace.agents), Counter()))
            s["records"] = [[r.state_len, round(r.ms, 2), r.path or "failed", round(r.sent_s, 3)] for r in records]
            if check is not None and k == 0:
                ok = [r for r in records if r.probs]
                check += [(r._row, r.probs, r.path) for r in ok[:: max(1, len(ok) // CHECK_ROWS)][:CHECK_ROWS]]
            out["configs"][str(n)] = s
            save()
            f = s.get("from_start")
            print(f"[load] {n} agents: {s['rows']} rows, {s['rows_per_s']} rows/s, paths {s['paths']}, "
                  f"p50 {s['latency']['p50_ms']} ms, p99 {s['latency']['p99_ms']} ms, "
                  f"hit p50 {s['latency_by_path'].get('hit', {}).get('p50_ms')} ms, "
                  f"cold p50 {s['latency_by_path'].get('cold', {}).get('p50_ms')} ms, "
                  f"new page p50 {s['latency_new_page']['p50_ms']} ms (n {s['latency_new_page']['n']}), "
                  + (f"from the start {f['rows_per_s']} rows/s p99 {f['latency']['p99_ms']} ms, " if f else "") +
                  f"reused {s['tokens_reused']} of unbounded {s['tokens_reused_unbounded']}, failed {s['failed']}, "
                  f"GPU busy {s['gpu_busy_pct']}%, device idle between steps {s['device_idle']}, "
                  f"tokens computed a row {s['tokens_computed_per_row']}, "
                  f"device us a computed token {s['device_us_per_computed_token']}, "
                  f"worker timing {s['worker_stats'].get('worker', {}).get('timing')}, "
                  f"engine phases {s['worker_stats'].get('engine', {}).get('phases')}, "
                  f"forwards' tokens / padded since start-up {padding(s)}", file=sys.stderr, flush=True)
    return out


def device_us_per_token(s: dict) -> float | None:
    """The device's time a computed token over a config's timed rows: GPU busy / (rows/s x tokens computed a row),
    in us (what a kernel change moves, whatever the trace's mix of new pages and hits); None without a GPU."""
    busy, rate, per_row = s.get("gpu_busy_pct"), s.get("rows_per_s"), s.get("tokens_computed_per_row")
    if busy is None or not rate or not per_row:
        return None
    return round(busy / 100 * 1e6 / (rate * per_row), 1)


def device_idle(s: dict, steps: int | None = None) -> dict | None:
    """The device's idle time between the engine's steps, from a config's step log (statecache.step.STEP_LOG_FIELDS'
    gap_ms beside device_ms; its last `steps` steps, those of this config where the log holds them): the idle share of
    the logged stretch, the median gap and the gaps over 1 ms; None where the log has no gaps (an older tree)."""
    log = s.get("worker_stats", {}).get("engine", {}).get("step_log", {})
    f = log.get("fields") or []
    if "gap_ms" not in f:
        return None
    rows = log.get("steps", [])
    if steps is not None:
        rows = rows[-steps:] if steps > 0 else []
    ms, gap = f.index("device_ms"), f.index("gap_ms")
    pairs = [(r[ms], r[gap]) for r in rows if r[gap] is not None]
    if not pairs:
        return None
    idle, busy = sum(g for _, g in pairs), sum(m for m, _ in pairs)
    gaps = sorted(g for _, g in pairs)
    return {"steps": len(pairs), "idle_pct": round(100 * idle / (idle + busy), 2), "gap_p50_ms": gaps[len(gaps) // 2],
            "gaps_over_1ms": sum(g > 1.0 for g in gaps)}


def padding(s: dict) -> str | None:
    """'tokens / padded (share padding)' of the worker's batched forwards since its start-up (the runner's token
    buckets: a forward's matmuls run on its bucket), then the four buckets that ran the most (forwards, share of
    padding), from a config's worker_stats; None where it reports none."""
    b = s.get("worker_stats", {}).get("engine", {}).get("batch", {})
    if not b.get("padded_tokens"):
        return None
    out = f"{b['tokens']} / {b['padded_tokens']} ({100 * (1 - b['tokens'] / b['padded_tokens']):.1f}% padding)"
    by = sorted(((int(k), f, t) for k, (f, t) in b.get("buckets", {}).items()), key=lambda x: -x[0] * x[1])[:4]
    if by:  # the buckets that ran the most tokens: forwards, their share of padding
        out += "; by bucket " + ", ".join(f"{k}: {f} forwards {100 * (1 - t / (k * f)):.1f}%" for k, f, t in by)
    return out


# ---- statecache score, one row at a time --------------------------------------------------------------------------


def score_phase(args, rows: list[Row], check=()) -> tuple[dict, list[Record]]:
    """rows one at a time through `statecache score` (the first --score-warmup untimed); then the rows of `check`
    ((row, the worker's answer, its path)), untimed, whose answers are compared with the worker's: the worker's
    cached, batched and overlapped paths against score's one-row-at-a-time answers of the same rows (bf16 noise
    expected, ~0.05 at most)."""
    cmd = [sys.executable, "-m", "statecache.cli", "score"]
    if args.model:
        cmd += ["--model", args.model]
    if args.cache_mb is not None:
        cmd += ["--cache-mb", str(args.cache_mb)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    help_text = subprocess.run(cmd[:4] + ["--help"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    if "--precapture" in help_text and "--no-precapture" not in help_text:
        cmd.append("--precapture")  # older CLIs capture on first use unless told
    if "--timings" in help_text:
        cmd.append("--timings")  # where score's rows' time went (every row it answered, warm-up and check rows too)
    err = open(Path(args.out) / "score_stderr.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                            bufsize=1)
    ideal = unbounded_reuse(rows)
    records = []
    first_answer_s = None
    log_path = Path(err.name)
    while "statecache: model" not in log_path.read_text(errors="replace"):  # printed once the engine is built
        if proc.poll() is not None or time.time() - t0 > args.ready_timeout_s:
            proc.kill()
            raise RuntimeError(f"statecache score did not come up; its stderr ends:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    startup_s = round(time.time() - t0, 2)
    try:
        for k, (row, want) in enumerate(zip(rows, ideal)):
            text = json.dumps(row.wire()) + "\n"  # the client's own serialisation: before the clock starts
            t = time.perf_counter()
            proc.stdin.write(text)
            proc.stdin.flush()
            line = proc.stdout.readline()
            ms = 1e3 * (time.perf_counter() - t)
            if not line:
                raise RuntimeError(f"statecache score ended early; see {err.name}")
            if first_answer_s is None:
                first_answer_s = round(time.time() - t0, 2)
            res = json.loads(line)
            rec = Record(row.agent, row.state_len, len(row.ids), ms, ideal=want, new_page=row.new_page)
            if "error" in res:
                rec.error = str(res["error"])
            else:
                rec.path, rec.reused, rec.computed, rec.probs = res["path"], res["reused"], res["computed"], res["probs"]
            records.append(rec)
        again = []
        for row, theirs, path in check:
            proc.stdin.write(json.dumps(row.wire()) + "\n")
            proc.stdin.flush()
            res = json.loads(proc.stdout.readline() or "{}")
            if "probs" in res:
                again.append((path, max(abs(a - b) for pa, pb in zip(res["probs"], theirs) for a, b in zip(pa, pb))))
    finally:
        proc.stdin.close()
        proc.wait(120)
        err.close()
    timed = records[args.score_warmup:]
    s = summarise(timed, sum(r.ms for r in timed) / 1e3)
    s["mean_ms_per_row"] = round(statistics.fmean(r.ms for r in timed), 2) if timed else None
    s["warmup_rows"] = args.score_warmup
    if check:
        dps = sorted(d for _, d in again)
        s["worker_vs_score"] = {"rows": len(again), "asked": len(check), "median_dp": round(statistics.median(dps), 4) if dps else None,
                                "max_dp": round(dps[-1], 4) if dps else None,
                                "max_dp_by_worker_path": {p: round(max(d for q, d in again if q == p), 4) for p in {q for q, _ in again}}}
    s["first_answer_after_s"] = first_answer_s
    s["startup_s"] = startup_s  # process start to the engine built (weights, precapture, budget)
    s["records"] = [[r.state_len, round(r.ms, 2), r.path or "failed"] for r in timed]
    tail = Path(err.name).read_text()[-3000:]
    s["stderr_tail"] = tail
    lines = Path(err.name).read_text(errors="replace").splitlines()
    stats_line = [ln for ln in lines if ln.startswith("statecache: {")]
    if stats_line:
        s["engine_stats"] = json.loads(stats_line[-1].removeprefix("statecache: "))
    timing_line = [ln for ln in lines if ln.startswith("statecache: timings {")]
    if timing_line:
        s["timings"] = json.loads(timing_line[-1].removeprefix("statecache: timings "))
    return s, records


# ---- transformers -------------------------------------------------------------------------------------------------


def hf_phase(args, rows: list[Row], ours: list[Record]) -> dict:
    import torch

    from statecache.dev.checkpoints import checkpoint_layout
    from statecache.model.hf import hf_qwen3_5

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = hf_qwen3_5(kernels=cuda)  # fla where it runs: transformers as users run it
    cls = hf.Qwen3_5ForConditionalGeneration if checkpoint_layout(args.model) == "conditional" else hf.Qwen3_5ForCausalLM
    t0 = time.perf_counter()
    try:  # straight onto the device (needs accelerate in some versions)
        model = cls.from_pretrained(args.model, dtype=dtype, device_map=str(device)).eval()
    except Exception as e:  # noqa: BLE001
        print(f"[load] from_pretrained with device_map failed ({e}); loading on the CPU first", file=sys.stderr)
        model = cls.from_pretrained(args.model, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    tok = __import__("transformers").AutoTokenizer.from_pretrained(args.model)
    letters = tok.convert_tokens_to_ids(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    backbone = model.model.language_model if hasattr(model.model, "language_model") else model.model
    head = model.lm_head

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def run(batch: list[Row]) -> list[list[list[float]]]:
        n = max(len(r.ids) for r in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        for b, r in enumerate(batch):
            ids[b, : len(r.ids)] = torch.tensor(r.ids)
        with torch.no_grad():
            h = backbone(input_ids=ids.to(device)).last_hidden_state
            out = []
            for b, r in enumerate(batch):
                logits = head(h[b, r.slots]).float()[:, letters]
                out.append([torch.softmax(logits[i, :k], -1).tolist() for i, k in enumerate(r.nopts)])
        return out

    run(rows[:1])  # warm-up
    run(rows[:2])
    sync()
    one_ms, probs = [], []
    for r in rows:
        t = time.perf_counter()
        probs.append(run([r])[0])
        sync()
        one_ms.append(1e3 * (time.perf_counter() - t))
    batch_ms = []
    for k in range(0, len(rows) - 7, 8):
        t = time.perf_counter()
        run(rows[k:k + 8])
        sync()
        batch_ms.append(1e3 * (time.perf_counter() - t) / 8)
    diffs = []
    for p, rec in zip(probs, ours):
        if rec.probs:
            diffs.append(max(abs(a - b) for pa, pb in zip(p, rec.probs) for a, b in zip(pa, pb)))
    res = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "load_s": round(load_s, 2),
           "rows": len(rows), "mean_state_len": round(statistics.fmean(r.state_len for r in rows), 1),
           "one_at_a_time_ms_per_row": round(statistics.fmean(one_ms), 2),
           "batch8_ms_per_row": round(statistics.fmean(batch_ms), 2) if batch_ms else None,
           "ours_vs_transformers_max_abs_dp": {"median": pct(diffs, 0.5) if diffs else None,
                                               "max": round(max(diffs), 6) if diffs else None}}
    del model
    if cuda:
        torch.cuda.empty_cache()
    return res


# ---- report -------------------------------------------------------------------------------------------------------


def fmt(x, unit: str = "") -> str:
    return "-" if x is None else f"{x:,}{unit}" if isinstance(x, int) else f"{x:,.2f}{unit}" if isinstance(x, float) else str(x)


def dp(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def markdown(res: dict) -> str:
    lines = [f"# Load benchmark ({res['meta']['model_name']}, {res['meta']['device']})", ""]
    for k in ("worker_error", "score_error", "transformers_error"):
        if k in res:
            lines += [f"**{k.replace('_', ' ')}**: `{res[k][:500]}`", ""]
    st = res.get("startup", {})
    lines += [f"Worker start-up: {fmt(st.get('spawn_to_ready_s'))} s from process start to ready; weights loaded to "
              f"ready {fmt(st.get('weights_loaded_to_ready_s'))} s (weight load {fmt(st.get('engine_load_s'))} s)."]
    if st.get("engine_parts_s"):
        lines += ["Its parts: " + ", ".join(f"{k} {fmt(v)} s" for k, v in st["engine_parts_s"].items())
                  + f"; before the engine (process, imports, Redis) {fmt(st.get('before_engine_s'))} s."]
    lines += [""]
    eng = res.get("worker", {}).get("engine_at_start", {})
    if isinstance(eng.get("budget"), dict):
        b = eng["budget"]
        lines += [f"Cache budget: {b['mb']:,} MiB, {b['states_4k']:.1f} states of 4096 tokens ({b['source']}); "
                  f"precapture: {eng.get('precapture')}.", ""]
    cfgs = res.get("worker", {}).get("configs", {})
    mem = [(n, s.get("worker_stats", {}).get("engine", {}).get("device_memory_mb"),
            s.get("worker_stats", {}).get("engine", {}).get("allocator") or {}) for n, s in cfgs.items()]
    if any(m for _, m, _ in mem):
        lines += ["Device memory after each agents count (MiB; the caching allocator's retries, device frees and "
                  "syncs since start-up): " + "; ".join(
                      f"{n} agents: peak {m['peak_allocated']:,.0f}, reserved {m['reserved']:,.0f}, "
                      f"free {m['free']:,.0f}"
                      + (f", retries {a['alloc_retries']}, frees {a['device_frees']}, syncs {a['syncs']}" if a else "")
                      for n, m, a in mem if m), ""]
    lines += ["| agents | rows/s | rows | failed | memo | hit | partial | cold | plain | p50 ms | p99 ms | hit p50 ms | "
              "hit p99 ms | new page p50 ms | reused / unbounded | reused of all tokens | GPU busy % | tokens computed a "
              "row | device us a computed token |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: | ---: |"]
    for n, s in res.get("worker", {}).get("configs", {}).items():
        p, hit = s["paths"], s["latency_by_path"].get("hit", {})
        lines.append(f"| {n} | {fmt(s['rows_per_s'])} | {s['rows']} | {s['failed']} | "
                     + " | ".join(str(p.get(k, 0)) for k in PATHS)
                     + f" | {fmt(s['latency']['p50_ms'])} | {fmt(s['latency']['p99_ms'])} | {fmt(hit.get('p50_ms'))} | "
                     f"{fmt(hit.get('p99_ms'))} | {fmt(s.get('latency_new_page', {}).get('p50_ms'))} | "
                     f"{fmt(s['reused_vs_unbounded'])} | {fmt(s['reused_of_all_tokens'])} | "
                     f"{fmt(s.get('gpu_busy_pct'))} | {fmt(s.get('tokens_computed_per_row'))} | "
                     f"{fmt(s.get('device_us_per_computed_token'))} |")
    starts = [(n, s["warmup_s"], s["from_start"]) for n, s in cfgs.items() if s.get("from_start")]
    if starts:  # the same runs counted from the agents' start, synchronised first visits included
        lines += ["", "Rows sent after a warm-up of " + ", ".join(f"{w:g} s ({n} agents)" for n, w, _ in starts)
                  + "; counted from the start instead: " + "; ".join(
                      f"{n} agents {fmt(f['rows_per_s'])} rows/s, p50 {fmt(f['latency']['p50_ms'])} ms, "
                      f"p99 {fmt(f['latency']['p99_ms'])} ms" for n, _, f in starts)]
    phases = [(n, s.get("worker_stats", {}).get("engine", {}).get("phases")) for n, s in cfgs.items()]
    if any(ph for _, ph in phases):  # the engine's wall seconds per phase since start-up (Engine.stats()["phases"])
        lines += ["", "Where the engine's time went, since start-up (seconds, rows; steps: the rows they finished): "
                  + "; ".join(
                      f"{n} agents: steps {ph.get('step_s', 0):.1f} s / {ph.get('steps', 0)} steps / "
                      f"{ph.get('step_rows', 0)} rows (CPU {ph.get('step_cpu_s', 0):.1f} s)"
                      for n, ph in phases if ph)]
    idle = [(n, s.get("device_idle")) for n, s in cfgs.items()]
    if any(d for _, d in idle):  # gaps between steps on the device (statecache.step.STEP_LOG_FIELDS' gap_ms)
        lines += ["", "The device idle between steps, over each agents count's last logged steps (warm-up included): "
                  + "; ".join(f"{n} agents: {d['idle_pct']}% of {d['steps']} steps' stretch, median gap "
                              f"{d['gap_p50_ms']} ms, {d['gaps_over_1ms']} gaps over 1 ms" for n, d in idle if d)]
    timing = [(n, s.get("worker_stats", {}).get("worker", {}).get("timing")) for n, s in cfgs.items()]
    if any(t for _, t in timing):  # the worker's own split of a row's latency (worker.metrics.WorkerMetrics.timing)
        lines += ["", "Where a row's latency went in the worker, mean seconds since start-up (enqueue to reaching the "
                  "model; reaching it to the answer; the engine time of its batch): " + "; ".join(
                      f"{n} agents: queue {t['queue_s_mean']}, at the model {t['at_model_s_mean']}, engine "
                      f"{t['engine_s_mean']}" for n, t in timing if t and t.get("rows"))]
    sc, hf = res.get("score"), res.get("transformers")
    if sc:
        hit = sc["latency_by_path"].get("hit", {})
        lines += ["", "## One row at a time (`statecache score`)", "",
                  f"Start-up (process start to reading rows, after the worker run warmed the compile caches): "
                  f"{fmt(sc.get('startup_s'))} s.", "",
                  "| rows | mean ms/row | p50 ms | p99 ms | hit p50 ms | hit mean ms | cold mean ms | plain mean ms | "
                  "paths | reused / unbounded |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
                  f"| {sc['rows']} | {fmt(sc['mean_ms_per_row'])} | {fmt(sc['latency']['p50_ms'])} | "
                  f"{fmt(sc['latency']['p99_ms'])} | {fmt(hit.get('p50_ms'))} | {fmt(hit.get('mean_ms'))} | "
                  f"{fmt(sc['latency_by_path'].get('cold', {}).get('mean_ms'))} | "
                  f"{fmt(sc['latency_by_path'].get('plain', {}).get('mean_ms'))} | "
                  + ", ".join(f"{k} {v}" for k, v in sc["paths"].items() if v) + f" | {fmt(sc['reused_vs_unbounded'])} |"]
        if sc.get("timings"):
            tm = sc["timings"]
            lines += ["", "Where score's rows' time went (`statecache score --timings`: every row it answered, warm-up and "
                      "check rows too; ms p50 / mean): " + "; ".join(
                          f"{p} ({v['rows']} rows): read {fmt(v['read_ms']['p50'])} / {fmt(v['read_ms']['mean'])}, answer "
                          f"{fmt(v['answer_ms']['p50'])} / {fmt(v['answer_ms']['mean'])}, of which waiting on the GPU "
                          f"{fmt(v['gpu_wait_ms']['p50'])} / {fmt(v['gpu_wait_ms']['mean'])} and host "
                          f"{fmt(v['answer_host_ms']['p50'])} / {fmt(v['answer_host_ms']['mean'])}"
                          for p, v in tm.items() if isinstance(v, dict) and "rows" in v) + "."]
        if sc.get("worker_vs_score"):
            w = sc["worker_vs_score"]
            lines += ["", f"The worker's answers to {w['rows']} of its rows, asked again of score (untimed): max |dp| "
                      f"median {fmt(w['median_dp'])}, largest {fmt(w['max_dp'])} (by the worker's path: "
                      + ", ".join(f"{k} {fmt(v)}" for k, v in sorted(w["max_dp_by_worker_path"].items())) + ")."]
    if hf:
        lines += ["", f"## transformers, uncached ({hf['dtype']} on {hf['device']}, {hf['rows']} rows of the score trace, "
                  f"mean state {hf['mean_state_len']} tokens)", "",
                  "| one at a time ms/row | batches of 8 ms/row | ours (score) mean ms/row | speed-up vs one at a time | "
                  "speed-up vs batches of 8 | max abs dp ours vs transformers (median / max) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        ours = sc["mean_ms_per_row"] if sc else None
        up1 = round(hf["one_at_a_time_ms_per_row"] / ours, 2) if ours else None
        up8 = round(hf["batch8_ms_per_row"] / ours, 2) if ours and hf["batch8_ms_per_row"] else None
        d = hf["ours_vs_transformers_max_abs_dp"]
        lines.append(f"| {fmt(hf['one_at_a_time_ms_per_row'])} | {fmt(hf['batch8_ms_per_row'])} | {fmt(ours)} | "
                     f"{fmt(up1)} | {fmt(up8)} | {dp(d['median'])} / {dp(d['max'])} |")
    return "\n".join(lines) + "\n"


def plots(res: dict, out: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        print("[load] no matplotlib here: no plots (results.json has every point)", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    sets = [(f"{n} agents", s["records"]) for n, s in res.get("worker", {}).get("configs", {}).items()]
    if res.get("score"):
        sets.append(("score, one at a time", res["score"]["records"]))
    if sets:
        fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 4), squeeze=False, sharey=True)
        colours = {"memo": "grey", "hit": "tab:green", "partial": "tab:blue", "cold": "tab:orange", "plain": "tab:red",
                   "failed": "black"}
        for ax, (title, recs) in zip(axes[0], sets):
            for path, c in colours.items():
                pts = [(r[0], r[1]) for r in recs if r[2] == path]
                if pts:
                    ax.scatter(*zip(*pts), s=6, c=c, label=path, alpha=0.6)
            ax.set_title(title)
            ax.set_xlabel("state tokens")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("latency ms (queueing included)")
        fig.tight_layout()
        fig.savefig(out / "latency_vs_state.png", dpi=110)
        plt.close(fig)
        made.append("latency_vs_state.png")
    cfgs = res.get("worker", {}).get("configs", {})
    if cfgs:
        fig, ax = plt.subplots(figsize=(5, 4))
        xs = [int(n) for n in cfgs]
        ax.plot(xs, [cfgs[str(n)]["rows_per_s"] or 0 for n in xs], "o-", label="statecache worker")
        hf = res.get("transformers")
        if hf and hf.get("batch8_ms_per_row"):
            ax.axhline(1e3 / hf["batch8_ms_per_row"], ls="--", c="tab:red", label="transformers, batches of 8")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents")
        ax.set_ylabel("rows/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "rows_per_s.png", dpi=110)
        plt.close(fig)
        made.append("rows_per_s.png")
    return made


# ---- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json, results.md, plots and logs")
    ap.add_argument("--model", default=os.environ.get("STATECACHE_MODEL") or None,
                    help="checkpoint folder (default: $STATECACHE_MODEL, else the built-in tiny model)")
    ap.add_argument("--random-shape", default=None, metavar="SHAPE",
                    help="first write a random checkpoint of this released shape (9B, 2B, 0.8B) with "
                         "bench/random_checkpoint.py into --model (default: a folder under --out's parent's tmp)")
    ap.add_argument("--agents", default="1,4,16,64", help="comma-separated agent counts")
    ap.add_argument("--seconds", type=float, default=30.0, help="per agents count: the timed stretch")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="per agents count: the agents run this long before the timed stretch (0: time from the start)")
    ap.add_argument("--rows", type=int, default=0, help="stop an agents count after this many answers (0: no limit)")
    ap.add_argument("--score-rows", type=int, default=200, help="rows through statecache score (0: skip)")
    ap.add_argument("--score-warmup", type=int, default=40)
    ap.add_argument("--hf-rows", type=int, default=16, help="rows of the score trace for transformers (0: skip)")
    ap.add_argument("--cache-mb", type=int, default=None, help="STATECACHE_CACHE_MB for the worker and score (default: unset)")
    ap.add_argument("--min-state", type=int, default=2000)
    ap.add_argument("--max-state", type=int, default=6000)
    ap.add_argument("--job-timeout-s", type=float, default=300.0, help="an agent's wait for one answer")
    ap.add_argument("--ready-timeout-s", type=float, default=400.0)
    ap.add_argument("--device", default=None, help="transformers' device (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-worker", action="store_true")
    ap.add_argument("--profile-s", type=float, default=0.0,
                    help="after each agents count's timed stretch, profile the worker's engine thread this long while the "
                         "agents go on, untimed (the `profile` job; tables in results.json; the profiler slows it)")
    args = ap.parse_args(argv)
    args.agents = [int(x) for x in args.agents.split(",") if x.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # stopped from outside (`timeout` sends SIGTERM): unwind, so that the worker's `finally` stops the worker too (in
    # s50_run1 a load step cut at its limit left its worker holding the GPU, and the next step's worker found no room)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_s = None
    if args.random_shape and args.model and (Path(args.model) / "config.json").exists():
        print(f"[load] {args.model} has a checkpoint already; not writing a random one", file=sys.stderr)
    elif args.random_shape:
        sys.path.insert(0, str(ROOT / "bench"))
        from random_checkpoint import text_config, write_checkpoint

        args.model = args.model or tempfile.mkdtemp(prefix=f"statecache-random-{args.random_shape}-")
        t0 = time.perf_counter()
        write_checkpoint(args.model, text_config(args.random_shape), progress=sys.stderr)
        checkpoint_s = round(time.perf_counter() - t0, 1)
        print(f"[load] random {args.random_shape} checkpoint in {args.model} ({checkpoint_s} s)", file=sys.stderr, flush=True)
    if args.model is None:
        from statecache.dev.tiny import tiny_model_dir

        args.model = str(tiny_model_dir())
    vocab_size = model_vocab(args.model)
    vocab = token_range(vocab_size)
    import torch

    res: dict = {"meta": {"model": args.model, "model_name": Path(args.model).name, "argv": sys.argv[1:],
                          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
                          "torch": torch.__version__, "vocab_size": vocab_size, "token_range": vocab,
                          "random_shape": args.random_shape, "random_checkpoint_s": checkpoint_s,
                          "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}}

    def save():  # after every phase: a run cut short keeps what it finished
        (out / "results.json").write_text(json.dumps(res, indent=1))
        (out / "results.md").write_text(markdown(res))
        try:
            res["plots"] = plots(res, out)
        except Exception as e:  # noqa: BLE001 - a plot never costs the numbers
            print(f"[load] plots failed: {e}", file=sys.stderr)

    t_all = time.perf_counter()
    check: list = []  # (row, the worker's answer, path): asked again of score
    if args.agents and not args.skip_worker:
        with LocalRedis() as redis_server:
            queue = f"statecache:load-bench:{os.getpid()}"
            worker = Worker(redis_server.url, queue, args.model, args.cache_mb, out / "worker.log")
            print("[load] starting the worker ...", file=sys.stderr, flush=True)
            try:
                st = worker.start(args.ready_timeout_s)  # raises (with the log's tail) when it does not come up
                res["startup"] = st
                res["worker"] = {}
                asyncio.run(worker_phase(redis_server.url, queue, args, vocab, res["worker"], save, check))
                eng = res["worker"].get("engine_at_start", {})
                if "loaded_at" in eng:
                    st["weights_loaded_to_ready_s"] = round(st["ready_at"] - eng["loaded_at"], 2)
                if "load_s" in eng:
                    st["engine_load_s"] = eng["load_s"]
                if "startup_s" in eng:  # the engine's own parts of start-up (Engine.startup_s), in order
                    st["engine_parts_s"] = eng["startup_s"]
                    st["before_engine_s"] = round(st["spawn_to_ready_s"] - sum(eng["startup_s"].values()), 2)
            except Exception as e:  # noqa: BLE001 - the score and transformers phases still run
                res["worker_error"] = f"{type(e).__name__}: {e}"
                print(f"[load] worker phase failed: {res['worker_error']}", file=sys.stderr, flush=True)
            finally:
                worker.stop()
                save()
    if args.score_rows:
        trace = AgentTrace(4, seed=args.seed * 1000 + 999, vocab=vocab, min_state=args.min_state, max_state=args.max_state)
        rows = trace.interleaved(args.score_rows + args.score_warmup)
        recs = [Record(r.agent, r.state_len, len(r.ids), 0.0) for r in rows]  # no answers of ours if score fails
        print(f"[load] statecache score: {len(rows)} rows one at a time ...", file=sys.stderr, flush=True)
        try:
            res["score"], recs = score_phase(args, rows, check)
            s = res["score"]
            print(f"[load] score: mean {s['mean_ms_per_row']} ms/row, paths {s['paths']}, "
                  f"hit p50 {s['latency_by_path'].get('hit', {}).get('p50_ms')} ms; the worker's answers against "
                  f"score's: {s.get('worker_vs_score')}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - the next phase still runs
            res["score_error"] = f"{type(e).__name__}: {e}"
            print(f"[load] score failed: {res['score_error']}", file=sys.stderr, flush=True)
        save()
        if args.hf_rows:
            timed = list(zip(rows, recs))[args.score_warmup:]
            step = max(1, len(timed) // args.hf_rows)
            sample = timed[::step][: args.hf_rows]
            print(f"[load] transformers on {len(sample)} rows ...", file=sys.stderr, flush=True)
            try:
                res["transformers"] = hf_phase(args, [r for r, _ in sample], [rec for _, rec in sample])
                print(f"[load] transformers: {res['transformers']}", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001
                res["transformers_error"] = f"{type(e).__name__}: {e}"
                print(f"[load] transformers failed: {res['transformers_error']}", file=sys.stderr, flush=True)
    res["meta"]["total_s"] = round(time.perf_counter() - t_all, 1)
    save()
    print(markdown(res))
    errors = [k for k in ("worker_error", "score_error", "transformers_error") if k in res]
    if errors:
        print("[load] phases that failed: " + "; ".join(f"{k}: {res[k][:300]}" for k in errors), file=sys.stderr)
        return 2
    return 1 if any(s["failed"] for s in res.get("worker", {}).get("configs", {}).values()) else 0


if __name__ == "__main__":
    sys.exit(main())
