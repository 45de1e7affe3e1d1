"""Skinny GEMMs of a short chunk (64 tokens) at the 9B shape: cuBLAS's time per weight shape and a few reshapings.

In the hit's profile (bench/results/s3_run2) GDN's input projection ([64, 4096] x [4096, 8256]) took 30.5 us, 2.2 TB/s,
where the MLP's gate/up reached 3.9 TB/s. This times each projection as the model calls it (x @ W.T) and variants
that change only the shape cuBLAS sees: the weight's rows padded to a multiple of 128 or 256, split in two GEMMs,
64 or 128 activation rows. Each timing is a CUDA graph of calls cycling through enough weight copies that they come
from HBM, not L2. Prints "[gemm]" lines; writes OUT/gemm_skinny.json.

Run on the device machine:  python3 bench/gpu_gemm_skinny.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import graph_us  # bench/ is on sys.path when this runs as a script

COPIES = 8  # weight copies cycled through (>= 8 x 33 MB: beyond the H200's 50 MB L2)
H, I = 4096, 12288
SHAPES = {"gdn_in": (8256, H), "attn_qkv": (10240, H), "gate_up": (2 * I, H), "down": (H, I), "out": (H, H)}


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one call of fn launches (names as the profiler reports them)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in p.events() if e.device_type.name == "CUDA"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    dev, dt = "cuda", torch.bfloat16

    def record(name, us, nbytes):
        res[name] = {"us": us, "TB_s": round(nbytes / us / 1e6, 2)}
        print(f"[gemm] {name}: {us} us, {res[name]['TB_s']} TB/s", flush=True)

    for name, (N, K) in SHAPES.items():
        x = {m: torch.randn(m, K, device=dev, dtype=dt) for m in (64, 128)}
        Ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(COPIES)]
        nb = N * K * 2
        record(f"{name}_M64", graph_us([lambda W=W: x[64] @ W.T for W in Ws]), nb)
        res[f"{name}_M64"]["kernels"] = kernel_names(lambda W=Ws[0]: x[64] @ W.T)
        print(f"[gemm] {name}_M64 kernels: {res[f'{name}_M64']['kernels']}", flush=True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        record(f"{name}_M64_no_reduced_reduction", graph_us([lambda W=W: x[64] @ W.T for W in Ws]), nb)
        res[f"{name}_M64_no_reduced_reduction"]["kernels"] = kernel_names(lambda W=Ws[0]: x[64] @ W.T)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        record(f"{name}_M128", graph_us([lambda W=W: x[128] @ W.T for W in Ws]), nb)
        record(f"{name}_M64_WxT", graph_us([lambda W=W: (W @ x[64].T).T for W in Ws]), nb)
        for mult in (128, 256):
            Np = -(-N // mult) * mult
            if Np != N:
                Wp = [torch.cat([W, W.new_zeros(Np - N, K)]) for W in Ws]
                record(f"{name}_M64_padN{Np}", graph_us([lambda W=W: x[64] @ W.T for W in Wp]), nb)
                del Wp
        if N % 1024:  # a ragged N: the aligned bulk and the rest as two GEMMs
            n1 = N - N % 1024
            parts = [(W[:n1].contiguous(), W[n1:].contiguous()) for W in Ws]
            record(f"{name}_M64_split{n1}+{N - n1}", graph_us([lambda p=p: (x[64] @ p[0].T, x[64] @ p[1].T) for p in parts]), nb)
            del parts
        del Ws
        torch.cuda.empty_cache()
    (args.out / "gemm_skinny.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
