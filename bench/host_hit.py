"""The host side of a hit (a row whose state is saved; only its question runs), timed on this CPU.

    python bench/host_hit.py [--tokens 4096] [--question 48] [--reps 300] [--stub-forward] [--out DIR] [--profile]

A 4k-token state is planted once (the tiny model's engine, CPU, eager batched forward), then rows of that state
with a new question each (so no memo hit) are answered one at a time, as `statecache score` does: a JSON line in
(`statecache.cli.loads_line`: orjson, else json), `Engine.answer([row])`, a JSON line out (`json.dumps`). Each part of the engine's path is timed by
wrapping the function that does it (time.perf_counter, medians over --reps rows); the model's forward
(`BatchRunner._forward`, the part a CUDA graph replay replaces on the GPU) is timed apart and subtracted from the
whole, which leaves the host time of a hit. The CPU forward evicts the host's caches, so the host parts run
colder than beside a GPU's forward; --stub-forward replaces `_forward` by uniform probabilities (no model at all:
the answers are then meaningless) to time them warm. --profile prints cProfile's top functions of the hits.
Prints a table; --out writes host_hit.json.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--question", type=int, default=48)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--stub-forward", action="store_true", help="no model forward (host parts with warm caches)")
    args = ap.parse_args(argv)

    import torch

    from statecache.engine import Engine

    torch.set_num_threads(1)
    from statecache.cli import loads_line

    eng = Engine(None, "cpu", "float32", cache_mb=256)
    rng = random.Random(0)
    n, q = args.tokens, args.question
    state = [rng.randrange(eng.vocab_size) for _ in range(n)]

    def line(k: int) -> str:
        r = random.Random(k)
        ids = state + [r.randrange(eng.vocab_size) for _ in range(q)]
        return json.dumps({"ids": ids, "state_len": n, "slots": [n + q - 1], "nopts": [4]})

    first = eng.answer([json.loads(line(10**9))])[0]
    assert first["path"] == "cold", first
    if args.stub_forward:
        from statecache.batch import BatchRunner

        def stub(self, g, Bb, Tb, lmax, kv, lens, snap_host=None):
            return torch.full((Bb * self.max_slots, len(eng.letter_ids)), 1 / len(eng.letter_ids))

        BatchRunner._forward = stub
    lines = [line(k) for k in range(args.reps + 20)]

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
                    cur[label] += time.perf_counter() - t0
            return timed

        setattr(owner, attr, wrap())
        undo.append((owner, attr, fn))

    def one(text: str, keep: bool) -> str:
        cur.clear()
        t0 = time.perf_counter()
        row = loads_line(text)
        t1 = time.perf_counter()
        res = eng.answer([row])[0]
        t2 = time.perf_counter()
        out = json.dumps(res) + "\n"
        t3 = time.perf_counter()
        assert res["path"] == "hit", res
        if keep:
            acc["loads_line (score's read)"].append(t1 - t0)
            acc["Engine.answer (all)"].append(t2 - t1)
            acc["json.dumps (score's write)"].append(t3 - t2)
            for label, _, _ in PARTS:
                acc[label].append(cur.get(label, 0.0))
            fwd = cur.get("    BatchRunner._forward (model)", 0.0)
            acc["Engine.answer minus forward"].append(t2 - t1 - fwd)
            acc["score row minus forward (loads + answer + dumps)"].append(t3 - t0 - fwd)
        return out

    for k in range(20):  # warm-up
        one(lines[k], False)
    t_all = time.perf_counter()
    for text in lines[20:]:
        one(text, True)
    wall = time.perf_counter() - t_all
    for owner, attr, fn in undo:
        setattr(owner, attr, fn)

    order = ["loads_line (score's read)", *[p[0] for p in PARTS], "Engine.answer (all)", "json.dumps (score's write)",
             "Engine.answer minus forward", "score row minus forward (loads + answer + dumps)"]
    res = {k: round(1e6 * statistics.median(acc[k]), 1) for k in order}
    width = max(map(len, res))
    print(f"a hit of {n} + {q} tokens, one row at a time, median microseconds over {args.reps} rows "
          f"(timers add ~1 us a wrapped call; nested rows overlap):")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v:9.1f} us")
    print(f"  (wall {1e3 * wall / args.reps:.2f} ms a row with the timers)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for k in range(args.reps):
            one(line(10_000 + k), False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_hit.json").write_text(json.dumps({"tokens": n, "question": q, "reps": args.reps, "us": res},
                                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
