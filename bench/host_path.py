"""The host side of one 4k-token row, timed on this CPU: what the engine does before and around the model.

    python bench/host_path.py [--tokens 4096] [--reps 200] [--out DIR]

Parts, each the median over --reps runs on a row as msgpack delivers it (a list of Python ints): unpacking
the msgpack bytes, validation (`statecache.rows.check.check_row`), the memo key (`statecache.rows.memo.row_key`) and a memo
probe, grouping (`Engine._groups`: eligibility and the aligned state prefix), the cache lookup with the row's
state planted (`CheckpointIndex.lookup`), and the engine's whole host path for a memo hit (`Engine.answer` on a
repeated row: everything but the model). Prints a table; --out writes host_path.json. No model runs; the tiny
model's engine (CPU) supplies the objects.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import msgpack

    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine
    from statecache.rows.check import check_row
    from statecache.rows.memo import row_key

    eng = Engine(None, "cpu", "float32", settings=CacheSettings(mb=256))
    rng = random.Random(0)
    n = args.tokens
    ids = [rng.randrange(eng.vocab_size) for _ in range(n + 64)]
    row = {"ids": ids, "state_len": n, "slots": [n + 63], "nopts": [4]}
    eng.answer([row])  # plants the state; the row is in the memo now
    raw = msgpack.packb(row)
    checked = check_row(row, eng.vocab_size, eng.max_row_tokens)
    key = row_key(checked["ids"], checked["slots"], checked["nopts"])
    p = n - n % eng.cache.s.align
    parts = {
        "msgpack unpack": lambda: msgpack.unpackb(raw),
        "validate (check_row)": lambda: check_row(row, eng.vocab_size, eng.max_row_tokens),
        "memo key (row_key)": lambda: row_key(checked["ids"], checked["slots"], checked["nopts"]),
        "memo probe (get)": lambda: eng.memo.get(key),
        "group (Engine._groups)": lambda: eng._groups([(0, checked, key)]),
        "cache lookup (index.lookup)": lambda: eng.cache.index.lookup(checked["ids"], limit=p),
        "whole host path of a memo hit (Engine.answer)": lambda: eng.answer([row]),
    }
    res = {name: round(timed(fn, args.reps), 1) for name, fn in parts.items()}
    res["sum of the parts before the model (validate + key + probe + group + lookup)"] = round(
        sum(res[k] for k in list(parts)[1:6]), 1)
    width = max(map(len, res))
    print(f"host path of one row of {n} + 64 tokens, median microseconds over {args.reps} runs:")
    for k, v in res.items():
        print(f"  {k:<{width}}  {v:9.1f} us")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_path.json").write_text(json.dumps({"tokens": n, "reps": args.reps, "us": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
