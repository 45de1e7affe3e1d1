"""bf16 agreement over many rows, restated (issue "Keep the cache under load"): for each row, the largest |dp| between
an answer in bf16 and a float32 run of the same weights; ours (the engine's step loop: cold rows plant their states,
then hits and grown states continue from those checkpoints, as CUDA graphs with the compiled pieces) beside
transformers' own bf16 forward on the same rows. Criterion: our median at most transformers' median, our largest at
most 1.5x transformers' largest. Ours uncached (`Engine.uncached`: the same step loop with no cache and no memo, the
rows together) is reported beside it, with each cached answer's distance from it.

The float32 reference is statecache's own engine in float32 (`Engine.uncached`) with its torch reference kernels
(the chunked delta rule in float32, SDPA in float32; eager, no graphs), which equals transformers' float32 forward
within 1e-4 on the CPU (tests/test_oracle.py); it avoids fla's float32 autotuning on the GPU (minutes) and TF32.

Both engines load one checkpoint folder: `--model`, else a random checkpoint of `--shape` written by
bench/random_checkpoint.py (bf16 values, 1-d weights perturbed; `--layers`: fewer layers) into `--ckpt` (default: a
temporary folder, removed at the end); `--shape tiny` is the built-in tiny model (with --device cpu: a check of the
script). Transformers loads the same folder in bf16 on `--hf-device` (default the device: on CUDA its fla kernels;
on the CPU fla is hidden while it is imported, so it runs its torch code). The three models run one after the other
(float32 references, transformers, then ours in bf16), each freed before the next: one model on the device at a time.
Rows: `--states` states of 2048..4096 tokens (multiples of 64), each asked `--questions` questions of 64 tokens
(the first cold, the rest hits), and one grown row per state (64 more state tokens: a partial row), answered one
row per `Engine.answer` call in that order. Answers at two slots (4 and 7 options, the tokenizer's letters A..).
Prints "[agree]" lines; writes agree32.json under --out.
The planting choice (`--plant graph|packed`) went with the plain path and the chunk runner: new states plant in the
step loop now.

Run on the device machine:  python3 bench/gpu_agree32.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from statecache.cache.config import CacheSettings  # noqa: E402
from statecache.dev.checkpoints import checkpoint_layout  # noqa: E402
from statecache.engine import Engine  # noqa: E402
from statecache.kernels.dispatch import TorchKernels  # noqa: E402
from statecache.model.hf import hf_qwen3_5  # noqa: E402

MAX_ROW_TOKENS = 8192  # rows here are at most 4096 + 64 + 64 tokens


def maxdiff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def model_folder(args, say) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The checkpoint both engines and transformers load (and the temporary folder to remove, if any)."""
    if args.model:
        return Path(args.model), None
    if args.shape == "tiny":
        from statecache.dev.tiny import tiny_model_dir

        return tiny_model_dir(), None
    from random_checkpoint import text_config, write_checkpoint  # bench/ is on sys.path

    tmp = None if args.ckpt else tempfile.TemporaryDirectory(prefix="agree32_")
    out = Path(args.ckpt or tmp.name)
    gen = "cuda" if args.device == "cuda" else "cpu"
    write_checkpoint(out, text_config(args.shape, args.layers), seed=0, device=gen)
    say(f"random {args.shape} checkpoint written to {out}")
    return out, tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--states", type=int, default=8)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--shape", default="9B", help="a released shape (a random checkpoint), or tiny (the built-in "
                    "tiny model; with --device cpu: a check of the script)")
    ap.add_argument("--model", default=None, help="a checkpoint folder to use instead of a random --shape")
    ap.add_argument("--layers", type=int, default=None,
                    help="the random checkpoint keeps this many layers (default: all; transformers needs one attention "
                    "layer: 4 or more)")
    ap.add_argument("--ckpt", default=None, help="write the random checkpoint here (kept; default: a temporary folder)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hf-device", default=None, help="where transformers runs (default: --device)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(*a):
        print(f"[agree] {time.perf_counter() - t0:6.1f}s", *a, flush=True)

    dev = args.device
    hf_dev = args.hf_device or dev
    # transformers binds its GDN code at its first import, for the whole process: fla's kernels on CUDA, its torch
    # code (fla hidden: sys.modules["fla"] = None meanwhile) for CPU tensors; first, before anything imports it
    hf_mod = hf_qwen3_5(kernels=hf_dev == "cuda")
    torch.set_grad_enabled(False)
    folder, tmp = model_folder(args, say)

    # the rows (the random generator only: no model needed)
    from statecache.model.config import load_config

    V = load_config(folder).vocab_size
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    rows = []  # (row, kind)
    for s in range(args.states):
        state = rnd(2048 + 64 * int(torch.randint(0, 33, (1,), generator=g)))
        for q in range(args.questions):
            ids = state + rnd(64)
            rows.append((ids, len(state), "cold" if q == 0 else "hit"))
        grown = state + rnd(64)
        rows.append((grown + rnd(64), len(grown), "grown"))
    rows = [({"ids": ids, "state_len": n, "slots": [len(ids) - 1, len(ids) - 9], "nopts": [4, 7]}, kind)
            for ids, n, kind in rows]

    # 1. float32 references: the engine's uncached forward with the torch reference kernels, eager
    with mock.patch("statecache.engine.kernels_for", lambda device, compile=False: TorchKernels()):
        eng32 = Engine(folder, dev, "float32", settings=CacheSettings(mb=64, host_mb=0), compile=False,
                       max_row_tokens=MAX_ROW_TOKENS, batch=8)
    letters = eng32.letter_ids
    say("float32 engine built", f"(kernels {eng32.kernels.name}, graphs {eng32.runner.use_graphs})")
    refs = eng32.uncached([r for r, _ in rows])
    del eng32
    free(dev)
    say("float32 references done")

    # 2. transformers' bf16 forward
    conditional = checkpoint_layout(folder) == "conditional"
    cls = hf_mod.Qwen3_5ForConditionalGeneration if conditional else hf_mod.Qwen3_5ForCausalLM
    hf = cls.from_pretrained(folder, dtype=torch.bfloat16).to(hf_dev).eval()
    theirs_all = []
    for r, _ in rows:
        lg = hf(torch.tensor([r["ids"]], device=hf_dev)).logits[0].float()
        theirs_all.append([torch.softmax(lg[s, letters[:o]], -1).tolist() for s, o in zip(r["slots"], r["nopts"])])
    del hf, lg
    free(hf_dev)
    say("transformers bf16 done")

    # 3. ours in bf16: cached answers row by row, then the same rows uncached
    eng = Engine(folder, dev, "bfloat16", settings=CacheSettings(mb=32768, min_prefix=256, host_mb=0),
                 max_row_tokens=MAX_ROW_TOKENS)
    say("bf16 engine built", f"(kernels {eng.kernels.name}, graphs {eng.runner.use_graphs})")
    res: dict = {"shape": args.shape if not args.model else args.model, "plant": "steps", "rows": []}
    for (r, kind), ref, theirs in zip(rows, refs, theirs_all):
        a = eng.answer([r])[0]
        if "probs" not in a:
            raise RuntimeError(f"a {kind} row failed: {a}")
        res["rows"].append({"kind": kind, "path": a["path"], "n": len(r["ids"]),
                            "ours_vs_f32": maxdiff(a["probs"], ref), "hf_vs_f32": maxdiff(theirs, ref),
                            "_probs": a["probs"]})
        say({k: v for k, v in res["rows"][-1].items() if k != "_probs"})
    unc = eng.uncached([r for r, _ in rows])
    for x, u, ref in zip(res["rows"], unc, refs):
        x["uncached_vs_f32"] = maxdiff(u, ref)
        x["cached_vs_uncached"] = maxdiff(x.pop("_probs"), u)
    say("uncached bf16 done", "stats", {k: eng.stats()[k] for k in ("hits", "partial", "cold", "plain")})
    del eng
    for k in ("ours_vs_f32", "hf_vs_f32", "uncached_vs_f32", "cached_vs_uncached"):
        xs = [r[k] for r in res["rows"]]
        res[k] = {"median": statistics.median(xs), "max": max(xs), "rows": len(xs)}
    o, h = res["ours_vs_f32"], res["hf_vs_f32"]
    res["median_met"] = o["median"] <= h["median"]
    res["max_met"] = o["max"] <= 1.5 * h["max"]
    say("ours", o, "uncached", res["uncached_vs_f32"], "transformers", h, "median_met", res["median_met"],
        "max_met", res["max_met"])
    (args.out / "agree32.json").write_text(json.dumps(res, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
