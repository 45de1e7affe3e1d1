"""bf16 agreement of cached hits at the 9B shape, over several rows: the hit (state cache, short-chunk kernels,
compiled pieces, one CUDA graph) against the uncached forward in bf16 (the same compiled pieces, one graph) and
the eager packed one; with --f32 also against a float32 run of the same weights, and the uncached bf16 forward
against float32, for scale. (s3_run5, with float32 always on, spent its 175 s before the first row: most likely
fla autotuning its float32 kernels; hence the flag.)

One 4096-token state, N questions of 64 tokens, answers at the last token (4 options). Prints "[agree]" lines,
writes OUT/agree.json with every row's max |dp| and the medians.

Run on the device machine:  python3 bench/gpu_agree.py --out $OUT --rows 6 [--f32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from gpu_bench import build_hf, maxdiff  # bench/ is on sys.path when this runs as a script

from statecache.cache import CacheSettings, StateCache
from statecache.kernels import FlaKernels
from statecache.loader import weights_from_state_dict
from statecache.model import Qwen35
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--f32", action="store_true", help="also a float32 run of the same weights (slow first call)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(*a):
        print(f"[agree] {time.perf_counter() - t0:6.1f}s", *a, flush=True)

    hf, cfg = build_hf("9B")
    sd = dict(hf.state_dict())
    del hf
    letters = list(range(32, 58))
    m16 = Qwen35(weights_from_state_dict(cfg, sd, letters, "cuda", torch.bfloat16))
    m32 = Qwen35(weights_from_state_dict(cfg, sd, letters, "cuda", torch.float32)) if args.f32 else None
    del sd
    fk = FlaKernels(compile=True)
    m16.compile_elementwise()
    plain16 = PlainPath(m16, fk)  # a lone row: one CUDA graph, compiled pieces
    packed16 = PlainPath(m16, fk, graphs=False, pad=False)  # the packed eager forward a backed-up queue takes
    plain32 = PlainPath(m32, fk) if m32 is not None else None
    cache = StateCache(ChunkRunner(m16, fk, max_pos=8192, max_slots=4), CacheSettings(mb=8192))
    V = cfg.vocab_size
    state = torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = [state + torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(100 + i)).tolist()
            for i in range(args.rows + 1)]
    cache.row(rows[-1], 4096, [4159], [4])  # plants the state (its answer is not counted)
    say("model, compile and capture done")
    res = {"rows": []}
    for ids in rows[:-1]:
        a = cache.row(ids, 4096, [4159], [4])
        assert a is not None and a.path == "hit", a
        p16 = plain16.forward([(ids, [4159], [4])])[0]
        r = {"hit_vs_plain16": maxdiff(a.probs, p16),
             "hit_vs_packed16": maxdiff(a.probs, packed16.forward([(ids, [4159], [4])])[0])}
        if plain32 is not None:
            p32 = plain32.forward([(ids, [4159], [4])])[0]
            r.update(hit_vs_f32=maxdiff(a.probs, p32), plain16_vs_f32=maxdiff(p16, p32))
        res["rows"].append(r)
        say(r)
    for k in res["rows"][0]:
        xs = [r[k] for r in res["rows"]]
        res[k] = {"median": statistics.median(xs), "max": max(xs), "rows_within_1e-2": sum(x <= 1e-2 for x in xs)}
        say(k, res[k])
    (args.out / "agree.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
