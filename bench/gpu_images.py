"""Image rows on a real Qwen3.5 shape with its vision tower, side by side with transformers (one run does it all).

Builds transformers' Qwen3_5ForConditionalGeneration in the 9B text shape (statecache.checkpoints.real_shape) with
transformers' own Qwen3.5 vision config (Qwen3_5VisionConfig's defaults: 27 blocks of 1152, 16-pixel patches merged
2x2, out_hidden_size set to the text width), random weights (1-d parameters perturbed), cast to --dtype. statecache's
text weights and its vision tower (statecache.vision.VisionTower: transformers' module, weights loaded from that
model's state dict) come from the same model, and the image processor from a released-style preprocessor_config.json.

Row: a generated 1280x800 screenshot (PIL) inside a --state-token state (text, the image, text), then a 64-token
question, in the token form with the image bytes. Timed (medians of synchronised wall-clock runs):
- the uncached image row: transformers' forward (pixels preprocessed beforehand; its vision tower included),
  statecache's plain path and its cold cached path (vision tower included: image embeddings dropped each time);
- the cached hit with a new question (same screenshot: no vision tower, the state restored past the image),
  transformers continuing a new question from a copy of its own cache;
- a text hit of the same state length, for the criterion image hit <= 1.2x text hit (`hit_ratio`);
- host pieces: the image processor on the screenshot, a repeated image's check (sha256 + lookup), the row check.
Agreement of every answer with transformers' (max |dp|). Writes gpu_images.json under --out.

On the device machine:  python3 bench/gpu_images.py --out $OUT            (9B, bf16, cuda)
On a CPU, to check the script:  python3 bench/gpu_images.py --shape small --device cpu --dtype float32 --out /tmp/x
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statecache.cache import CacheSettings, StateCache  # noqa: E402
from statecache.checkpoints import hf_qwen3_5, preprocessor_config, real_shape  # noqa: E402
from statecache.config import parse_config  # noqa: E402
from statecache.images import ImageSupport  # noqa: E402
from statecache.kernels import kernels_for  # noqa: E402
from statecache.loader import weights_from_state_dict  # noqa: E402
from statecache.model import Qwen35  # noqa: E402
from statecache.plain import PlainPath  # noqa: E402
from statecache.rows import check_row  # noqa: E402
from statecache.runner import ChunkRunner  # noqa: E402
from statecache.vision import Embeddings, RowImages, VisionTower  # noqa: E402

R: dict = {}
OUT: Path
T0 = time.perf_counter()
DEV: torch.device


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def save():
    (OUT / "gpu_images.json").write_text(json.dumps(R, indent=1))


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=5, warm=2, mins=None):
    """Median wall milliseconds of fn over reps synchronised runs after warm ones; mins (a list): gets the fastest."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(1000 * (time.perf_counter() - t))
    if mins is not None:
        mins.append(min(ts))
    return round(statistics.median(ts), 3)


def maxdiff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def screenshot(w=1280, h=800, seed=0) -> bytes:
    """A generated UI-like screenshot: a header bar, a sidebar, buttons, form fields and lines of text, as PNG."""
    import random

    from PIL import Image, ImageDraw

    rnd = random.Random(seed)
    im = Image.new("RGB", (w, h), (245, 246, 248))
    d = ImageDraw.Draw(im)
    d.rectangle([0, 0, w, 56], fill=(32, 56, 100))
    d.text((24, 18), "Shop - Checkout", fill=(255, 255, 255))
    d.rectangle([0, 56, 220, h], fill=(228, 232, 238))
    for i in range(12):
        d.text((20, 80 + 40 * i), f"Menu item {i + 1}", fill=(40, 40, 40))
    for i in range(6):
        y = 100 + 90 * i
        d.rectangle([260, y, 760, y + 40], outline=(150, 150, 160), fill=(255, 255, 255))
        d.text((270, y + 12), f"Field {i + 1}: " + "".join(rnd.choice("abcdefghij ") for _ in range(20)), fill=(20, 20, 20))
    for i in range(4):
        x = 820 + 110 * i
        d.rectangle([x, 700, x + 96, 740], fill=(rnd.randrange(256), rnd.randrange(256), rnd.randrange(256)))
        d.text((x + 10, 712), f"Button {i}", fill=(255, 255, 255))
    for i in range(20):
        d.text((820, 90 + 28 * i), " ".join(rnd.choice(["price", "12.99", "total", "ship", "card", "ok"]) for _ in range(6)),
               fill=(60, 60, 60))
    b = io.BytesIO()
    im.save(b, "PNG")
    return b.getvalue()


def build(args):
    """transformers' model and the config pieces: (hf, text cfg, vision cfg, image token ids)."""
    hf_mod = hf_qwen3_5(kernels=DEV.type == "cuda")  # fla where it runs: transformers as users run it
    from transformers import Qwen3_5Config

    if args.shape == "small":
        from statecache.tiny import SHAPE, VISION

        text = dict(SHAPE, vocab_size=1024)
        vision = dict(VISION)
    else:
        text = real_shape(args.shape)
        vision = {}  # transformers' Qwen3_5VisionConfig defaults: the released Qwen3.5 tower
    V = text["vocab_size"]
    tokens = dict(image_token_id=V - 264, vision_start_token_id=V - 267, vision_end_token_id=V - 266)
    if args.shape != "small":
        tokens = dict(image_token_id=248056, vision_start_token_id=248053, vision_end_token_id=248054)
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(vision, out_hidden_size=text["hidden_size"]),
                        tie_word_embeddings=text.get("tie_word_embeddings", False), **tokens)
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = hf_mod.Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.to(getattr(torch, args.dtype)).eval()
    return hf, cfg, tokens


def main():
    global OUT, DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shape", default="9B", help="9B (or 0.8B, 2B) with the real vision tower; small: the tiny shapes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--state", type=int, default=None, help="state tokens (default 4096; small: 512)")
    ap.add_argument("--compile", action="store_true", help="torch.compile'd elementwise pieces (the worker's default on CUDA)")
    ap.add_argument("--cache-mb", type=int, default=8192)
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    DEV = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    P = args.state or (512 if args.shape == "small" else 4096)
    R["args"] = vars(args)
    R["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"}
    try:
        import transformers

        R["env"]["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass

    t = time.perf_counter()
    hf, cfg, tok_ids = build(args)
    R["build_s"] = round(time.perf_counter() - t, 1)
    vcfg = cfg.vision_config
    R["vision_config"] = {k: getattr(vcfg, k) for k in ("depth", "hidden_size", "patch_size", "spatial_merge_size",
                                                        "temporal_patch_size", "out_hidden_size")}
    log("built", args.shape, "in", R["build_s"], "s")

    # statecache's pieces from the same weights
    sd = hf.state_dict()
    tcfg = parse_config(hf.config.to_dict())
    letters = list(range(32, 58))
    model = Qwen35(weights_from_state_dict(tcfg, sd, letters, DEV, dtype))
    kernels = kernels_for(DEV, args.compile)
    if args.compile:
        model.compile_elementwise()
    pre = "model.visual."
    tower = VisionTower(vcfg, {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}, DEV, dtype)
    del sd
    with tempfile.TemporaryDirectory() as d:
        big = args.shape != "small"
        pc = preprocessor_config(vcfg.to_dict(), 16777216 if big else 32 * 32, 65536 if big else 8 * 8)
        (Path(d) / "preprocessor_config.json").write_text(json.dumps(pc))
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(d, use_fast=False)
    support = ImageSupport(proc, tok_ids["image_token_id"], vcfg.spatial_merge_size)
    emb = Embeddings(support, tower)
    runner = ChunkRunner(model, kernels, max_pos=max(8192, P + 1024), max_slots=4)
    cache = StateCache(runner, CacheSettings(mb=args.cache_mb))
    plain = PlainPath(model, kernels, graphs=False, pad=False)

    png = screenshot()
    R["screenshot_bytes"] = len(png)
    t = time.perf_counter()
    ref = support.prepare([png])[0]
    R["image_processor_first_ms"] = round(1000 * (time.perf_counter() - t), 2)
    R["image_tokens"], R["image_grid"] = ref.n, list(ref.grid)
    log("screenshot", len(png), "bytes ->", ref.grid, ref.n, "tokens")

    g = torch.Generator().manual_seed(1)
    V = tcfg.vocab_size
    hi = min(tok_ids.values()) - 8  # ordinary tokens only

    def rand(n, seed):
        return torch.randint(0, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    n_pre = P // 4
    n_post = P - n_pre - ref.n - 2
    if n_post < 16:
        raise SystemExit(f"--state {P} is too short for an image of {ref.n} tokens")
    state = rand(n_pre, 2) + [tok_ids["vision_start_token_id"]] + [tok_ids["image_token_id"]] * ref.n + \
        [tok_ids["vision_end_token_id"]] + rand(n_post, 3)
    assert len(state) == P
    text_state = torch.randint(0, hi, (P,), generator=g).tolist()
    qs = [rand(64, 100 + i) for i in range(16)]

    def image_row(i):
        ids = state + qs[i]
        return {"ids": ids, "state_len": P, "slots": [len(ids) - 1], "nopts": [4], "images": [png]}

    def prepared(raw):
        """What the engine does with an image row before the cache: check it, locate the image, its positions."""
        row = check_row(raw, V, 32768, None, support)
        return row, RowImages(row["ids"], row["images"], emb, DEV)

    # transformers' answer for row i (and its uncached forward)
    pv, grid = support.pixels(png)
    t = time.perf_counter()
    for _ in range(3):
        support.pixels(png)
    R["image_processor_ms"] = round(1000 * (time.perf_counter() - t) / 3, 2)
    pv = pv.to(DEV)
    thw = torch.tensor([grid], device=DEV)
    fwd_params = inspect.signature(hf.forward).parameters

    def hf_kwargs(ids):
        x = torch.tensor([ids], device=DEV)
        kw = dict(input_ids=x, pixel_values=pv, image_grid_thw=thw)
        if "mm_token_type_ids" in fwd_params:
            kw["mm_token_type_ids"] = (x == tok_ids["image_token_id"]).int()
        return kw

    def hf_probs(logits_row, k=4):
        return [torch.softmax(logits_row.float()[letters][:k], -1).tolist()]

    with torch.no_grad():
        ids0 = image_row(0)["ids"]
        want0 = hf_probs(hf(**hf_kwargs(ids0), logits_to_keep=1).logits[0, -1])
        R["hf_uncached_ms"] = timed(lambda: hf(**hf_kwargs(ids0), logits_to_keep=1), reps=3, warm=1)
    log("transformers uncached image row", R["hf_uncached_ms"], "ms")
    save()

    # ours, uncached: plain path and the cold cached path, vision tower included
    def plain_row():
        emb.clear()
        row, mm = prepared(image_row(0))
        return plain.forward([(row["ids"], row["slots"], row["nopts"], mm)])[0]

    R["plain_vs_hf"] = maxdiff(plain_row(), want0)
    R["plain_ms"] = timed(plain_row, reps=3, warm=1)
    log("ours plain image row", R["plain_ms"], "ms; agree", R["plain_vs_hf"])

    def cold():
        cache.clear()
        emb.clear()
        row, mm = prepared(image_row(0))
        return cache.row(row["ids"], P, row["slots"], row["nopts"], images=mm)

    a = cold()
    R["cold_path"], R["cold_vs_hf"] = a.path, maxdiff(a.probs, want0)
    R["cold_ms"] = timed(cold, reps=3, warm=1)
    log("ours cold cached image row", R["cold_ms"], "ms", a.path, "agree", R["cold_vs_hf"])
    R["vision_ms"] = timed(lambda: tower(pv, grid), reps=3, warm=1)
    log("vision tower alone", R["vision_ms"], "ms")
    save()

    # the hit: same screenshot, a new question
    cold()
    k = iter(range(10**6))
    paths = set()

    def hit():
        i = 1 + next(k) % (len(qs) - 1)
        row, mm = prepared(image_row(i))
        a = cache.row(row["ids"], P, row["slots"], row["nopts"], images=mm)
        paths.add(a.path)
        return a

    runs0 = emb.stats["vision_runs"]
    R["image_hit_ms"] = timed(hit, reps=20, warm=3)
    R["image_hit_paths"] = sorted(paths)
    R["image_hit_vision_runs"] = emb.stats["vision_runs"] - runs0
    R["image_hit_host_prepare_ms"] = timed(lambda: prepared(image_row(1)), reps=20, warm=2)
    with torch.no_grad():
        ids1 = image_row(1)["ids"]
        want1 = hf_probs(hf(**hf_kwargs(ids1), logits_to_keep=1).logits[0, -1])
    row, mm = prepared(image_row(1))
    h = cache.row(row["ids"], P, row["slots"], row["nopts"], images=mm)
    R["image_hit_vs_hf"] = maxdiff(h.probs, want1)
    log("ours image hit", R["image_hit_ms"], "ms", R["image_hit_paths"], "vision runs", R["image_hit_vision_runs"],
        "host prepare", R["image_hit_host_prepare_ms"], "ms; agree", R["image_hit_vs_hf"])
    save()

    # transformers continuing a new question from a copy of its own cache (its rope deltas from the state's forward)
    try:
        with torch.no_grad():
            kw = hf_kwargs(state)
            out = hf(**kw, use_cache=True, logits_to_keep=1)
            kv = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            qx = torch.tensor([qs[1]], device=DEV)

            def hf_hit():
                c = copy.deepcopy(kv)
                return hf(input_ids=qx, past_key_values=c, use_cache=True, logits_to_keep=1)

            R["hf_hit_vs_hf_uncached"] = maxdiff(hf_probs(hf_hit().logits[0, -1]), want1)
            R["hf_hit_ms"] = timed(hf_hit, reps=3, warm=1)
            kv = out = None
        log("transformers continuing from its cache", R["hf_hit_ms"], "ms; agree", R["hf_hit_vs_hf_uncached"])
    except Exception as e:  # noqa: BLE001
        R["hf_hit_error"] = f"{type(e).__name__}: {e}"[:400]
        log("transformers hit failed:", R["hf_hit_error"])
    save()

    # a text hit of the same state length
    def text_row(i):
        ids = text_state + qs[i]
        return {"ids": ids, "state_len": P, "slots": [len(ids) - 1], "nopts": [4]}

    def text_hit_prep(i):
        return check_row(text_row(i), V, 32768, None, support)

    r0 = text_hit_prep(0)
    cache.row(r0["ids"], P, r0["slots"], r0["nopts"])
    k2 = iter(range(10**6))
    tpaths = set()

    def text_hit():
        r = text_hit_prep(1 + next(k2) % (len(qs) - 1))
        a = cache.row(r["ids"], P, r["slots"], r["nopts"])
        tpaths.add(a.path)
        return a

    R["text_hit_ms"] = timed(text_hit, reps=20, warm=3)
    R["text_hit_paths"] = sorted(tpaths)
    # the two hits again, interleaved, so both see the same machine state
    ih, th, imin, tmin = [], [], [], []
    for _ in range(5):
        ih.append(timed(hit, reps=10, warm=1, mins=imin))
        th.append(timed(text_hit, reps=10, warm=1, mins=tmin))
    R["image_hit_ms_interleaved"], R["text_hit_ms_interleaved"] = statistics.median(ih), statistics.median(th)
    R["hit_ratio"] = round(R["image_hit_ms_interleaved"] / R["text_hit_ms_interleaved"], 3)
    R["hit_ratio_of_fastest"] = round(min(imin) / min(tmin), 3)  # less exposed to a busy host
    R["hit_ratio_met"] = R["hit_ratio"] <= 1.2
    log("text hit", R["text_hit_ms"], "ms", R["text_hit_paths"], "| interleaved: image", R["image_hit_ms_interleaved"],
        "text", R["text_hit_ms_interleaved"], "ratio", R["hit_ratio"], "(<= 1.2:", R["hit_ratio_met"], "); fastest of each:",
        R["hit_ratio_of_fastest"])
    R["cache_info"] = cache.info()
    R["vision_stats"] = dict(emb.stats)
    if DEV.type == "cuda":
        R["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    save()
    log("done; wrote", OUT / "gpu_images.json")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        R["error"] = traceback.format_exc()[-3000:]
        print(R["error"], flush=True)
        try:
            save()
        except Exception:  # noqa: BLE001
            pass
        sys.exit(1)
