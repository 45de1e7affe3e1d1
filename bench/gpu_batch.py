"""Micro benchmark of batched hits: N agents' 64-token questions, each about its own saved 4096-token state.

For N in --counts (1, 4, 16, 64 by default), on a Qwen3.5 shape with random weights (bench/gpu_bench.py's build_hf
style: every parameter perturbed), bf16 on the GPU:
- `single_ms`: the N hits one row at a time through StateCache.row (one chunk graph replay each), wall clock for
  all N, median over --reps;
- `batched_ms`: the same N rows through StateCache.rows_batched (one batch graph replay), wall clock;
  `batched_graph_ms`: the batch graph's replay alone (CUDA events); `first_batched_ms`: the first call, including
  its graph capture;
- `max_dp`: max |dp| between the batched and the one-at-a-time answers (bf16 noise expected; float32 ~1e-6).
Targets on an H200 at the 9B shape: 16 hits <= 30 ms in all, 4 hits <= 10 ms.

Robust by design (device time is scarce): each case runs in try/except, progress is logged with timestamps, the
JSON (--out/gpu_batch.json) is rewritten after every step, and --budget seconds stops starting new cases.
Checked end to end on the CPU: `python3 bench/gpu_batch.py --device cpu --tiny --state 256 --out /tmp/b`, and
with the Triton batch kernels in the interpreter: `TRITON_INTERPRET=1 python3 bench/gpu_batch.py --device cpu --tiny
--triton --state 256 --counts 1,4 --reps 1 --out /tmp/b`.

Run on the device machine:  python3 bench/gpu_batch.py --out $OUT   (9B, 1/4/16/64 hits)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from statecache.batch import BatchRunner  # noqa: E402
from statecache.cache import CacheSettings, StateCache  # noqa: E402
from statecache.config import parse_config  # noqa: E402
from statecache.kernels import kernels_for  # noqa: E402
from statecache.loader import weights_from_state_dict  # noqa: E402
from statecache.model import Qwen35  # noqa: E402
from statecache.runner import ChunkRunner  # noqa: E402

R: dict = {}
OUT: Path
T0 = time.perf_counter()

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f} s]", *a, flush=True)


def save():
    (OUT / "gpu_batch.json").write_text(json.dumps(R, indent=1))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(shape: str, device: torch.device, dtype: torch.dtype):
    """Our model (fused weights) of a Qwen3.5 shape with random weights, built through transformers' own model
    (as bench/gpu_bench.py's build_hf does, on any device); the transformers model is dropped afterwards."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from statecache.checkpoints import real_shape

    fields = dict(TINY) if shape == "tiny" else real_shape(shape)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields))
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.to(dtype).eval()
    cfg = parse_config(hf.config.to_dict())
    w = weights_from_state_dict(cfg, dict(hf.state_dict()), list(range(32, 58)), device, dtype)
    del hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Qwen35(w), cfg


def timed(fn, dev, reps: int) -> tuple[float, object]:
    """Median wall milliseconds of fn() (synchronised), and its last result."""
    ts, out = [], None
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(1000 * (time.perf_counter() - t))
    return round(statistics.median(ts), 3), out


def maxdp(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a.probs, b.probs) for x, y in zip(u, v))


def main():
    global OUT
    if torch.cuda.is_available():  # the compile caches the engine keeps (a carried copy serves these kernels too)
        from statecache.compile_cache import use_persistent_caches

        use_persistent_caches()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/batch")
    ap.add_argument("--shape", default="9B", help="0.8B, 2B, 9B or tiny")
    ap.add_argument("--tiny", action="store_true", help="--shape tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on the CPU)")
    ap.add_argument("--state", type=int, default=4096, help="state tokens per agent")
    ap.add_argument("--question", type=int, default=64, help="question tokens per row")
    ap.add_argument("--counts", default="1,4,16,64", help="concurrent hits per case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--delta-variants", default="", metavar="BV:W,...",
                    help="after each case, the same rows again with the batched delta rule's value block and warps "
                         "(e.g. 64:4,128:8), each shape's graph recaptured")
    ap.add_argument("--no-kernel-sweep", action="store_true", help="skip the per-kernel launch-knob sweep at the end")
    ap.add_argument("--cache-mb", type=int, default=0, help="cache budget (default: enough for every state)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds: start no new case after this")
    ap.add_argument("--no-compile", action="store_true", help="eager elementwise pieces (CUDA compiles by default)")
    ap.add_argument("--triton", action="store_true", help="CPU check: the batch through the Triton kernels in "
                    "Triton's interpreter (set TRITON_INTERPRET=1), bucketed shapes as on the GPU")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    shape = "tiny" if args.tiny else args.shape
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    counts = [int(x) for x in args.counts.split(",")]
    n_states = max(counts)
    R.update(args=vars(args), shape=shape, device=str(dev), dtype=str(dtype), cases={}, errors=[])
    if dev.type == "cuda":
        R["gpu"] = torch.cuda.get_device_name()
    R["torch"] = torch.__version__
    save()
    try:
        with torch.no_grad():
            t = time.perf_counter()
            model, cfg = build(shape, dev, dtype)
            if dev.type == "cuda" and not args.no_compile:
                model.compile_elementwise()
            kernels = kernels_for(dev, compile=dev.type == "cuda" and not args.no_compile)
            R["build_s"] = round(time.perf_counter() - t, 1)
            R["kernels"] = kernels.name
            log("built", shape, "on", dev, dtype, R["build_s"], "s; kernels", kernels.name)
            max_pos = 8192 if args.state + args.question + 64 <= 8192 else 16384
            runner = ChunkRunner(model, kernels, max_pos=max_pos, max_slots=4)
            per_state = _state_bytes(cfg, args.state, dtype)
            mb = args.cache_mb or int(2 * n_states * per_state / 2**20) + 64  # a state plants at 2048 and p
            cache = StateCache(runner, CacheSettings(mb=mb, stride=0, tail=0))
            cache.batch = BatchRunner(model, kernels, max_slots=4, max_batch=max(64, n_states), max_pos=max_pos,
                                      pool=runner.pool, graphs=runner.use_graphs,
                                      **(dict(triton=True, pad=True) if args.triton else {}))
            R["batch_triton"] = cache.batch.bk.triton
            R["cache_mb"] = mb
            if cache.batch.bk.triton:
                kernel_check(cfg, dev, dtype)
            V = cfg.vocab_size
            g = torch.Generator().manual_seed(1)
            states = [torch.randint(0, V, (args.state,), generator=g).tolist() for _ in range(n_states)]
            qseed = iter(range(10**6))

            def question():
                return torch.randint(0, V, (args.question,), generator=torch.Generator().manual_seed(next(qseed))).tolist()

            t = time.perf_counter()
            for k, s in enumerate(states):  # plant each state (cold rows: capture their chunk graphs once)
                ids = s + question()
                a = cache.row(ids, args.state, [len(ids) - 1], [4])
                if a is None:
                    raise RuntimeError(f"state {k} was not planted (the cached path declined it)")
                if k == 0 or (k + 1) % 16 == 0:
                    log(f"planted {k + 1}/{n_states} states ({time.perf_counter() - t:.1f} s)")
            sync(dev)
            R["plant_s"] = round(time.perf_counter() - t, 1)
            R["cache"] = {k: v for k, v in cache.info().items() if isinstance(v, (int, float))}
            save()
            for n in counts:
                if time.perf_counter() - T0 > args.budget:
                    R["errors"].append(f"budget of {args.budget} s spent: case {n} and later not run")
                    log(R["errors"][-1])
                    break
                try:
                    case(cache, states, question, n, args, dev)
                except Exception:  # noqa: BLE001
                    R["errors"].append(f"case {n}: " + traceback.format_exc()[-2000:])
                    log(R["errors"][-1])
                save()
            if dev.type == "cuda" and time.perf_counter() - T0 < args.budget and not args.no_kernel_sweep:
                try:
                    # the 16-hit case, a stop's usual single row, and score's usual hit (a state's unaligned tail
                    # and its question: 65-128 tokens, two delta-rule chunks)
                    for B, L in ((16, 64), (1, 64), (1, 128)):
                        variants(cfg, dev, dtype, args.state, B=B, L=L)
                except Exception:  # noqa: BLE001
                    R["errors"].append("variants: " + traceback.format_exc()[-2000:])
                    log(R["errors"][-1])
                save()
            R["batch_stats"] = dict(cache.batch.stats)
            R["batch_failures"] = cache.batch.failures[:5]
    except Exception:  # noqa: BLE001
        R["errors"].append(traceback.format_exc()[-3000:])
        log(R["errors"][-1])
    R["total_s"] = round(time.perf_counter() - T0, 1)
    save()
    log(json.dumps(R["cases"], indent=1))


def _state_bytes(cfg, n: int, dtype) -> int:
    es = torch.empty(0, dtype=dtype).element_size()
    G, A = len(cfg.linear_layers), len(cfg.full_layers)
    S = G * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = G * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * es
    kv = 2 * A * n * cfg.num_key_value_heads * cfg.head_dim * es
    return S + conv + kv


def kernel_check(cfg, dev, dtype):
    """The three batched Triton kernels at the model's head shapes against the one-sequence reference loop (four
    sequences of 64, 1, 100 and 0 tokens, cached keys in separate buffers); max |error| each, or the traceback."""
    from statecache.batch import BatchKernels, BatchKV
    from statecache.kernels import TorchKernels

    out = R.setdefault("kernel_check", {})
    ref, tri = BatchKernels(TorchKernels(), triton=False), BatchKernels(TorchKernels(), triton=True)
    lens, starts = [64, 1, 100, 0], [512, 64, 1024, 0]
    cu = torch.tensor([0, 64, 65, 165, 165], device=dev)
    T, B, lmax = 170, 4, 128
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=g)).to(dev, dt)

    checks = {}
    C, W = cfg.conv_dim, cfg.linear_conv_kernel_dim
    x, w, tails = rnd(T, C), rnd(C, W, scale=0.3), rnd(B, W - 1, C)
    checks["conv"] = lambda: _cmp(tri.conv(x, w, tails.clone(), cu, lmax, None), ref.conv(x, w, tails.clone(), cu, lmax, lens))
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q, k, v = rnd(T, Hk, Dk), rnd(T, Hk, Dk), rnd(T, Hv, Dv)
    gg = -torch.rand(T, Hv, generator=g).to(dev) * 0.3
    beta = torch.rand(T, Hv, generator=g).to(dev, dtype)
    S = rnd(B, Hv, Dk, Dv, scale=0.1, dt=torch.float32)

    def delta():
        S1, S2 = S.clone(), S.clone()
        e = _cmp(tri.delta(q, k, v, gg, beta, S1, cu, lmax, None), ref.delta(q, k, v, gg, beta, S2, cu, lmax, lens))
        return [e, float((S1 - S2).abs().max())]
    checks["delta"] = delta
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qa, ka, va = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    groups = [(rnd(2, st + 5, Hkv, D), rnd(2, st + 5, Hkv, D)) if st else (None, None) for st in starts]
    es = ka.element_size()
    off = torch.tensor([[(K[1].data_ptr() - ka.data_ptr()) // es, (V[1].data_ptr() - va.data_ptr()) // es]
                        if K is not None else [0, 0] for K, V in groups], device=dev)
    st_t = torch.tensor(starts, device=dev)
    kv = BatchKV(groups, off[None].expand(2, B, 2), None, None)
    checks["span"] = lambda: _cmp(tri.attend(1, qa, ka, va, cu, st_t, kv, lmax, D**-0.5, None),
                                  ref.attend(1, qa, ka, va, cu, st_t, kv, lmax, D**-0.5, lens))
    for name, fn in checks.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001
            out[name] = traceback.format_exc()[-2000:]
        log("kernel check", name, out[name] if not isinstance(out[name], str) else out[name][-600:])
        save()


def variants(cfg, dev, dtype, state: int, B: int = 16, L: int = 64):
    """GPU microseconds of the batched span attention and delta rule at this shape for B sequences of L tokens
    (each attending over its own `state` cached keys in its own buffer), over launch knobs: for tuning."""
    from gpu_timing import graph_us

    from statecache import gdn_triton, span_triton

    out = R.setdefault("variants_us", {})
    T = B * L
    cu = torch.arange(0, T + 1, L, device=dev)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (torch.randn(T, h, D, device=dev, dtype=dtype) for h in (Hq, Hkv, Hkv))
    groups = [(torch.randn(state, Hkv, D, device=dev, dtype=dtype), torch.randn(state, Hkv, D, device=dev, dtype=dtype))
              for _ in range(B)]
    es = k.element_size()
    off = torch.tensor([[(K.data_ptr() - k.data_ptr()) // es, (V.data_ptr() - v.data_ptr()) // es] for K, V in groups],
                       device=dev)
    starts = torch.full((B,), state, device=dev)
    for bm, bn, w in ((64, 32, 4), (64, 64, 4), (64, 32, 8), (128, 32, 8), (32, 32, 4), (64, 64, 8)):
        name = f"{'' if B == 16 else f'b{B}_'}{'' if L == 64 else f'l{L}_'}span_m{bm}_n{bn}_w{w}"
        try:
            out[name] = graph_us([lambda: span_triton.attend_batch(q, k, v, cu, starts, off, L, D**-0.5, block_m=bm,
                                                                   block_n=bn, num_warps=w)])
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        log("variant", name, out[name])
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qd, kd = (torch.randn(T, Hk, Dk, device=dev, dtype=dtype) for _ in range(2))
    vd = torch.randn(T, Hv, Dv, device=dev, dtype=dtype)
    gd = -torch.rand(T, Hv, device=dev) * 0.3
    bd = torch.rand(T, Hv, device=dev, dtype=dtype)
    S = torch.zeros(B, Hv, Dk, Dv, device=dev)
    for bv, w in ((32, 4), (32, 8), (64, 4), (64, 8), (128, 8), (128, 16)):  # 128: one program a head and sequence
        name = f"{'' if B == 16 else f'b{B}_'}{'' if L == 64 else f'l{L}_'}delta_v{bv}_w{w}"
        try:
            out[name] = graph_us([lambda: gdn_triton.delta_batch(qd, kd, vd, gd, bd, S, cu, L, block_v=bv, num_warps=w)])
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        log("variant", name, out[name])
    # fla's chain of chunked kernels over the same packed sequences, each from its own initial state (what the packed
    # path runs): at one sequence it lost to delta_batch (33 against 16 us, s3); at 16 its chunks run in parallel
    name = f"{'' if B == 16 else f'b{B}_'}{'' if L == 64 else f'l{L}_'}delta_fla_chain"
    try:
        from statecache.kernels import FlaKernels

        fk = FlaKernels()
        init = torch.zeros(B, Hv, Dk, Dv, device=dev)
        out[name] = graph_us([lambda: fk.delta(qd[None], kd[None], vd[None], gd[None], bd[None], init, cu)])
    except Exception as e:  # noqa: BLE001
        out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    log("variant", name, out[name])
    # the same chain with its chunk indices computed before the capture (fla 0.6 takes them as an argument, so nothing
    # is read on the host inside the graph): the form a batch graph could hold; with and without the final states; and
    # what gathering B states of one layer from their own tensors into contiguous slots costs (fla wants them so)
    pre = f"{'' if B == 16 else f'b{B}_'}{'' if L == 64 else f'l{L}_'}"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices

        ci = prepare_chunk_indices(cu, 64)
        init = torch.randn(B, Hv, Dk, Dv, device=dev) * 0.1

        def chain(final: bool):
            return chunk_gated_delta_rule(qd[None], kd[None], vd[None], gd[None], bd[None], initial_state=init,
                                          output_final_state=final, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                          chunk_indices=ci)

        S.copy_(init)
        o_ours = gdn_triton.delta_batch(qd, kd, vd, gd, bd, S, cu, L)
        o_fla, S_fla = chain(True)
        out[pre + "fla_vs_ours_max_do"] = _cmp(o_fla[0], o_ours)
        out[pre + "fla_vs_ours_max_dS"] = _cmp(S_fla, S)
        log("variant", pre + "fla vs ours", out[pre + "fla_vs_ours_max_do"], out[pre + "fla_vs_ours_max_dS"])
        for final in (False, True):
            name = pre + ("delta_fla_static_final" if final else "delta_fla_static")
            try:
                out[name] = graph_us([lambda: chain(final)])
            except Exception as e:  # noqa: BLE001
                out[name] = f"{type(e).__name__}: {str(e)[:200]}"
            log("variant", name, out[name])
        srcs = [torch.randn(Hv, Dk, Dv, device=dev) for _ in range(B)]
        name = pre + "state_gather"
        out[name] = graph_us([lambda: [init[b].copy_(srcs[b]) for b in range(B)]])
        log("variant", name, out[name])
    except Exception as e:  # noqa: BLE001
        out[pre + "delta_fla_static"] = f"{type(e).__name__}: {str(e)[:200]}"
        log("variant", pre + "delta_fla_static", out[pre + "delta_fla_static"])


def _cmp(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def rerun(cache, rows, single, graph_of, dev, reps: int) -> dict:
    """The case's rows through rows_batched again under other settings (the first call captures what they need):
    wall ms, agreement with the one-at-a-time answers, rows answered, and the replay of the graph `graph_of()`
    gives; an error's text instead when it raises."""
    def worst(ref, got):
        return max((maxdp(a, b) for a, b in zip(ref, got) if a is not None and b is not None), default=None)

    try:
        cache.rows_batched(rows)
        ms, again = timed(lambda: cache.rows_batched(rows), dev, reps)
        v = {"batched_ms": ms, "max_dp_vs_single": worst(single, again), "answered": sum(b is not None for b in again)}
        g = graph_of()
        if g is not None and dev.type == "cuda":
            from gpu_timing import replay_median_ms

            v["graph_ms"] = round(replay_median_ms(g.graph, 20), 3)
        return v
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def case(cache, states, question, n: int, args, dev):
    res = R["cases"].setdefault(str(n), {})
    rows = [(states[k] + question(), args.state, None, [4]) for k in range(n)]
    rows = [(ids, sl, [len(ids) - 1], no) for ids, sl, _, no in rows]
    log(f"case {n}: one at a time")
    res["single_ms"], single = timed(lambda: [cache.row(*r) for r in rows], dev, args.reps)
    res["single_paths"] = sorted({a.path for a in single})
    res["single_per_row_ms"] = round(res["single_ms"] / n, 3)
    log(f"case {n}: single {res['single_ms']} ms ({res['single_per_row_ms']} per row), paths {res['single_paths']}")
    save()
    sync(dev)
    t = time.perf_counter()
    first = cache.rows_batched(rows)
    sync(dev)
    res["first_batched_ms"] = round(1000 * (time.perf_counter() - t), 1)  # includes the graph capture
    res["first_none"] = sum(a is None for a in first)
    res["batched_ms"], batched = timed(lambda: cache.rows_batched(rows), dev, args.reps)
    res["batched_per_row_ms"] = round(res["batched_ms"] / n, 3)
    ok = [(a, b) for a, b in zip(single, batched) if a is not None and b is not None]
    res["answered"] = len(ok)
    res["batched_paths"] = sorted({b.path for b in batched if b is not None})
    res["max_dp"] = max((maxdp(a, b) for a, b in ok), default=None)
    res["speedup"] = round(res["single_ms"] / res["batched_ms"], 2) if len(ok) == n else None
    if len(ok) < n:  # batched rows fell back (None): the reason is in the runner's failures / the log
        res["batch_failures"] = cache.batch.failures[-3:]
    runner = cache.batch
    key = runner.shape(n, sum(len(r[0]) - r[1] for r in rows))
    res["graph_key"] = list(key) if key else None
    g = runner.graphs.get(key) if key else None
    if g is not None and dev.type == "cuda":
        from gpu_timing import replay_median_ms

        res["batched_graph_ms"] = round(replay_median_ms(g.graph, 20), 3)
    log(f"case {n}: batched {res['batched_ms']} ms ({res['batched_per_row_ms']} per row; graph "
        f"{res.get('batched_graph_ms')}), first {res['first_batched_ms']} ms, {res['answered']}/{n} answered, "
        f"max |dp| vs single {res['max_dp']}, speedup {res['speedup']}")
    save()
    # the same rows with other launch knobs of the batched delta rule (value block : warps), graphs recaptured
    for spec in filter(None, args.delta_variants.split(",")):
        bv, w = (int(x) for x in spec.split(":"))
        name = f"v{bv}_w{w}"
        runner.bk.delta_kw = {"block_v": bv, "num_warps": w}
        runner.graphs.pop(key, None)
        v = rerun(cache, rows, single, lambda: runner.graphs.get(key), dev, args.reps)
        res.setdefault("delta_variants", {})[name] = v
        log(f"case {n}: delta {name}: {v}")
        save()
    runner.bk.delta_kw = {}
    runner.graphs.pop(key, None)


if __name__ == "__main__":
    main()
