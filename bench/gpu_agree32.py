"""bf16 agreement over many rows, restated (issue "Keep the cache under load"): for each row, the largest |dp| between
an answer in bf16 and a float32 run of the same weights; ours (the engine's paths: cold rows planted by the packed
forward, then hits and grown states from those checkpoints, as CUDA graphs with the compiled pieces) beside
transformers' own bf16 forward on the same rows. Criterion: our median at most transformers' median, our largest at
most 1.5x transformers' largest.

The float32 reference is statecache's own forward in float32 with its torch reference kernels (the chunked delta rule
in float32, SDPA in float32), which equals transformers' float32 forward within 1e-4 on the CPU (tests/test_oracle.py);
it avoids fla's float32 autotuning on the GPU (minutes).

New states plant through the plain path's packed forward (the delta rule split at the checkpoints); hits run through
the chunk runner (the paths before the step loop: the step loop's agreement is `statecache score`'s).
Rows: `--states` states of 2048..4096 tokens (multiples of 64), each asked `--questions` questions of 64 tokens
(the first cold, the rest hits), and one grown row per state (64 more state tokens: a partial row). Answers at two
slots (4 and 7 options). Prints "[agree]" lines; writes agree32.json under --out.

Run on the device machine:  python3 bench/gpu_agree32.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import build_hf  # noqa: E402 - bench/ is on sys.path when this runs as a script

from statecache.cache import CacheSettings, StateCache  # noqa: E402
from statecache.kernels import FlaKernels, TorchKernels  # noqa: E402
from statecache.loader import weights_from_state_dict  # noqa: E402
from statecache.model import Qwen35  # noqa: E402
from statecache.plain import PlainPath  # noqa: E402
from statecache.runner import ChunkRunner  # noqa: E402

LETTERS = list(range(32, 58))


def maxdiff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def tiny_hf():
    """The built-in tiny model's shape with random weights in bf16 (a CPU check of this script)."""
    from statecache.checkpoints import hf_qwen3_5
    from statecache.config import parse_config
    from statecache.tiny import SHAPE

    from transformers import Qwen3_5TextConfig

    torch.manual_seed(0)
    hf = hf_qwen3_5().Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, vocab_size=512, layer_types=None)).to(torch.bfloat16)
    return hf.eval(), parse_config(hf.config.to_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--states", type=int, default=8)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--shape", default="9B", help="a released shape, or tiny (with --device cpu: a check of the script)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(*a):
        print(f"[agree] {time.perf_counter() - t0:6.1f}s", *a, flush=True)

    dev = args.device
    hf, cfg = build_hf(args.shape) if args.shape != "tiny" else tiny_hf()
    sd = dict(hf.state_dict())
    m16 = Qwen35(weights_from_state_dict(cfg, sd, LETTERS, dev, torch.bfloat16))
    m32 = Qwen35(weights_from_state_dict(cfg, sd, LETTERS, dev, torch.float32))
    del sd
    fk = FlaKernels(compile=True) if dev == "cuda" else TorchKernels()
    if dev == "cuda":
        m16.compile_elementwise()
    ref32 = PlainPath(m32, TorchKernels(), graphs=False, pad=False)
    plain16 = PlainPath(m16, fk, graphs=False, pad=False)  # packed: a new state plants from its forward
    cache = StateCache(ChunkRunner(m16, fk, max_pos=8192, max_slots=4), CacheSettings(mb=32768, min_prefix=256))
    say("models built")
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    rows = []  # (ids, state_len, kind)
    for s in range(args.states):
        state = rnd(2048 + 64 * int(torch.randint(0, 33, (1,), generator=g)))
        for q in range(args.questions):
            rows.append((state + rnd(64), len(state), "cold" if q == 0 else "hit"))
        grown = state + rnd(64)
        rows.append((grown + rnd(64), len(grown), "grown"))
    res: dict = {"shape": args.shape, "plant": "packed", "rows": []}
    for ids, state_len, kind in rows:
        slots, nopts = [len(ids) - 1, len(ids) - 9], [4, 7]
        if kind == "cold":
            outs, planted = plain16.run([(ids, slots, nopts)], [cache.plan(state_len)])
            pl = planted[0]
            cache.plant_planted(ids, len(ids), pl.snaps(), pl.K, pl.V)
            ours, path = outs[0][0], "cold"
        else:
            a = cache.row(ids, state_len, slots, nopts)
            ours, path = a.probs, a.path
        ref = ref32.forward([(ids, slots, nopts)])[0]
        with torch.no_grad():
            lg = hf(torch.tensor([ids], device=dev)).logits[0].float()
        theirs = [torch.softmax(lg[s, LETTERS][:o], -1).tolist() for s, o in zip(slots, nopts)]
        r = {"kind": kind, "path": path, "n": len(ids), "ours_vs_f32": maxdiff(ours, ref), "hf_vs_f32": maxdiff(theirs, ref)}
        res["rows"].append(r)
        say(r)
    for k in ("ours_vs_f32", "hf_vs_f32"):
        xs = [r[k] for r in res["rows"]]
        res[k] = {"median": statistics.median(xs), "max": max(xs), "rows": len(xs)}
    o, h = res["ours_vs_f32"], res["hf_vs_f32"]
    res["median_met"] = o["median"] <= h["median"]
    res["max_met"] = o["max"] <= 1.5 * h["max"]
    say("ours", o, "transformers", h, "median_met", res["median_met"], "max_met", res["max_met"])
    (args.out / "agree32.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
