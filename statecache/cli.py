"""`statecache` console script.

  statecache score [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [--cache-mb N] [--no-precapture]
      rows as JSON lines on stdin -> one JSON result per line on stdout, in order; the state cache is used
      across rows. A bad line gets {"error": {...}} and the run goes on. Statistics go to stderr at the end.

`statecache demo` is the demo's (producer.console dispatches it to producer.demo); this module, like the rest
of the library, does not import the producer.
"""

from __future__ import annotations

import argparse
import json
import sys


def _score(args) -> int:
    from .engine import Engine
    from .rows import error_result
    from .settings import Settings

    given = dict(model=args.model, device=args.device, dtype=args.dtype, cache_mb=args.cache_mb)
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.no_precapture:
        overrides["precapture"] = False
    eng = Engine.from_settings(Settings.from_env(**overrides))
    print(f"statecache: model {eng.model_dir} on {eng.device} ({str(eng.dtype).removeprefix('torch.')}), "
          f"loaded in {eng.load_s:.1f} s", file=sys.stderr)
    info = getattr(eng, "precapture_info", None)
    if info:
        print(f"statecache: precaptured {info['graphs']} graphs in {info['seconds']} s", file=sys.stderr)
    out = sys.stdout
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            res = error_result("bad_json", f"line {n}: {e}")
        else:
            res = eng.answer([row])[0]
        out.write(json.dumps(res) + "\n")
        out.flush()
    print("statecache: " + json.dumps(eng.stats()), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="statecache", description="Answer multiple-choice rows from cached model states.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("score", help="rows as JSON lines on stdin -> results as JSON lines on stdout")
    sc.add_argument("--model", default=None, help="Hugging Face Qwen3.5 checkpoint folder (default: STATECACHE_MODEL, "
                    "else the built-in tiny model); unset options come from the STATECACHE_* settings")
    sc.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    sc.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda, float32 on cpu")
    sc.add_argument("--cache-mb", type=int, default=None, help="state cache bound in MiB (0: no cache)")
    sc.add_argument("--no-precapture", action="store_true", help="do not capture the CUDA graphs before reading rows "
                    "(default: STATECACHE_PRECAPTURE, on)")
    sc.add_argument("--precapture", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    sub.add_parser("demo", help="simulated agents through Redis and the worker (the `statecache` script runs it; see README)")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        print("statecache demo: run it through the `statecache` console script or `statecache-demo`", file=sys.stderr)
        return 2
    return _score(args)


if __name__ == "__main__":
    sys.exit(main())
