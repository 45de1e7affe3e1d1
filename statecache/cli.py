"""`statecache` console script.

  statecache score [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [--cache-mb N] [--no-precapture]
                  [--specialists DIR]
      rows as JSON lines on stdin -> one JSON result per line on stdout, in order; the state cache is used
      across rows; with specialists each result names its `route`. A bad line gets {"error": {...}} and the run
      goes on. Statistics go to stderr at the end. Options not given come from the settings (statecache.settings).

`statecache demo` is the demo's (producer.console dispatches it to producer.demo); this module, like the rest
of the library, does not import the producer.
"""

from __future__ import annotations

import argparse
import json
import sys

try:  # a JSON line of a 4k-token row parses ~3x faster (on a 2-core test machine: 520 -> 170 us)
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json serves without it
    orjson = None


def loads_line(line: str):
    """One JSON line -> its value: orjson's, else (no orjson, or a line orjson refuses but json takes, such as NaN)
    json's. They agree on every value a row's fields can hold; an int past 64 bits (never a valid id, length, slot
    or option count) comes out of orjson as a float, so such a row gets `bad_type` instead of an out-of-range
    error."""
    if orjson is not None:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    return json.loads(line)


def _score(args) -> int:
    from .engine import Engine
    from .rows import error_result
    from .settings import Settings

    from .specialists import SpecialistsError

    given = dict(model=args.model, device=args.device, dtype=args.dtype, cache_mb=args.cache_mb,
                 specialists=args.specialists)
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.precapture is not None:
        overrides["precapture"] = args.precapture
    try:
        eng = Engine.from_settings(Settings.from_env(**overrides))
    except SpecialistsError as e:
        print(f"statecache: {e}", file=sys.stderr)
        return 2
    print(f"statecache: model {eng.model_dir} on {eng.device} ({str(eng.dtype).removeprefix('torch.')}), "
          f"loaded in {eng.load_s:.1f} s; {eng.budget.describe()}", file=sys.stderr)
    if eng.precapture_info is not None:
        info = eng.precapture_info
        print(f"statecache: precaptured {info['graphs']} graphs in {info['seconds']} s"
              + (f" (failed: {info['failed']})" if info["failed"] else ""), file=sys.stderr)
    out = sys.stdout
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            row = loads_line(line)
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
    sc.add_argument("--precapture", action=argparse.BooleanOptionalAction, default=None,
                    help="capture every chunk CUDA graph before reading rows (default: STATECACHE_PRECAPTURE, on; lone "
                         "plain rows' graphs are captured on first use); --no-precapture captures each on first use")
    sc.add_argument("--specialists", default=None, metavar="DIR",
                    help="a specialists folder (router.json, router.safetensors, one PEFT LoRA adapter folder per route; "
                         "default: STATECACHE_SPECIALISTS)")
    sub.add_parser("demo", help="simulated agents through Redis and the worker (the `statecache` script runs it; see README)")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        print("statecache demo: run it through the `statecache` console script or `statecache-demo`", file=sys.stderr)
        return 2
    return _score(args)


if __name__ == "__main__":
    sys.exit(main())
