"""bf16 agreement of cached rows with uncached ones over several rows, next to bf16's own drift (CPU, torch kernels).

The GPU bench measures one 9B row: the hit 0.0169 from the uncached bf16 forward, where two uncached bf16 forwards of
ours (compiled vs eager pieces) already differ by 0.0123. This runs several rows of a real shape on the CPU (random
weights, every 1-d parameter perturbed, bf16-rounded): one state, then N rows sharing it with new questions. Per row,
max |dp| over the option probabilities of: the hit (bf16) vs the uncached bf16 forward, the hit vs the uncached
float32 forward, and the uncached bf16 vs float32 (bf16's own drift, for scale).

    .venv/bin/python bench/bf16_cache_cpu.py --shape 0.8B --rows 6 --state 448
Writes results/bf16_cache_cpu_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bf16_drift_cpu import maxdiff, perturbed_hf  # bench/ is on sys.path when this runs as a script

from statecache.cache import CacheSettings, StateCache
from statecache.kernels import TorchKernels
from statecache.loader import weights_from_state_dict
from statecache.model import Qwen35
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.8B")
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--state", type=int, default=448, help="state tokens (a multiple of 64, >= 256)")
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--out", default=None, help="default: results/bf16_cache_cpu_<shape>.json")
    args = ap.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / f"bf16_cache_cpu_{args.shape}.json")
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    _, hf, cfg = perturbed_hf(args.shape)
    letters = list(range(32, 58))
    sd = hf.state_dict()
    m16 = Qwen35(weights_from_state_dict(cfg, sd, letters, "cpu", torch.bfloat16))
    plain16 = PlainPath(m16, TorchKernels())
    plain32 = PlainPath(Qwen35(weights_from_state_dict(cfg, sd, letters, "cpu", torch.float32)), TorchKernels())
    del hf, sd
    cache = StateCache(ChunkRunner(m16, TorchKernels(), max_pos=1024), CacheSettings(mb=4096))
    g = torch.Generator().manual_seed(1)
    V, n = cfg.vocab_size, args.state + args.question
    state = torch.randint(0, V, (args.state,), generator=g).tolist()
    slots, nopts = [n - 1, n - 20], [4, 8]
    first = cache.row(state + torch.randint(0, V, (args.question,), generator=g).tolist(), args.state, slots, nopts)
    print(f"built and planted ({time.perf_counter() - t0:.0f} s): {first.path}", flush=True)
    rows = []
    for r in range(args.rows):
        t = time.perf_counter()
        ids = state + torch.randint(0, V, (args.question,), generator=g).tolist()
        a = cache.row(ids, args.state, slots, nopts)
        assert a is not None and a.path == "hit", a
        p16, p32 = plain16.forward([(ids, slots, nopts)])[0], plain32.forward([(ids, slots, nopts)])[0]
        rows.append({"hit_vs_uncached_bf16": maxdiff(a.probs, p16), "hit_vs_uncached_f32": maxdiff(a.probs, p32),
                     "uncached_bf16_vs_f32": maxdiff(p16, p32)})
        print(f"row {r} ({time.perf_counter() - t:.0f} s)", json.dumps(rows[-1]), flush=True)
    summary = {k: {"median": statistics.median(x[k] for x in rows), "max": max(x[k] for x in rows),
                   "rows_within_1e-2": sum(x[k] <= 1e-2 for x in rows)} for k in rows[0]}
    out = {"shape": args.shape, "state": args.state, "question": args.question, "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
