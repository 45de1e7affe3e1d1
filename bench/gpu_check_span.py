"""GPU check of statecache.kernels.span.attend_span (flash-decoding span attention) at the 9B attention shape.

Hq=16, Hkv=4, D=256, bf16; scenarios: L=64 over P=5120 keys with start=4096 (the main one, fully swept),
L=64 with P=2048 / start=1024, and L=128 with P=5120 / start=4096. For each: max |error| against a float32 SDPA
reference (TorchKernels.attend_span on float32 copies), next to statecache.kernels.dispatch.attend_grouped and
FlashAttention with native GQA (the aten op CudaKernels._flash_op calls); a CUDA-graph replay with `start` changed
after capture; then times. Each time is the GPU time per call of a CUDA graph of 20 calls (median of replays, CUDA
events); the calls cycle through 4 separate K/V caches (each a [A, P_max] buffer sliced like the real one), so K/V
come mostly from HBM, not from L2 warm from the previous call.

Sweep (main scenario): block_m x block_n x num_warps at num_stages 2, then num_stages 1/3 for the best three,
then split counts for the best; the other scenarios time the default and the best. Variants that fail to
compile or run are recorded with their error and skipped. New compiles stop after --budget seconds.

Run on the device machine:  python3 bench/gpu_check_span.py --out $OUT   (one line per result, "[span] ...";
writes OUT/span_check.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gpu_timing  # noqa: E402 - bench/ is on sys.path when this runs as a script
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statecache.kernels.dispatch import TorchKernels, attend_grouped  # noqa: E402
from statecache.kernels.span import attend_span  # noqa: E402

HQ, HKV, D = 16, 4, 256
SCENARIOS = {"L64_P5120_s4096": (64, 5120, 4096), "L64_P2048_s1024": (64, 2048, 1024), "L128_P5120_s4096": (128, 5120, 4096)}
BUFS, CALLS, REPS = 4, 20, 10
T0 = time.perf_counter()


def say(*a):
    print("[span]", f"{time.perf_counter() - T0:5.1f}s", *a, flush=True)


def short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def graph_us(fns) -> float:
    """GPU microseconds per call: CALLS calls cycling through fns in one CUDA graph, median of REPS replays."""
    return gpu_timing.graph_us(fns, CALLS, REPS)


class Scenario:
    """BUFS independent (q, k, v) of one shape: k, v slices [a, :P] of [A, P + 64, Hkv, D] caches."""

    def __init__(self, L: int, P: int, start: int):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.L, self.P = L, P
        self.start = torch.tensor(start, dtype=torch.long, device="cuda")
        self.scale = D ** -0.5
        self.sets = []
        for _ in range(BUFS):
            q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
            K, V = (torch.randn(2, P + 64, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            self.sets.append((q, K[1, :P], V[1, :P]))
        q, k, v = self.sets[0]
        self.ref = TorchKernels().attend_span(q.float(), k.float(), v.float(), self.start, self.scale)

    def err(self, o) -> float:
        return round((o.float() - self.ref).abs().max().item(), 5)

    def calls(self, fn):
        return [lambda s=s: fn(*s) for s in self.sets]


def flash_fn(sc: Scenario):
    zero = torch.zeros(1, dtype=torch.int32, device="cuda")
    cu_q = torch.cat([zero, zero + sc.L])
    cu_k = torch.cat([zero, (sc.start + sc.L).to(torch.int32).reshape(1)])  # causal aligned to the keys' end
    return lambda q, k, v: torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, sc.L, sc.P, 0.0, True, False, scale=sc.scale)[0]


def baselines(sc: Scenario, res: dict) -> None:
    fns = {"grouped": lambda q, k, v: attend_grouped(q, k, v, sc.start, sc.scale), "flash_gqa": flash_fn(sc)}
    for name, fn in fns.items():
        try:
            e = sc.err(fn(*sc.sets[0]))
            us = graph_us(sc.calls(fn))
            res[name] = {"err": e, "us": us}
            say(f"{res['name']} {name}: err {e} | {us} us")
        except Exception as ex:  # noqa: BLE001 - record and go on
            res[name] = {"error": short(ex)}
            say(f"{res['name']} {name}: FAILED {short(ex)}")


def variant(sc: Scenario, res: dict, failed: list, **kw) -> dict:
    fn = lambda q, k, v: attend_span(q, k, v, sc.start, sc.scale, **kw)  # noqa: E731
    row = dict(kw)
    try:
        row["err"] = sc.err(fn(*sc.sets[0]))
        row["us"] = graph_us(sc.calls(fn))
        say(f"{res['name']} {kw}: err {row['err']} | {row['us']} us")
    except Exception as ex:  # noqa: BLE001 - a variant that does not compile or run: note it, go on
        row["error"] = short(ex)
        failed.append({"scenario": res["name"], **row})
        say(f"{res['name']} {kw}: FAILED {row['error']}")
    res["variants"].append(row)
    return row


def graph_start_check(sc: Scenario, res: dict) -> None:
    """Capture the default variant once, then replay with start moved: must follow the new start."""
    q, k, v = sc.sets[0]
    st = torch.zeros((), dtype=torch.long, device="cuda")
    attend_span(q, k, v, st, sc.scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_span(q, k, v, st, sc.scale)
    errs = {}
    for s in (0, sc.P // 3, sc.P - sc.L):
        st.fill_(s)
        graph.replay()
        ref = TorchKernels().attend_span(q.float(), k.float(), v.float(), st, sc.scale)
        errs[s] = round((out.float() - ref).abs().max().item(), 5)
    res["graph_start_errs"] = errs
    say(f"{res['name']} graph replay with start moved: err by start {errs}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=45.0, help="seconds after which no new variant starts")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"Hq": HQ, "Hkv": HKV, "D": D}, "us_per_call_note": f"graph of {CALLS} calls over {BUFS} K/V caches",
           "scenarios": {}, "failed": []}
    failed = out["failed"]

    def save():
        (args.out / "span_check.json").write_text(json.dumps(out, indent=1))

    def left() -> bool:
        return time.perf_counter() - T0 < args.budget

    best = None
    for name, (L, P, start) in SCENARIOS.items():
        sc = Scenario(L, P, start)
        res = out["scenarios"][name] = {"name": name, "L": L, "P": P, "start": start, "variants": []}
        baselines(sc, res)
        variant(sc, res, failed)  # the defaults
        if name == "L64_P5120_s4096":
            try:
                graph_start_check(sc, res)
            except Exception as ex:  # noqa: BLE001
                res["graph_start_errs"] = short(ex)
                say(f"{name} graph replay check FAILED {short(ex)}")
            for bm in (32, 64, 128):
                for bn in (32, 64, 128):
                    for nw in (4, 8):
                        if left():
                            variant(sc, res, failed, block_m=bm, block_n=bn, num_warps=nw, num_stages=2)
            save()
            ok = sorted((r for r in res["variants"] if "us" in r), key=lambda r: r["us"])
            keys = ("block_m", "block_n", "num_warps")
            tops = [{k: r[k] for k in keys} for r in ok if all(k in r for k in keys)][:3]
            for cfg in tops:
                for ns in (1, 3):
                    if left():
                        variant(sc, res, failed, **cfg, num_stages=ns)
            ok = sorted((r for r in res["variants"] if "us" in r), key=lambda r: r["us"])
            best = {k: v for k, v in ok[0].items() if k not in ("err", "us", "n_splits", "min_split_keys")} if ok else {}
            for n in (1, 4, 8, 16, 24, 32):
                if left():
                    variant(sc, res, failed, **best, n_splits=n, min_split_keys=64)
            res["best"] = min((r for r in res["variants"] if "us" in r), key=lambda r: r["us"], default=None)
            say(f"{name} best: {res['best']}")
        elif best and left():
            variant(sc, res, failed, **best)
        save()
        del sc
        torch.cuda.empty_cache()
    say(f"done; {len(failed)} variants failed; wrote {args.out / 'span_check.json'}")


if __name__ == "__main__":
    main()
