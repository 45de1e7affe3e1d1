"""The host side of hits (rows whose state is saved; only their question runs), timed on this CPU.

    python bench/host_hit.py [--tokens 4096] [--question 48] [--rows 1] [--reps 300] [--stub-forward [--graphs]]
                             [--out DIR] [--profile]

--rows N states of --tokens tokens each are planted once (the tiny model's engine, CPU), then each repetition asks
N rows, one of each state with a new question (so no memo hit), as a batch: N JSON lines in
(`statecache.cli.loads_line`: orjson, else json), one `Engine.answer(rows)` (the N hits run as one batched forward),
N JSON lines out (`json.dumps`), as `statecache score` does for N=1. Then the same N-row batches go straight to one
`StateCache.rows_batched` call (ids as the engine hands them: int64 arrays, validated beforehand; no memo, no
grouping). Each part of the path is timed by wrapping the function that does it (time.perf_counter, summed within
a call, medians over --reps calls); the model's forward (`BatchRunner._forward`, the part a CUDA graph replay
replaces on the GPU) is timed apart and subtracted from the whole, which leaves the host time of the hits. The CPU
forward evicts the host's caches, so the host parts run colder than beside a GPU's forward; --stub-forward
replaces `_forward` by uniform probabilities (no model at all: the answers are then meaningless) to time them warm.
--graphs (with --stub-forward) runs the batch runner as on the GPU: bucketed shapes, stand-in graphs whose replay
does nothing (the input buffer still goes through the graph's staging copy, `_send`), and the Triton kernels'
host side (`load` copies conv tails only; GDN states are read in place); without it the eager CPU path runs
(`_views`, every GDN state copied into its slot). --profile prints cProfile's top functions of the calls.
Prints a table; --out writes host_hit.json.

What it does not know: the GPU. Copies and launches that are asynchronous there (`load`'s copies, `_send`) are
synchronous memcpys here, and `read`'s wait for the GPU is absent; the tiny model has 6 GDN and 2 attention layers
(the 9B 24 and 8), so per-layer host work (`_pack`'s offsets) is smaller here. It times the host's own work, not
how much of it overlaps the GPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARTS = [  # (label, module path of the owner, attribute): wrapped and timed per row (nested parts overlap)
    ("prepare (check_row + row_key)", "statecache.engine:Engine", "_prepare"),
    ("  check_row", "statecache.engine", "check_row"),
    ("  row_key", "statecache.engine", "row_key"),
    ("memo get (miss)", "statecache.memo:Memo", "get"),
    ("group (Engine._groups)", "statecache.engine:Engine", "_groups"),
    ("index.lookup (all calls)", "statecache.index:CheckpointIndex", "lookup"),
    ("rows_batched (all of it)", "statecache.batch", "rows_batched"),
    ("  _plan", "statecache.batch", "_plan"),
    ("  _step (incl. forward)", "statecache.batch", "_step"),
    ("    BatchRunner.ensure", "statecache.batch:BatchRunner", "ensure"),
    ("    BatchRunner.load", "statecache.batch:BatchRunner", "load"),
    ("    BatchRunner._pack", "statecache.batch:BatchRunner", "_pack"),
    ("    BatchRunner._forward (model)", "statecache.batch:BatchRunner", "_forward"),
    ("    BatchRunner.read", "statecache.batch:BatchRunner", "read"),
    ("  index.evict", "statecache.index:CheckpointIndex", "evict"),
    ("_result + memo.put", "statecache.memo:Memo", "put"),
]


def _owner(path: str):
    import importlib

    mod, _, cls = path.partition(":")
    m = importlib.import_module(mod)
    return getattr(m, cls) if cls else m


STAMPS: dict[str, float] = {}  # per call: when the first replay started, when the last `read` returned


def _graph_mode(runner) -> None:
    """The batch runner's host path as on the GPU (--graphs): bucketed shapes, the Triton kernels' `load` and
    offsets, and stand-in graphs (capture runs the stubbed forward once; replay does nothing)."""
    import statecache.graphs as graphs_mod

    class NoReplay:
        def replay(self):
            STAMPS.setdefault("replay", time.perf_counter())  # the first replay of a call

    def capture(fn, pool, warmup=2):
        return NoReplay(), fn()

    graphs_mod.capture = capture
    runner.use_graphs = runner.pad = True
    runner.bk.triton = True
    runner.graphs = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--question", type=int, default=48)
    ap.add_argument("--rows", type=int, default=1, help="hits a call (each of its own state)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--stub-forward", action="store_true", help="no model forward (host parts with warm caches)")
    ap.add_argument("--graphs", action="store_true", help="with --stub-forward: the GPU's host path (stand-in graphs)")
    args = ap.parse_args(argv)
    if args.graphs and not args.stub_forward:
        ap.error("--graphs needs --stub-forward")

    import numpy as np
    import torch

    from statecache.engine import Engine

    torch.set_num_threads(1)
    from statecache.cli import loads_line

    N, n, q = args.rows, args.tokens, args.question
    eng = Engine(None, "cpu", "float32", cache_mb=max(256, 24 * N))
    rng = random.Random(0)
    states = [[rng.randrange(eng.vocab_size) for _ in range(n)] for _ in range(N)]

    def row(k: int, j: int) -> dict:
        r = random.Random(k * 1000 + j)
        ids = states[j] + [r.randrange(eng.vocab_size) for _ in range(q)]
        return {"ids": ids, "state_len": n, "slots": [n + q - 1], "nopts": [4]}

    firsts = eng.answer([row(10**9, j) for j in range(N)])
    assert all(f["path"] == "cold" for f in firsts), firsts
    if args.stub_forward:
        from statecache.batch import BatchRunner

        def stub(self, g, Bb, Tb, lmax, kv, lens, snap_host=None, asks=False):
            return torch.full((Bb * self.max_slots, len(eng.letter_ids)), 1 / len(eng.letter_ids))

        BatchRunner._forward = stub
        if args.graphs:
            _graph_mode(eng.cache.batch)
    reps, warm = args.reps, 20
    lines = [[json.dumps(row(k, j)) for j in range(N)] for k in range(reps + warm)]
    direct = [[(np.asarray(x["ids"], dtype=np.int64), x["state_len"], x["slots"], x["nopts"])
               for x in (row(10**6 + k, j) for j in range(N))] for k in range(reps + warm)]

    acc: dict[str, list[float]] = defaultdict(list)
    cur: dict[str, float] = defaultdict(float)
    undo = []
    for label, owner_path, attr in PARTS:
        owner = _owner(owner_path)
        fn = getattr(owner, attr)

        def wrap(fn=fn, label=label):
            @functools.wraps(fn)
            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    t1 = time.perf_counter()
                    cur[label] += t1 - t0
                    STAMPS[label] = t1
            return timed

        setattr(owner, attr, wrap())
        undo.append((owner, attr, fn))
    fwd_label, read_label = "    BatchRunner._forward (model)", "    BatchRunner.read"

    def one(texts: list[str], keep: bool) -> str:
        cur.clear()
        t0 = time.perf_counter()
        rows = [loads_line(text) for text in texts]
        t1 = time.perf_counter()
        res = eng.answer(rows)
        t2 = time.perf_counter()
        out = "".join(json.dumps(r) + "\n" for r in res)
        t3 = time.perf_counter()
        assert all(r["path"] == "hit" for r in res), res
        if keep:
            acc["loads_line (score's read)"].append(t1 - t0)
            acc["Engine.answer (all)"].append(t2 - t1)
            acc["json.dumps (score's write)"].append(t3 - t2)
            for label, _, _ in PARTS:
                acc[label].append(cur.get(label, 0.0))
            fwd = cur.get(fwd_label, 0.0)
            acc["Engine.answer minus forward"].append(t2 - t1 - fwd)
            acc["score rows minus forward (loads + answer + dumps)"].append(t3 - t0 - fwd)
        return out

    dacc: dict[str, list[float]] = defaultdict(list)

    def one_direct(rows: list, keep: bool) -> None:
        cur.clear()
        STAMPS.clear()
        t0 = time.perf_counter()
        res = eng.cache.rows_batched(rows)
        t1 = time.perf_counter()
        assert all(a is not None and a.path == "hit" for a in res), res
        if keep:
            for label, _, _ in PARTS:
                dacc[label].append(cur.get(label, 0.0))
            dacc["StateCache.rows_batched minus forward"].append(t1 - t0 - cur.get(fwd_label, 0.0))
            if "replay" in STAMPS:  # the host work the GPU waits for, and the host work after the GPU's answer
                dacc["serial: call to first replay (GPU idle)"].append(STAMPS["replay"] - t0)
                dacc["serial: last read to return (GPU done)"].append(t1 - STAMPS[read_label])

    for k in range(warm):
        one(lines[k], False)
        one_direct(direct[k], False)
    t_all = time.perf_counter()
    for texts in lines[warm:]:
        one(texts, True)
    wall = time.perf_counter() - t_all
    for rows in direct[warm:]:
        one_direct(rows, True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for rows in direct[warm:]:
            one_direct(rows, False)
        prof.disable()
    for owner, attr, fn in undo:
        setattr(owner, attr, fn)

    order = ["loads_line (score's read)", *[p[0] for p in PARTS], "Engine.answer (all)", "json.dumps (score's write)",
             "Engine.answer minus forward", "score rows minus forward (loads + answer + dumps)"]
    res = {k: round(1e6 * statistics.median(acc[k]), 1) for k in order}
    dorder = [p[0] for p in PARTS if dacc[p[0]] and max(dacc[p[0]]) > 0] + ["StateCache.rows_batched minus forward"]
    dorder += [k for k in dacc if k.startswith("serial")]
    dres = {k: round(1e6 * statistics.median(dacc[k]), 1) for k in dorder}
    width = max(map(len, [*res, *dres]))
    mode = "stand-in graphs" if args.graphs else "eager"
    print(f"{N} hit(s) of {n} + {q} tokens a call ({mode}{', forward stubbed' if args.stub_forward else ''}), "
          f"median microseconds a call over {reps} calls (timers add ~1 us a wrapped call; nested rows overlap):")
    print(f"through Engine.answer ({N} rows a call):")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v:9.1f} us")
    print(f"  (wall {1e3 * wall / reps:.2f} ms a call with the timers)")
    print(f"through StateCache.rows_batched ({N} rows a call):")
    for k, v in dres.items():
        print(f"  {k:<{width}}  {v:9.1f} us")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_hit.json").write_text(json.dumps({"tokens": n, "question": q, "rows": N, "reps": reps,
                                                       "mode": mode, "stub_forward": args.stub_forward,
                                                       "us": res, "rows_batched_us": dres}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
