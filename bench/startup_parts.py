"""What the engine's start-up spends before its weights and graphs, split finer than `Engine.startup_s` can:
imports, the CUDA context, the tokenizer and fla, each timed in the order the worker meets them, in a fresh process.

    python bench/startup_parts.py [--model DIR] [--out DIR]     (gpu_session.sh step `startup`)

Runs itself again as a child under `python -X importtime`, so that each step's seconds come with the imports that
took them: prints the steps, then each step's slowest imports (cumulative), and writes
`startup_parts.json` under --out. The model folder only lends its tokenizer (default: the built-in tiny model's).
Knows nothing of the worker's Redis or the graphs: `Engine.startup_s` times those parts in the worker itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str | None) -> dict:
    """The steps, timed in this process (its imports written to stderr by -X importtime)."""
    sys.path.insert(0, str(ROOT))
    out: dict[str, float] = {}
    t = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name] = round(now - t, 3)
        print(f"[step] {name}", file=sys.stderr, flush=True)  # a marker between the importtime lines
        t = now

    import torch

    step("import torch")
    import worker.jobs  # noqa: F401

    step("import worker.jobs")
    import statecache.engine as engine

    step("import statecache.engine")
    cuda = torch.cuda.is_available()
    if cuda:
        from statecache.run.compile_cache import use_persistent_caches

        use_persistent_caches()  # as the engine does before anything compiles
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    step("CUDA context" if cuda else "no CUDA")
    import transformers  # noqa: F401

    step("import transformers")
    if model is None:
        from statecache.dev.tiny import tiny_model_dir

        model = str(tiny_model_dir())
    tok = engine.load_tokenizer(model)
    step("tokenizer load")
    from statecache.rows.text import answer_tokens

    answer_tokens(tok)
    step("answer tokens")
    try:
        from fla.modules.convolution import causal_conv1d  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401

        step("import fla")
    except ImportError:
        step("no fla")
    from statecache.kernels.dispatch import kernels_for

    kernels_for(torch.device("cuda" if cuda else "cpu"), compile=cuda)
    step("kernels_for")
    return out


def slowest(importtime: str, n: int = 8) -> dict:
    """Per step (the child's "[step] NAME" lines close each), the n imports of -X importtime's lines that took the
    most cumulative time in it."""
    out: dict[str, list] = {}
    rows: list[tuple[str, int]] = []
    for line in importtime.splitlines():
        if line.startswith("[step] "):
            rows.sort(key=lambda r: -r[1])
            out[line[len("[step] "):]] = [{"module": m, "s": round(us / 1e6, 3)} for m, us in rows[:n]]
            rows = []
        elif line.startswith("import time:") and "|" in line:
            parts = line[len("import time:"):].split("|")
            if parts[1].strip().isdigit():
                rows.append((parts[2].strip(), int(parts[1])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder (its tokenizer); default: the tiny model's")
    ap.add_argument("--out", default="bench/results/startup_parts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    cmd = [sys.executable, "-X", "importtime", str(Path(__file__).resolve()), "--child"]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
    wall = round(time.perf_counter() - t0, 2)
    if p.returncode:
        sys.exit(f"startup_parts: the child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    steps = json.loads(p.stdout.strip().splitlines()[-1])
    res = {"process_s": wall, "steps_s": steps, "imports": slowest(p.stderr)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup_parts.json").write_text(json.dumps(res, indent=1))
    print(f"process start to end: {wall} s")
    for name, s in steps.items():
        print(f"  {name:<26} {s:7.3f} s")
    for name, imports in res["imports"].items():
        if imports:
            print(f"{name}: " + ", ".join(f"{r['module']} {r['s']} s" for r in imports))


if __name__ == "__main__":
    main()
