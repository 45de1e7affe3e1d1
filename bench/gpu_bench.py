"""GPU benchmark and agreement check on real Qwen3.5 shapes with random weights (one device run does it all).

For each shape (0.8B, 2B, 9B by default) in bf16, side by side with transformers' Qwen3_5ForCausalLM built in the
same process from the same weights:
- agreement: our plain forward (bf16) vs a float32 run of the same (bf16-rounded) weights, our cached forward vs
  our plain one, and transformers' answer, as max |dp| over the option probabilities;
- one uncached row of 4096 state + 64 question tokens: our plain path, our cold cached path (chunk graphs, planting
  checkpoints), transformers' forward;
- a hit (the same 4096-token state, a new 64-token question), the grown-state (tail) and middle-change (stride)
  partial rows, and transformers continuing from a copy of its own cache.
Also checks fla / varlen kernels against the torch reference first. Writes results JSON under --out.

Run on the device machine (see bench/README.md):  python3 bench/gpu_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statecache.cache import CacheSettings, StateCache  # noqa: E402
from statecache.config import parse_config  # noqa: E402
from statecache.graphs import capture  # noqa: E402
from statecache.kernels import FlaKernels, TorchKernels  # noqa: E402
from statecache.loader import GdnWeights, weights_from_state_dict  # noqa: E402
from statecache.model import Qwen35  # noqa: E402
from statecache.plain import PlainPath  # noqa: E402
from statecache.runner import ChunkRunner  # noqa: E402

from gpu_timing import replay_median_ms  # noqa: E402 - bench/ is on sys.path when this runs as a script

R: dict = {}
OUT: Path


def save():
    (OUT / "gpu_bench.json").write_text(json.dumps(R, indent=1))


T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def timed(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1000 * (time.perf_counter() - t))
    return round(statistics.median(ts), 2)


def host_ms(fn, reps=50):
    """Median wall milliseconds of fn (host work only: no synchronisation)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(1000 * (time.perf_counter() - t))
    return round(statistics.median(ts), 4)


def hit_breakdown(cache, runner, ids, p: int, reps=10) -> dict:
    """Where a hit's wall time goes: the lookup (host), the restore, the chunk's launch (host time until runner.run
    returns), the GPU until done, and the read-back; medians over reps."""
    out = {"lookup": host_ms(lambda: cache.index.lookup(ids, p))}  # from the list, as rows arrive
    best = cache.index.lookup(ids, p)
    parts: dict[str, list] = {"restore": [], "launch": [], "gpu_after_launch": [], "read_back": []}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache._restore(best)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        o = runner.run(ids, p, len(ids), [len(ids) - 1], [4])
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        runner.read(o, 1)
        t4 = time.perf_counter()
        for k, a, b in (("restore", t0, t1), ("launch", t1, t2), ("gpu_after_launch", t2, t3), ("read_back", t3, t4)):
            parts[k].append(1000 * (b - a))
    out.update({k: round(statistics.median(v), 4) for k, v in parts.items()})
    return out


def gemm_in_situ(model) -> dict:
    """Microseconds per 64-row GEMM over the model's own weights (each layer's once, as one graph), with kernel names:
    to tell a slow projection's cause (its weights, or its place in the hit's graph)."""
    from gpu_gemm_skinny import kernel_names
    from gpu_timing import graph_us

    x = torch.randn(64, model.cfg.hidden_size, device="cuda", dtype=model.dtype)
    mixers = [L.mixer for L in model.w.layers]
    groups = {"gdn_in": [m.in_w for m in mixers if isinstance(m, GdnWeights)], "gate_up": [L.gate_up_w for L in model.w.layers],
              "down": None}
    out = {}
    for name, ws in groups.items():
        if ws is None:  # down takes the intermediate width
            xi = torch.randn(64, model.cfg.intermediate_size, device="cuda", dtype=model.dtype)
            fns = [lambda W=L.down_w: xi @ W.T for L in model.w.layers]
            first = lambda: xi @ model.w.layers[0].down_w.T  # noqa: E731
        else:
            fns = [lambda W=W: x @ W.T for W in ws]
            first = lambda W=ws[0]: x @ W.T  # noqa: E731
        out[name] = {"us": graph_us(fns), "kernels": kernel_names(first)}
    return out


def gtime(fn, reps=20):
    """GPU milliseconds of fn as a CUDA graph replay (no launch overhead), median of reps; the error as a string if
    it cannot be captured."""
    try:
        graph, _ = capture(fn, None)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:120]}"
    return round(replay_median_ms(graph, reps), 4)


def micro(cfg, res):
    """Kernel variants at this shape, each timed as a graph replay: span attention (FlashAttention with native GQA,
    with repeated heads, batched matmuls with eager / compiled softmax) and the delta rule (chunked vs fused
    recurrent) for short chunks; agreement of each with the first."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent

    from statecache.fuse import Fused
    from statecache.kernels import attend_grouped, span_softmax

    fk = FlaKernels()
    out = {"flash_gqa": fk.flash_gqa, "bmm_f32": fk.bmm_f32}
    dev, bf = "cuda", torch.bfloat16
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    P, start = 5120, torch.tensor(4096, device=dev)
    K, V = (torch.randn(P, Hkv, D, device=dev, dtype=bf) for _ in range(2))
    comp = Fused(span_softmax)
    scale = D**-0.5
    for L in (16, 64, 128, 256, 512):
        q = torch.randn(L, Hq, D, device=dev, dtype=bf)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        cu_q, cu_k = torch.cat([zero, zero + L]), torch.cat([zero, (start + L).to(torch.int32).reshape(1)])
        variants = {
            "flash_native": lambda: fk._flash_op(q, K, V, cu_q, cu_k, L, P, scale),
            "flash_repeat": lambda: fk._varlen(q, K.repeat_interleave(Hq // Hkv, 1), V.repeat_interleave(Hq // Hkv, 1),
                                               cu_q, cu_k, L, P, scale=scale, window_size=(-1, 0)),
            "grouped_eager": lambda: attend_grouped(q, K, V, start, scale, span_softmax, fk.bmm_f32),
            "grouped_compiled": lambda: attend_grouped(q, K, V, start, scale, comp, fk.bmm_f32),
        }
        ref = None
        for name, fn in variants.items():
            try:
                o = fn().float()
                ref = o if ref is None else ref
                out[f"attn_L{L}_{name}"] = [gtime(fn), float((o - ref).abs().max())]
            except Exception as e:  # noqa: BLE001
                out[f"attn_L{L}_{name}"] = f"{type(e).__name__}: {str(e)[:150]}"
    T = 4160
    q = torch.randn(T, Hq, D, device=dev, dtype=bf)
    k, v = (torch.randn(T, Hkv, D, device=dev, dtype=bf) for _ in range(2))
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    for name, fn in {"flash_native": lambda: fk._flash_op(q, k, v, cu, cu, T, T, scale),
                     "flash_repeat": lambda: fk._varlen(q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1),
                                                        cu, cu, T, T, scale=scale, window_size=(-1, 0))}.items():
        try:
            out[f"attn_packed_{T}_{name}"] = gtime(fn)
        except Exception as e:  # noqa: BLE001
            out[f"attn_packed_{T}_{name}"] = f"{type(e).__name__}: {str(e)[:150]}"
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    init = torch.randn(1, Hv, Dk, Dv, device=dev) * 0.1
    for T in (16, 64, 128):
        qd, kd = (torch.randn(1, T, Hk, Dk, device=dev, dtype=bf) for _ in range(2))
        vd = torch.randn(1, T, Hv, Dv, device=dev, dtype=bf)
        g = -torch.rand(1, T, Hv, device=dev) * 0.5
        beta = torch.rand(1, T, Hv, device=dev, dtype=bf)
        o1, s1 = fk._gdr(qd, kd, vd, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        try:
            o2, s2 = recurrent(qd, kd, vd, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
            agree = [float((o1.float() - o2.float()).abs().max()), float((s1 - s2).abs().max())]
        except Exception as e:  # noqa: BLE001
            agree = f"{type(e).__name__}: {str(e)[:150]}"
        out[f"delta_T{T}"] = {
            "chunk": gtime(lambda: fk._gdr(qd, kd, vd, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)),
            "recurrent": gtime(lambda: recurrent(qd, kd, vd, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)),
            "recurrent_vs_chunk": agree}
    res["micro"] = out
    log("micro", json.dumps(out))


def gemm_micro(cfg, res):
    """The shape's weight matmuls at 64 and 4160 rows: cuBLAS's default choice vs TunableOp's tuned one."""
    dev, bf = "cuda", torch.bfloat16
    H = cfg.hidden_size
    shapes = {"gate_up": (2 * cfg.intermediate_size, H), "down": (H, cfg.intermediate_size),
              "gdn_in": (2 * cfg.key_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, H), "gdn_out": (H, cfg.value_dim)}
    out = {}
    for M in (64, 4160):
        for nm, (N, K) in shapes.items():
            x = torch.randn(M, K, device=dev, dtype=bf)
            w = torch.randn(N, K, device=dev, dtype=bf)
            out[f"{nm}_M{M}_default"] = gtime(lambda: x @ w.T)
    try:
        import torch.cuda.tunable as tun
        tun.enable(True)
        tun.tuning_enable(True)
        tun.set_max_tuning_duration(50)
        for M in (64, 4160):
            for nm, (N, K) in shapes.items():
                x = torch.randn(M, K, device=dev, dtype=bf)
                w = torch.randn(N, K, device=dev, dtype=bf)
                for _ in range(3):
                    x @ w.T
                out[f"{nm}_M{M}_tuned"] = gtime(lambda: x @ w.T)
        tun.enable(False)
    except Exception as e:  # noqa: BLE001
        out["tunable_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    res["gemm"] = out
    log("gemm", json.dumps(out))


def maxdiff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def env():
    from torch.nn.attention import varlen

    sig = inspect.signature(varlen.varlen_attn).parameters
    import fla

    R["env"] = {"torch": torch.__version__, "fla": getattr(fla, "__version__", "?"), "gpu": torch.cuda.get_device_name(),
                "varlen_params": [p for p in ("enable_gqa", "seqused_k", "block_table") if p in sig]}
    log("env", R["env"])


def kernel_checks():
    torch.manual_seed(0)
    ref, fk = TorchKernels(), FlaKernels()
    dev = "cuda"
    out = {}
    T, Hk, Hv, Dk, Dv = 200, 2, 4, 64, 64
    q, k = torch.randn(1, T, Hk, Dk, device=dev), torch.randn(1, T, Hk, Dk, device=dev)
    v = torch.randn(1, T, Hv, Dv, device=dev)
    g = -torch.rand(1, T, Hv, device=dev) * 0.5
    beta = torch.rand(1, T, Hv, device=dev)
    init = torch.randn(2, Hv, Dk, Dv, device=dev) * 0.1
    cu = torch.tensor([0, 77, 200], dtype=torch.int32, device=dev)
    o1, s1 = ref.delta(q, k, v, g, beta, init, cu)
    o2, s2 = fk.delta(q, k, v, g, beta, init, cu)
    out["delta_varlen_init"] = [float((o1 - o2).abs().max()), float((s1 - s2).abs().max())]
    o1, s1 = ref.delta(q, k, v, g, beta, init[:1])
    o2, s2 = fk.delta(q, k, v, g, beta, init[:1])
    out["delta_one_init"] = [float((o1 - o2).abs().max()), float((s1 - s2).abs().max())]
    x, w = torch.randn(1, T, 96, device=dev), torch.randn(96, 4, device=dev)
    out["conv_varlen"] = float((ref.conv(x, w, cu) - fk.conv(x, w, cu)).abs().max())
    out["conv"] = float((ref.conv(x, w) - fk.conv(x, w)).abs().max())
    bf = torch.bfloat16
    qa, ka, va = (torch.randn(T, n, 64, device=dev, dtype=bf) for n in (8, 2, 2))
    out["attend_packed"] = float((ref.attend_packed(qa, ka, va, cu, 123, 0.125).float() - fk.attend_packed(qa, ka, va, cu, 123, 0.125).float()).abs().max())
    Kc, Vc = torch.randn(512, 2, 64, device=dev, dtype=bf), torch.randn(512, 2, 64, device=dev, dtype=bf)
    start = torch.tensor(130, device=dev)
    out["attend_span"] = float((ref.attend_span(qa[:64], Kc, Vc, start, 0.125).float() - fk.attend_span(qa[:64], Kc, Vc, start, 0.125).float()).abs().max())
    R["kernel_checks"] = out
    log("kernels", out)


def build_hf(shape_name):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from statecache.checkpoints import real_shape

    cfgd = real_shape(shape_name)
    hcfg = Qwen3_5TextConfig(**cfgd)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3_5ForCausalLM(hcfg)
    with torch.no_grad():  # every parameter off its init so convention slips show
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.to(torch.bfloat16).eval()
    cfg = parse_config(hf.config.to_dict())
    return hf, cfg


def bench_shape(name, args):
    """One shape: plain path (eager, then compiled with --compile) next to transformers, agreement, then the state
    cache in the final mode (compiled with --compile): cold, hit, grown, middle change; profiles where asked."""
    res = R.setdefault("shapes", {}).setdefault(name, {})
    prof_here = name in args.profile.split(",")
    t0 = time.perf_counter()
    hf, cfg = build_hf(name)
    res["build_s"] = round(time.perf_counter() - t0, 1)
    if name in args.micro.split(","):
        try:
            gemm_micro(cfg, res)
            micro(cfg, res)
        except Exception:  # noqa: BLE001
            res["micro_error"] = traceback.format_exc()[-1500:]
            log(res["micro_error"])
        save()
    letters = list(range(32, 58))
    sd = {k: v for k, v in hf.state_dict().items()}
    w16 = weights_from_state_dict(cfg, sd, letters, "cuda", torch.bfloat16)
    m16 = Qwen35(w16)
    fk = FlaKernels()
    res["kernels"] = {"flash_gqa": fk.flash_gqa, "bmm_f32": fk.bmm_f32, "grouped_max_q": fk.grouped_max_q}
    plain16 = PlainPath(m16, fk, graphs=False, pad=False)  # packed and eager: the path a backed-up queue takes
    g = torch.Generator().manual_seed(1)
    V = cfg.vocab_size
    state = torch.randint(0, V, (4096,), generator=g).tolist()
    q = lambda i: torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(100 + i)).tolist()  # noqa: E731
    ids = state + q(0)
    slots, nopts = [len(ids) - 1, len(ids) - 20], [4, 8]
    row = (ids, slots, nopts)
    p16 = plain16.forward([row])[0]
    res["plain_ms"] = timed(lambda: plain16.forward([row]))
    log(name, "plain bf16 (eager)", res["plain_ms"], "ms")
    pg = PlainPath(m16, fk)  # a lone row as one CUDA graph (the default for single rows on CUDA)
    t = time.perf_counter()
    res["plain_graph_vs_eager"] = maxdiff(pg.forward([row])[0], p16)
    res["plain_graph_capture_s"] = round(time.perf_counter() - t, 1)
    res["plain_graph_ms"] = timed(lambda: pg.forward([row]))
    log(name, "plain bf16, one graph (eager pieces)", res["plain_graph_ms"], "ms; capture", res["plain_graph_capture_s"], "s")
    # transformers on the same weights
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        lg = hf(x).logits[0].float()
        hp = [torch.softmax(lg[s, letters][:o], -1).tolist() for s, o in zip(slots, nopts)]
        res["hf_vs_ours_bf16"] = maxdiff(hp, p16)
        res["hf_uncached_ms"] = timed(lambda: hf(x, logits_to_keep=1))
    log(name, "hf uncached", res["hf_uncached_ms"], "ms", "agree", res["hf_vs_ours_bf16"])
    # transformers continuing from a copy of its own cache
    with torch.no_grad():
        out = hf(torch.tensor([state], device="cuda"), use_cache=True)
        kv = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        qx = torch.tensor([q(0)], device="cuda")

        def hf_hit():
            c = copy.deepcopy(kv)
            return hf(qx, past_key_values=c, use_cache=True, logits_to_keep=1)
        try:
            res["hf_hit_ms"] = timed(hf_hit, reps=3, warm=1)
        except Exception as e:  # noqa: BLE001
            res["hf_hit_error"] = f"{type(e).__name__}: {e}"[:300]
        kv = out = None  # free transformers' cache before ours is made
    log(name, "hf continue from cache copy", res.get("hf_hit_ms"), res.get("hf_hit_error", ""))
    # float32 run of the same weights
    p32 = None
    if not args.skip_f32:
        w32 = weights_from_state_dict(cfg, sd, letters, "cuda", torch.float32)
        p32 = PlainPath(Qwen35(w32), fk).forward([row])[0]
        res["bf16_vs_f32"] = maxdiff(p16, p32)
        log(name, "bf16 vs f32", res["bf16_vs_f32"])
        del w32
        gc.collect()
        torch.cuda.empty_cache()
    del sd
    save()
    if args.compile:  # the elementwise pieces fused by torch.compile (the product's default on CUDA)
        t = time.perf_counter()
        m16.compile_elementwise()
        fk.compile_elementwise()
        pc = plain16.forward([row])[0]
        res["compiled_first_call_s"] = round(time.perf_counter() - t, 1)
        res["compiled_plain_vs_eager"] = maxdiff(pc, p16)
        res["compiled_plain_ms"] = timed(lambda: plain16.forward([row]))
        log(name, "compiled plain", res["compiled_plain_ms"], "ms")
        pg = PlainPath(m16, fk)
        t = time.perf_counter()
        res["compiled_plain_graph_vs_eager"] = maxdiff(pg.forward([row])[0], p16)
        res["compiled_plain_graph_capture_s"] = round(time.perf_counter() - t, 1)
        res["compiled_plain_graph_ms"] = timed(lambda: pg.forward([row]))
        log(name, "compiled plain, one graph", res["compiled_plain_graph_ms"], "ms; capture", res["compiled_plain_graph_capture_s"], "s")
        if prof_here:
            profile(f"compiled_plain_{name}", lambda: plain16.forward([row]))
            profile(f"compiled_plain_graph_{name}", lambda: pg.forward([row]))
    mode = "compiled_" if args.compile else ""
    # the state cache
    runner = ChunkRunner(m16, fk, max_pos=8192, max_slots=4)
    cache = StateCache(runner, CacheSettings(mb=args.cache_mb))
    t = time.perf_counter()
    a = cache.row(ids, 4096, slots, nopts)
    torch.cuda.synchronize()
    res[mode + "first_cold_with_capture_ms"] = round(1000 * (time.perf_counter() - t), 1)
    res["captures"] = dict(runner.stats)
    res["cold_path"] = a.path if a else None
    res["cached_vs_plain_bf16"] = maxdiff(a.probs, p16) if a else None
    if p32 is not None and a:
        res["cached_vs_f32"] = maxdiff(a.probs, p32)

    def cold():
        cache.clear()
        return cache.row(ids, 4096, slots, nopts)
    res[mode + "cold_ms"] = timed(cold, reps=3, warm=1)
    log(name, "cold cached", res[mode + "cold_ms"], "ms", runner.stats)
    hits = [state + q(i) for i in range(1, 12)]
    if fk.short_kernels:  # the same hit on session 2's kernels (fla's delta-rule chain, batched-matmul attention,
        fk.short_kernels = False  # torch.compile'd norm and activation), for comparison
        if args.compile:
            m16.use_triton_pieces(False)
        runner.reset_graphs()
        cache.clear()
        cache.row(ids, 4096, slots, nopts)
        res[mode + "hit_ms_fla_kernels"] = timed(lambda: cache.row(hits[1], 4096, [4159], [4]), reps=20, warm=3)
        res[mode + "hit_graph_ms_fla_kernels"] = replay_ms(runner)
        res["hit_vs_plain_bf16_fla_kernels"] = maxdiff(cache.row(ids, 4096, slots, nopts).probs, p16)
        log(name, "hit on fla's kernels", res[mode + "hit_ms_fla_kernels"], "ms; graph alone",
            res[mode + "hit_graph_ms_fla_kernels"], "agree", res["hit_vs_plain_bf16_fla_kernels"])
        fk.short_kernels = True
        if args.compile:
            m16.use_triton_pieces(True)
        runner.reset_graphs()
    cache.clear()
    cache.row(ids, 4096, slots, nopts)
    hp_ = {}
    k = iter(range(1000))

    def hit():
        i = next(k) % len(hits)
        a = cache.row(hits[i], 4096, [4159], [4])
        hp_["path"] = a.path
        return a
    res[mode + "hit_ms"] = timed(hit, reps=20, warm=3)
    res[mode + "hit_graph_ms"] = replay_ms(runner)
    res[mode + "hit_breakdown_ms"] = hit_breakdown(cache, runner, hits[0], 4096)
    log(name, "hit breakdown (ms)", res[mode + "hit_breakdown_ms"])
    res["gemm_in_situ_us"] = gemm_in_situ(m16)
    log(name, "64-row GEMMs on the model's own weights, one graph over all layers (us per call)", res["gemm_in_situ_us"])
    res["hit_path"] = hp_["path"]
    if prof_here:
        profile(f"{mode}hit_{name}", hit)
        profile(f"{mode}cold_{name}", cold)
    h = cache.row(ids, 4096, slots, nopts)
    res["hit_vs_plain_bf16"] = maxdiff(h.probs, p16)
    log(name, "hit", res[mode + "hit_ms"], "ms; graph alone", res[mode + "hit_graph_ms"], res["hit_path"], "agree", res["hit_vs_plain_bf16"])
    # grown state (last tokens changed: restores p - tail) and middle change (restores the stride checkpoint)
    cnt = iter(range(1000))

    def grown():
        j = next(cnt)
        s2 = state[:4090] + torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(500 + j)).tolist()
        a = cache.row(s2 + q(0), len(s2), [len(s2) + 63], [4])
        res["grown_path"], res["grown_reused"] = a.path, a.reused
    res[mode + "grown_ms"] = timed(grown, reps=5, warm=1)

    def middle():
        j = next(cnt)
        s2 = list(state)
        s2[3000] = (s2[3000] + 1 + j) % V
        a = cache.row(s2 + q(0), 4096, [4159], [4])
        res["middle_path"], res["middle_reused"] = a.path, a.reused
    res[mode + "middle_ms"] = timed(middle, reps=5, warm=1)
    log(name, "grown", res[mode + "grown_ms"], res["grown_path"], res["grown_reused"], "middle", res[mode + "middle_ms"],
        res["middle_path"], res["middle_reused"])
    # agreement of a partial row with the plain path
    s2 = state[:4090] + q(7)[:30]
    r2 = (s2 + q(0), [len(s2) + 63], [4])
    a = cache.row(r2[0], len(s2), r2[1], r2[2])
    res["partial_vs_plain_bf16"] = maxdiff(a.probs, plain16.forward([r2])[0])
    res["cache_info"] = cache.info()
    res["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    save()
    if p32 is not None and args.hf_f32:  # transformers' own bf16 vs float32 on the same weights
        del cache, runner, m16, w16, plain16, pg
        gc.collect()
        torch.cuda.empty_cache()
        with torch.no_grad():
            hf.float()
            lg = hf(x).logits[0].float()
            hp32 = [torch.softmax(lg[s, letters][:o], -1).tolist() for s, o in zip(slots, nopts)]
        res["hf_bf16_vs_hf_f32"] = maxdiff(hp, hp32)
        res["ours_f32_vs_hf_f32"] = maxdiff(p32, hp32)
        log(name, "transformers bf16 vs its float32", res["hf_bf16_vs_hf_f32"], "ours f32 vs its f32", res["ours_f32_vs_hf_f32"])


def replay_ms(runner, key=(64, 5120), reps=20):
    """GPU milliseconds of one replay of the hit's chunk graph (the state buffers as the last row left them)."""
    g = runner.graphs.get(key)
    return None if g is None else round(replay_median_ms(g.graph, reps), 3)


def profile(tag, fn):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    text = ka.table(sort_by="cuda_time_total", row_limit=30) + "\n\n" + ka.table(sort_by="cpu_time_total", row_limit=30)
    (OUT / f"profile_{tag}.txt").write_text(text)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", default="0.8B,2B,9B")
    ap.add_argument("--cache-mb", type=int, default=8192)
    ap.add_argument("--skip-f32", action="store_true")
    ap.add_argument("--skip-checks", action="store_true", help="skip the kernel checks (fla autotunes ~2 min for them)")
    ap.add_argument("--compile", action="store_true", help="also time with torch.compile'd elementwise pieces")
    ap.add_argument("--profile", default="9B,0.8B", help="shapes whose plain forward is profiled")
    ap.add_argument("--micro", default="", help="shapes whose kernel variants are timed")
    ap.add_argument("--hf-f32", action="store_true", help="also run transformers in float32 (bf16's own drift)")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    for step in [env] + ([] if args.skip_checks else [kernel_checks]):
        try:
            step()
        except Exception:  # noqa: BLE001
            R.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            log(traceback.format_exc())
        save()
    for name in args.shapes.split(","):
        try:
            with torch.no_grad():
                bench_shape(name, args)
        except Exception:  # noqa: BLE001
            R.setdefault("errors", []).append(f"{name}: " + traceback.format_exc()[-2000:])
            log(traceback.format_exc())
        gc.collect()  # the shape's models and cache went with bench_shape's frame
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        save()
    log(json.dumps(R, indent=1))


if __name__ == "__main__":
    main()
