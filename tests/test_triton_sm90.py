"""The batched Triton kernels (and the one-chunk kernels they extend) compile for an H200 (sm_90) without a GPU:
Triton's own compiler and ptxas, ahead of time, at the 9B model's shapes and bf16. Catches what the interpreter
cannot (types, layouts, the compiler's view of the VARLEN branches). The compiles run two at a time in a subprocess
without TRITON_INTERPRET (which tests/conftest.py sets for this process). Skipped where this Triton cannot compile
ahead of time for CUDA (its API, or no CUDA backend). Another Triton (the GPU machine's 3.6) can be checked by
running this file with it first on the path: `PYTHONPATH=/path/to/triton-3.6:. python tests/test_triton_sm90.py`."""

from __future__ import annotations

import os

import pytest


def _compile(kernel, names, types, consts, num_warps=4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(zip(names, types))
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _mods():
    from statecache.kernels import conv as conv_triton, gdn as gdn_triton, span as span_triton

    return gdn_triton, conv_triton, span_triton


def delta_kernel(varlen, nsnap=0, src=False, bv=32, num_warps=4):
    names = ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "b_ptr", "s_ptr", "o_ptr", "L", "sq_t", "sq_h", "sq_d", "sk_t",
             "sk_h", "sk_d", "sv_t", "sv_h", "sv_d", "sg_t", "sg_h", "sb_t", "sb_h", "ss_h", "ss_k", "ss_v", "so_t",
             "so_h", "so_d", "scale", "cu_ptr", "ss_b", "snap_ptr", "at_ptr", "ss_n", "soff_ptr", "keep_ptr"]
    types = (["*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*fp32", "*bf16", "i32"] + ["i32"] * 19
             + ["fp32", "*i64", "i32", "*fp32", "*i64", "i32", "*i64", "*i64"])
    consts = dict(GROUP=2, DK=128, BK=64, BT=64, LOG_BT=6, BV=bv, DOT="tf32", RAW_QK=True, STORE=True, VARLEN=varlen,
                  NSNAP=nsnap, SRC=src)
    assert _compile(_mods()[0]._delta_chunk_kernel, names, types, consts, num_warps).asm["ptx"]


def conv_kernel(varlen):
    names = ["x", "sx", "w", "tail", "y", "sy", "real_ptr", "L", "C", "cu_ptr", "s_tail"]
    types = ["*bf16", "i32", "*bf16", "*bf16", "*bf16", "i32", "*i64", "i32", "i32", "*i64", "i32"]
    bt = 64 if varlen else 128  # conv_batch runs blocks of BLOCK_ROWS; conv_chunk up to MAX_ROWS rows at once
    assert _compile(_mods()[1]._conv_chunk_kernel, names, types, dict(W=4, BT=bt, BC=64, BW=4, VARLEN=varlen)).asm["ptx"]


def span_batch_kernel(direct):
    names = ["Q", "K", "V", "CU", "START", "OFF", "O", "OP", "LSE", "stride_ql", "stride_qh", "stride_qd", "stride_kp",
             "stride_kh", "stride_kd", "stride_ol", "stride_oh", "stride_od", "Hkv", "M_all", "n_splits", "min_tiles",
             "qk_scale"]
    types = ["*bf16", "*bf16", "*bf16", "*i64", "*i64", "*i64", "*bf16", "*fp32", "*fp32"] + ["i32"] * 13 + ["fp32"]
    consts = dict(R=4, D=256, BLOCK_M=64, BLOCK_N=32, DIRECT=direct, DOT_PREC="tf32")
    assert _compile(_mods()[2]._span_batch_kernel, names, types, consts).asm["ptx"]


def test_kernels_compile_for_sm90():
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    probe = "from triton.backends.nvidia.compiler import CUDABackend; from triton.compiler import ASTSource"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode:
        pytest.skip("this Triton has no CUDA backend to compile with")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if "AOT-API" in r.stdout:
        pytest.skip("this Triton's ahead-of-time compile API differs")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("compiled") == len(JOBS), r.stdout


# (what it prints, kernel, its arguments): the launches the engine makes on a GPU
JOBS = [("delta", delta_kernel, dict(varlen=True)), ("delta", delta_kernel, dict(varlen=False)),
        ("delta snapshots", delta_kernel, dict(varlen=True, nsnap=3)),
        ("delta from sources", delta_kernel, dict(varlen=True, src=True)),
        ("delta from sources, snapshots", delta_kernel, dict(varlen=True, nsnap=3, src=True)),
        ("delta from sources, 64-wide values", delta_kernel, dict(varlen=True, src=True, bv=64)),
        ("delta from sources, 128-wide values", delta_kernel, dict(varlen=True, src=True, bv=128, num_warps=8)),
        ("conv", conv_kernel, dict(varlen=True)), ("conv", conv_kernel, dict(varlen=False)),
        ("span", span_batch_kernel, dict(direct=True)), ("span", span_batch_kernel, dict(direct=False))]


def _compile_one(i: int) -> str:
    name, fn, kw = JOBS[i]
    fn(**kw)
    return f"compiled {name} {kw}"


if __name__ == "__main__":
    import inspect
    from concurrent.futures import ProcessPoolExecutor

    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        print("AOT-API")
        raise SystemExit(0)
    with ProcessPoolExecutor(2) as pool:  # ptxas is most of the time: two at once (CI has two cores)
        for line in pool.map(_compile_one, range(len(JOBS))):
            print(line, flush=True)
