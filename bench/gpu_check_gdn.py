"""GPU check of statecache.kernels.gdn.delta_chunk (one chunk of the gated delta rule) at the 9B GDN shape.

Hk=16, Hv=32, Dk=Dv=128, bf16 q/k/v/beta (q, k, v strided views split from one [L, C] projection, as in the
model), float32 g and state. For L in (16, 33, 64): max |error| of the output and of the new state against
kernels.delta_rule_reference in float32 (on the same bf16 inputs), relative to the reference's max |value|, for
fla's chunk_gated_delta_rule and for each variant of delta_chunk (block_v 32/64/128 x num_warps 4/8 x dot
precision tf32/tf32x3/ieee, then block_k 32/128 for the fastest). "o" is the bf16 output, "o32" the output when v
comes in float32 (L=64: the kernel's own precision, without the final rounding). Inputs "rand": random keys; "corr"
(L=64 only): keys at cosine ~0.5, beta near 1, weak decay, where a badly conditioned solve would show.

Times (L=64): GPU microseconds per call of a CUDA graph of 24 calls cycling through 24 input sets (72 MB: q/k/v
and state come mostly from HBM, not L2), median of 10 replays, CUDA events; fla's call timed the same way.
A graph replay of the default variant is checked against its eager result. Variants that fail to compile or run
are recorded with their error. No new variant starts after --budget seconds of the sweep (fla's own first
calls, which autotune, come before it).

Run on the device machine:  python3 bench/gpu_check_gdn.py --out $OUT   (one line per result, "[gdn] ...";
writes OUT/gdn_check.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gpu_timing  # noqa: E402 - bench/ is on sys.path when this runs as a script
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statecache.kernels.dispatch import delta_rule_reference  # noqa: E402
from statecache.kernels.gdn import delta_chunk  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
LENGTHS = (16, 33, 64)
BUFS = CALLS = 24
DEV = "cuda"
REPS = 10
T0 = time.perf_counter()


def say(*a):
    print("[gdn]", f"{time.perf_counter() - T0:5.1f}s", *a, flush=True)


def short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def make(L: int, gen: torch.Generator, kind: str = "rand"):
    """q, k [L, HK, DK], v [L, HV, DV] (bf16 views of one projection), g [L, HV] f32, beta [L, HV] bf16,
    S [HV, DK, DV] f32."""
    proj = torch.randn(L, 2 * HK * DK + HV * DV, device=DEV, generator=gen).to(torch.bfloat16)
    q, k, v = torch.split(proj, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(L, HK, DK), k.view(L, HK, DK), v.view(L, HV, DV)
    a = torch.randn(L, HV, device=DEV, generator=gen)
    b = torch.randn(L, HV, device=DEV, generator=gen)
    if kind == "corr":
        k = k + 1.0  # (a contiguous copy) cosine ~0.5 between keys
        g, beta = -F.softplus(a) * 0.01, torch.sigmoid(b + 3.0)
    else:
        g, beta = -F.softplus(a - 1.0) * 0.5, torch.sigmoid(b)
    S = 0.5 * torch.randn(HV, DK, DV, device=DEV, generator=gen)
    return q, k, v, g, beta.to(torch.bfloat16), S


class Case:
    """One input set of length L and its float32 reference."""

    def __init__(self, L: int, kind: str, seed: int):
        self.L, self.kind = L, kind
        self.args = make(L, torch.Generator(device=DEV).manual_seed(seed), kind)
        q, k, v, g, beta, S = self.args
        rep = HV // HK
        self.o_ref, self.S_ref = delta_rule_reference(q.float().repeat_interleave(rep, 1),
                                                      k.float().repeat_interleave(rep, 1), v.float(), g, beta.float(), S)

    def rel(self, o, S) -> dict:
        return {"o": relerr(o, self.o_ref), "S": relerr(S, self.S_ref)}


def relerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(f"{float((x.float() - ref).abs().max() / ref.abs().max()):.3g}")


def ours(case: Case, **kw) -> dict:
    """Errors of delta_chunk on the case; at L=64 also of its float32 output (v given in float32)."""
    q, k, v, g, beta, S0 = case.args
    S = S0.clone()
    res = case.rel(delta_chunk(q, k, v, g, beta, S, **kw), S)
    if case.L == 64:
        res["o32"] = relerr(delta_chunk(q, k, v.float(), g, beta, S0.clone(), **kw), case.o_ref)
    return res


def fla_call(gdr):
    def call(q, k, v, g, beta, S):
        o, St = gdr(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=S[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[0], St[0]
    return call


def graph_us(fns) -> float:
    """GPU microseconds per call: CALLS calls cycling through fns in one CUDA graph, median of REPS replays."""
    return gpu_timing.graph_us(fns, CALLS, REPS)


def graph_replay_check(case: Case) -> dict:
    """The default variant captured once: a replay from the saved state must match the eager call exactly."""
    q, k, v, g, beta, S0 = case.args
    S_eager = S0.clone()
    o_eager = delta_chunk(q, k, v, g, beta, S_eager)
    S = S0.clone()
    delta_chunk(q, k, v, g, beta, S)  # warm (compiled already)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = delta_chunk(q, k, v, g, beta, S)
    S.copy_(S0)
    graph.replay()
    torch.cuda.synchronize()
    return {"o_equal": bool(torch.equal(o, o_eager)), "S_equal": bool(torch.equal(S, S_eager))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=40.0, help="seconds of sweep after which no new variant starts")
    ap.add_argument("--skip-fla", action="store_true", help="no comparison with fla (its autotuning takes ~2 min)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true float32
    import triton

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"Hk": HK, "Hv": HV, "Dk": DK, "Dv": DV}, "errors_note": "max |err| / max |reference|",
           "us_note": f"L=64, graph of {CALLS} calls over {BUFS} input sets", "fla": {}, "variants": [], "failed": []}

    def save():
        (args.out / "gdn_check.json").write_text(json.dumps(out, indent=1))

    cases = {L: Case(L, "rand", L) for L in LENGTHS}
    corr = Case(64, "corr", 99)
    sets = [make(64, torch.Generator(device=DEV).manual_seed(1000 + i)) for i in range(BUFS)]

    try:
        out["graph_replay"] = graph_replay_check(cases[64])
        say(f"graph replay of the default variant equals eager: {out['graph_replay']}")
    except Exception as ex:  # noqa: BLE001
        out["graph_replay"] = {"error": short(ex)}
        say(f"graph replay check FAILED {short(ex)}")
    save()

    sweep0 = time.perf_counter()

    def variant(**kw) -> dict:
        row = dict(kw)
        try:
            for L, c in cases.items():
                row[f"rand_L{L}"] = ours(c, **kw)
            row["corr_L64"] = ours(corr, **kw)
            row["us"] = graph_us([lambda s=s: delta_chunk(*s, **kw) for s in sets])
            errs = " | ".join(f"{n} " + " ".join(f"{e} {x:.1e}" for e, x in row[n].items())
                              for n in [*(f"rand_L{L}" for L in LENGTHS), "corr_L64"])
            say(f"{kw}: {row['us']} us | {errs}")
        except Exception as ex:  # noqa: BLE001 - a variant that does not compile or run: note it, go on
            row["error"] = short(ex)
            out["failed"].append(row)
            say(f"{kw}: FAILED {row['error']}")
        out["variants"].append(row)
        save()
        return row

    order = [(32, 8), (32, 4), (64, 8), (64, 4), (128, 8), (128, 4)]
    for prec in ("tf32", "tf32x3", "ieee"):
        for bv, nw in order:
            if time.perf_counter() - sweep0 < args.budget:
                variant(block_v=bv, num_warps=nw, dot_precision=prec)
            else:
                out["variants"].append({"block_v": bv, "num_warps": nw, "dot_precision": prec, "skipped": "budget"})
    timed = sorted((r for r in out["variants"] if "us" in r and r["dot_precision"] == "tf32"), key=lambda r: r["us"])
    if timed:
        best = {n: timed[0][n] for n in ("block_v", "num_warps", "dot_precision")}
        for bk in (32, 128):
            if time.perf_counter() - sweep0 < args.budget:
                variant(**best, block_k=bk)
    if not args.skip_fla:  # last: fla autotunes for about two minutes on its first call
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            fla = fla_call(chunk_gated_delta_rule)
            for L, c in cases.items():
                out["fla"][f"rand_L{L}"] = c.rel(*fla(*c.args))
            out["fla"]["corr_L64"] = corr.rel(*fla(*corr.args))
            out["fla"]["us"] = graph_us([lambda s=s: fla(*s) for s in sets])
            say(f"fla: {out['fla']}")
        except Exception as ex:  # noqa: BLE001 - no fla here, or it failed: go on without it
            out["fla"]["error"] = short(ex)
            say(f"fla FAILED {short(ex)}")
        save()

    ok = [r for r in out["variants"] if "us" in r]
    out["fastest"] = min(ok, key=lambda r: r["us"], default=None)
    save()
    say(f"fastest: {out['fastest']}")
    say(f"done; {len(out['failed'])} variants failed; wrote {args.out / 'gdn_check.json'}")


if __name__ == "__main__":
    main()
