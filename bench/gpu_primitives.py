"""GPU check of the two delta-rule primitives planting and batched hits rest on (fla 0.6, 9B GDN shape, bf16).

1. Segmented planting: the delta rule of a packed batch run as successive calls split at checkpoint positions
   (each call: segment k of every sequence, cu_seqlens, initial_state = the previous finals) against one call;
   outputs and final states must agree, and the extra time is the cost of planting exact fp32 states.
2. Per-sequence initial states: B sequences of 64 tokens each from its own saved state in one call (cu_seqlens,
   initial_state [B, H, K, V]) against B separate calls.
Times are CUDA-graph replays (bench/gpu_timing.py). Prints tagged lines; JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from gpu_timing import graph_us  # bench/ is on sys.path when this runs as a script

    def graph_ms(fn):
        try:
            return round(graph_us([fn]) / 1000, 4)
        except Exception as e:  # noqa: BLE001 - report, go on
            print("graph failed:", type(e).__name__, e, flush=True)
            return None

    dev, dt = "cuda", torch.bfloat16
    Hk, Hv, K, V = 16, 32, 128, 128
    res: dict = {}
    g = torch.Generator(device=dev).manual_seed(0)

    def inputs(T):
        q = torch.randn(1, T, Hk, K, device=dev, dtype=dt, generator=g)
        k = torch.randn(1, T, Hk, K, device=dev, dtype=dt, generator=g)
        v = torch.randn(1, T, Hv, V, device=dev, dtype=dt, generator=g)
        gg = -torch.rand(1, T, Hv, device=dev, generator=g).float() * 0.1
        beta = torch.rand(1, T, Hv, device=dev, generator=g).to(dt)
        return q, k, v, gg, beta

    def gdr(q, k, v, gg, beta, init, cu):
        return chunk_gated_delta_rule(q, k, v, g=gg, beta=beta, initial_state=init, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

    # 1. segmented planting: B rows of 4160 tokens, checkpoints at 2048, 4032, 4096
    for B in (1, 4):
        n, cuts = 4160, [0, 2048, 4032, 4096, 4160]
        T = B * n
        q, k, v, gg, beta = inputs(T)
        cu_full = torch.arange(0, T + 1, n, device=dev, dtype=torch.long)

        def one():
            return gdr(q, k, v, gg, beta, None, cu_full)

        segs = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            idx = torch.cat([torch.arange(r * n + a, r * n + b, device=dev) for r in range(B)])
            cu = torch.arange(0, B * (b - a) + 1, b - a, device=dev, dtype=torch.long)
            segs.append((idx, cu))

        def segmented():
            S = None
            o = torch.empty_like(v)
            states = []
            for idx, cu in segs:
                oo, S = gdr(q[:, idx], k[:, idx], v[:, idx], gg[:, idx], beta[:, idx], S, cu)
                o[:, idx] = oo
                states.append(S)
            return o, S

        o1, S1 = one()
        o2, S2 = segmented()
        res[f"seg_B{B}"] = {
            "max_do": float((o1.float() - o2.float()).abs().max()), "max_dS": float((S1 - S2).abs().max()),
            "S_scale": float(S1.abs().max()),
            "one_ms": graph_ms(lambda: one()), "segmented_ms": graph_ms(lambda: segmented()),
        }
        print("seg", B, res[f"seg_B{B}"], flush=True)

    # 2. per-sequence initial states, 64 tokens each
    for B in (1, 4, 16, 64):
        L = 64
        q, k, v, gg, beta = inputs(B * L)
        init = torch.randn(B, Hv, K, V, device=dev, generator=g) * 0.1
        cu = torch.arange(0, B * L + 1, L, device=dev, dtype=torch.long)

        def batched():
            return gdr(q, k, v, gg, beta, init, cu)

        def separate():
            outs = [gdr(q[:, i * L:(i + 1) * L], k[:, i * L:(i + 1) * L], v[:, i * L:(i + 1) * L],
                        gg[:, i * L:(i + 1) * L], beta[:, i * L:(i + 1) * L], init[i:i + 1], None) for i in range(B)]
            return torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs], 0)

        ob, Sb = batched()
        os_, Ss = separate()
        res[f"init_B{B}"] = {"max_do": float((ob.float() - os_.float()).abs().max()), "max_dS": float((Sb - Ss).abs().max()),
                             "batched_ms": graph_ms(lambda: batched()),
                             "separate_ms": graph_ms(lambda: separate()) if B <= 16 else None}
        print("init", B, res[f"init_B{B}"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_primitives.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f} s")
