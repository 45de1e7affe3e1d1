"""`statecache` console script.

  statecache score [--model DIR] [--device cpu|cuda] [--dtype float32|bfloat16] [--cache-mb N] [--no-precapture]
                  [--specialists DIR] [--timings]
      rows as JSON lines on stdin -> one JSON result per line on stdout, in order; the state cache is used
      across rows; with specialists each result names its `route`. A bad line gets {"error": {...}} and the run
      goes on. Statistics go to stderr at the end (with --timings, first a line of where the rows' time went).
      Options not given come from the settings (statecache.settings).

`statecache demo` is the demo's (producer.console dispatches it to producer.demo); this module, like the rest
of the library, does not import the producer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

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
    from statecache.engine import Engine
    from statecache.protocol import error_result
    from statecache.settings import Settings

    from statecache.model.specialists import SpecialistsError

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
        info = eng.precapture_info["batch"]  # the step loop's graphs (Engine.precapture_info)
        print(f"statecache: precaptured {info['graphs']} graphs in {info['seconds']} s"
              + (f" (failed: {info['failed']})" if info["failed"] else ""), file=sys.stderr)
    out = sys.stdout
    timings = Timings() if args.timings else None
    for n, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        t0, w0 = time.perf_counter(), (eng.gpu_wait_s() if timings is not None else 0.0)
        try:
            row = loads_line(line)
        except json.JSONDecodeError as e:
            res = error_result("bad_json", f"line {n}: {e}")
        else:
            t1 = time.perf_counter()
            res = eng.answer([row])[0]
            if timings is not None:
                timings.add(res.get("path", "error"), t1 - t0, time.perf_counter() - t1, eng.gpu_wait_s() - w0)
        text = json.dumps(res) + "\n"
        if timings is not None:
            timings.total_s.append(time.perf_counter() - t0)
        out.write(text)
        out.flush()
    if timings is not None:
        print("statecache: timings " + json.dumps(timings.summary()), file=sys.stderr)
    print("statecache: " + json.dumps(eng.stats()), file=sys.stderr)
    return 0


class Timings:
    """`score --timings`: where each row's time went on this side of the pipe, by path: reading its line, the
    engine's answer, and within that the time blocked on the GPU (`Engine.gpu_wait_s`); the rest of the answer is
    host work (checks, lookups, packing, launches)."""

    def __init__(self):
        self.rows: dict[str, list[tuple[float, float, float]]] = {}
        self.total_s: list[float] = []  # a line's start to its answer's text, every row

    def add(self, path: str, read_s: float, answer_s: float, gpu_wait_s: float) -> None:
        self.rows.setdefault(path, []).append((read_s, answer_s, gpu_wait_s))

    def summary(self) -> dict:
        def ms(xs):
            xs = sorted(xs)
            return {"p50": round(1e3 * xs[len(xs) // 2], 3), "mean": round(1e3 * sum(xs) / len(xs), 3)} if xs else None

        out = {}
        for path, rs in sorted(self.rows.items()):
            out[path] = {"rows": len(rs), "read_ms": ms([r[0] for r in rs]), "answer_ms": ms([r[1] for r in rs]),
                         "gpu_wait_ms": ms([r[2] for r in rs]), "answer_host_ms": ms([r[1] - r[2] for r in rs])}
        out["line_in_to_answer_out_ms"] = ms(self.total_s)
        return out


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
    sc.add_argument("--timings", action="store_true",
                    help="at the end, print where the rows' time went by path (reading, answering, waiting on the GPU) to "
                         "stderr as a `statecache: timings {...}` line")
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
