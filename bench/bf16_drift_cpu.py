"""How far bf16 moves answers from float32, for statecache and for transformers, on the same random weights (CPU).

The GPU bench found statecache's bf16 answers 0.0259 from its float32 ones on one 9B row, and transformers' own
bf16 0.0124 from its float32. One row is a noisy measure, so this runs several rows of a real shape (random
weights, every 1-d parameter perturbed, as the GPU bench did) on the CPU and reports, per row, max |dp| of:
ours bf16 vs ours f32, transformers bf16 vs transformers f32, ours f32 vs transformers f32 (must be ~0), and
ours bf16 vs transformers bf16. Both use torch kernels here (transformers: its torch GDN path, fla hidden while it is
imported; the delta rule in float32 inside, as on the GPU's fla kernels).

"Ours" is the engine's uncached forward (statecache.engine.Engine.uncached: the step loop with no cache and no memo),
of two Engines on the CPU, float32 and bfloat16, loading one checkpoint folder: the perturbed model written there
(rounded to bf16, so the bf16 file holds it exactly) with the tiny model's tokenizer (the letters' token ids; the
model keeps the real vocabulary). The folder is temporary unless --ckpt names one. Each row's answer slots
(`--tokens` - 1 and - 20, 4 and 8 options) read the tokenizer's letters A.. in both models.

    .venv/bin/python bench/bf16_drift_cpu.py --shape 0.8B --rows 6 --tokens 512
Writes results/bf16_drift_cpu.json (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statecache.cache.config import CacheSettings  # noqa: E402
from statecache.dev.checkpoints import copy_tokenizer, real_shape  # noqa: E402
from statecache.dev.tiny import tiny_model_dir  # noqa: E402
from statecache.engine import Engine  # noqa: E402
from statecache.model.config import parse_config  # noqa: E402
from statecache.model.hf import hf_qwen3_5  # noqa: E402


def maxdiff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def perturbed_hf(shape_name: str, layers: int = 0):
    """transformers' float32 Qwen3_5ForCausalLM in a real shape (random, seed 0, every 1-d parameter perturbed, all
    rounded to bf16 so that both precisions start from the same numbers) -> (its module, model, our TextConfig)."""
    mod = hf_qwen3_5()  # transformers' torch code: fla hidden while it is imported (CPU tensors)
    shape = real_shape(shape_name)
    if layers:
        shape["num_hidden_layers"] = layers
        shape["layer_types"] = shape["layer_types"][:layers]
    torch.manual_seed(0)
    hf32 = mod.Qwen3_5ForCausalLM(mod.Qwen3_5TextConfig(**shape)).eval()
    with torch.no_grad():
        for p in hf32.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
        for p in hf32.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return mod, hf32, parse_config(hf32.config.to_dict())


def write_model(hf16, folder: Path) -> Path:
    """The model as a checkpoint folder the engines load: transformers' bf16 copy's weights (exact: they were rounded
    to bf16; its float32 original stays untouched, rotary buffers included), the tiny model's tokenizer beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    hf16.save_pretrained(folder)
    copy_tokenizer(tiny_model_dir(), folder)
    return folder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.8B")
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    ap.add_argument("--ckpt", default=None, help="write the checkpoint the engines load here (default: a temporary "
                    "folder, removed at the end)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bf16_drift_cpu.json"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    mod, hf32, cfg = perturbed_hf(args.shape, args.layers)
    cfg_hf = hf32.config
    sd = hf32.state_dict()
    hf16 = mod.Qwen3_5ForCausalLM(cfg_hf).eval()
    hf16.load_state_dict(sd)
    hf16 = hf16.to(torch.bfloat16)
    del sd
    tmp = None if args.ckpt else tempfile.TemporaryDirectory(prefix="bf16_drift_")
    folder = write_model(hf16, Path(args.ckpt or tmp.name))
    # the cache is not used (uncached forwards only): a small bound, no host tier
    settings = CacheSettings(mb=64, host_mb=0)
    ours32 = Engine(folder, "cpu", "float32", settings=settings, max_row_tokens=max(args.tokens, 64))
    ours16 = Engine(folder, "cpu", "bfloat16", settings=settings, max_row_tokens=max(args.tokens, 64))
    letters = ours32.letter_ids  # what a row's nopts reads: the tokenizer's A, B, ...

    def hf_probs(m, ids, slots, nopts):
        lg = m(torch.tensor([ids])).logits[0].float()
        return [torch.softmax(lg[s, letters[:o]], -1).tolist() for s, o in zip(slots, nopts)]

    rows = []
    g = torch.Generator().manual_seed(1)
    for r in range(args.rows):
        t = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g).tolist()
        slots, nopts = [args.tokens - 1, args.tokens - 20], [4, 8]
        row = {"ids": ids, "state_len": max(0, args.tokens - 32), "slots": slots, "nopts": nopts}
        o32, o16 = ours32.uncached([row])[0], ours16.uncached([row])[0]
        h32, h16 = hf_probs(hf32, ids, slots, nopts), hf_probs(hf16, ids, slots, nopts)
        rows.append({"ours_bf16_vs_f32": maxdiff(o16, o32), "hf_bf16_vs_f32": maxdiff(h16, h32),
                     "ours_f32_vs_hf_f32": maxdiff(o32, h32), "ours_bf16_vs_hf_bf16": maxdiff(o16, h16)})
        print(f"row {r} ({time.perf_counter() - t:.0f} s)", json.dumps(rows[-1]), flush=True)
    summary = {k: {"median": statistics.median(x[k] for x in rows), "max": max(x[k] for x in rows)} for k in rows[0]}
    out = {"shape": args.shape, "layers": args.layers or cfg.num_layers, "tokens": args.tokens, "rows": rows,
           "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
