"""GPU check of the batched delta rule (`gdn_triton.delta_batch`: a program per head, value slice and sequence runs
its sequence's 64-token chunks one after another) on step-like mixes at the 9B GDN shape (16 key heads, 32 value
heads, 128 x 128 state per head, bf16 inputs, float32 states), over its launch knobs, beside fla's chain of chunked
kernels on the same sequences and states (what a chunk-parallel form can reach: fla parallelises over chunks; its
precision with bf16 operands is `fla_err`). Each timing is the median replay of a CUDA graph holding one call
(microseconds); each mix also reports how far the outputs and final states are from a float32 reference of the
same inputs (`kernels.delta_rule_reference`, sequence by sequence), so that speed is never bought with precision.
`fla_in_graph` then asks whether fla's chain can live in the step graphs: one graph of fixed size (chunk indices built
in it from `cu`, fla's tensor cache off, states gathered in and copied out), every mix's data replayed through it.

    python bench/gpu_delta_steps.py --out DIR        (on the GPU machine; writes DIR/delta_steps.json)

What it does not do: run the model. The step's other kernels and its planting are measured by the load bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import graph_us, replay_median_ms  # noqa: E402

from statecache.kernels import gdn as gdn_triton  # noqa: E402
from statecache.kernels.dispatch import delta_rule_reference  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
MIXES = {  # name: sequence lengths in one call (a step: new-page chunks and hits' questions)
    "page2048": [2048],
    "page1024+16hits": [1024] + [64] * 16,
    "pages1536+512": [1536, 512],
    "page1024+48hits32": [1024] + [32] * 48,
    "4pages256+32hits": [256] * 4 + [48] * 32,
}


def inputs(lens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    q = torch.randn(T, HK, DK, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, HK, DK, device="cuda", generator=g).bfloat16()
    v = torch.randn(T, HV, DV, device="cuda", generator=g).bfloat16()
    gate = -torch.rand(T, HV, device="cuda", generator=g) * 0.3
    beta = torch.rand(T, HV, device="cuda", generator=g).bfloat16()
    S0 = torch.randn(len(lens), HV, DK, DV, device="cuda", generator=g) * 0.05
    return cu, q, k, v, gate, beta, S0


def reference(lens, cu, q, k, v, gate, beta, S0):
    rep = HV // HK
    os, Ss = [], []
    for b, n in enumerate(lens):
        s = int(cu[b])
        sl = slice(s, s + n)
        qq = q[sl].float().repeat_interleave(rep, 1)
        kk = k[sl].float().repeat_interleave(rep, 1)
        o, S = delta_rule_reference(qq, kk, v[sl].float(), gate[sl], beta[sl].float(), S0[b].clone())
        os.append(o)
        Ss.append(S)
    return torch.cat(os), torch.stack(Ss)


def _fla(cu, q, k, v, gate, beta, S0):
    """fla's chunked gated delta rule over the same sequences from states S0, final states out: a call -> (o [1, T,
    Hv, Dv], final states)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices

    ci = prepare_chunk_indices(cu, 64)
    return lambda: chunk_gated_delta_rule(q[None], k[None], v[None], gate[None], beta[None], initial_state=S0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                          chunk_indices=ci)


def fla_chain(cu, q, k, v, gate, beta, S0):
    """What fla itself takes at this shape (its inner states are bf16), GPU microseconds; or why it could not run."""
    try:
        return graph_us([_fla(cu, q, k, v, gate, beta, S0)])
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def fla_err(cu, q, k, v, gate, beta, S0, o_ref, S_ref):
    """How far fla's chain (bf16 operands for w, u and its per-chunk states) is from the float32 reference, measured as
    ours is: the largest difference relative to the reference's largest value (outputs, final states)."""
    try:
        o, S = _fla(cu, q, k, v, gate, beta, S0.clone())()
        return {"max_do_rel": (o[0].float() - o_ref).abs().max().item() / o_ref.abs().max().item(),
                "max_dS_rel": (S.float() - S_ref).abs().max().item() / S_ref.abs().max().item()}
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


GRAPH_TOKENS, GRAPH_SEQS = 4096, 48  # fla_in_graph's one graph: every mix's data replayed through it


def chunk_rows(cu: torch.Tensor, rows: int, chunk: int = 64) -> torch.Tensor:
    """fla's chunk_indices ([rows, 2]: sequence, chunk within it) built on the device with a fixed row count, so a
    CUDA graph holds it: the real chunks in order, then rows naming the last sequence, which must be empty (nothing
    of it is read or written). cu [N + 1] with cu[N - 1] == cu[N]."""
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk - 1) // chunk
    ends = nch.cumsum(0)
    r = torch.arange(rows, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(ends, r, right=True).clamp_(max=lens.numel() - 1)  # past the real chunks: the empty one
    j = r - (ends - nch)[seq]
    j = torch.where(r < ends[-1], j, torch.zeros_like(j))
    return torch.stack([seq, j], 1)


def fla_in_graph(mixes: dict) -> dict:
    """fla's chain in one CUDA graph of GRAPH_TOKENS tokens and GRAPH_SEQS sequences (plus an empty one), as the step
    graphs would hold it: the chunk indices built in the graph from `cu`, its tensor cache off (so the capture records
    what it memoises), the initial states gathered from where they lie (a copy in the graph) and the final states
    copied out. Captured once with the first mix, then every mix's data copied into its buffers and replayed: the
    output and final states against the float32 reference of that mix, and the replay's time. -> {mix: result}."""
    import fla.utils
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    T, N = GRAPH_TOKENS, GRAPH_SEQS + 1
    dev = "cuda"
    q = torch.zeros(T, HK, DK, device=dev, dtype=torch.bfloat16)
    k, v = torch.zeros_like(q), torch.zeros(T, HV, DV, device=dev, dtype=torch.bfloat16)
    gate = torch.zeros(T, HV, device=dev)
    beta = torch.zeros(T, HV, device=dev, dtype=torch.bfloat16)
    cu = torch.zeros(N + 1, device=dev, dtype=torch.long)
    src = torch.zeros(N, HV, DK, DV, device=dev)  # where the states lie (checkpoints, in the runner)
    S0 = torch.zeros_like(src)
    o_out, S_out = torch.zeros(T, HV, DV, device=dev, dtype=torch.bfloat16), torch.zeros_like(src)
    rows = T // 64 + N

    def call(gather: bool):
        if gather:
            S0.copy_(src)
        o, S = chunk_gated_delta_rule(q[None], k[None], v[None], gate[None], beta[None], initial_state=S0 if gather
                                      else src, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      chunk_indices=chunk_rows(cu, rows))
        o_out.copy_(o[0])
        S_out.copy_(S)

    def fill(lens, seed):
        cu_, q_, k_, v_, g_, b_, S_ = inputs(lens, seed)
        n = int(cu_[-1])
        for dst, x in ((q, q_), (k, k_), (v, v_), (gate, g_), (beta, b_)):
            dst.zero_()
            dst[:n].copy_(x)
        cu.fill_(n)
        cu[: len(lens) + 1].copy_(cu_)
        src.zero_()
        src[: len(lens)].copy_(S_)
        return cu_, q_, k_, v_, g_, b_, S_

    out: dict = {}
    try:
        graphs = {}
        fill(next(iter(mixes.values())), 1)
        for gather in (False, True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call(gather)  # compiling and autotuning, outside the capture
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graphs[gather] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[gather]):
                call(gather)
        for mix, lens in mixes.items():
            if sum(lens) > T or len(lens) > GRAPH_SEQS:
                continue
            data = fill(lens, 0)
            o_ref, S_ref = reference(lens, *data)
            n = sum(lens)
            r = {}
            for gather, g in graphs.items():
                o_out.zero_()
                S_out.zero_()
                g.replay()
                torch.cuda.synchronize()
                r["gather" if gather else "direct"] = {
                    "us": round(1000 * replay_median_ms(g), 2),
                    "max_do_rel": (o_out[:n].float() - o_ref).abs().max().item() / o_ref.abs().max().item(),
                    "max_dS_rel": (S_out[: len(lens)] - S_ref).abs().max().item() / S_ref.abs().max().item(),
                    "empty_state_untouched": bool((S_out[len(lens):] == src[len(lens):]).all())}
            out[mix] = r
    except Exception as e:  # noqa: BLE001 - that it fails is the result
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/delta_steps")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "shape": dict(Hk=HK, Hv=HV, Dk=DK, Dv=DV), "mixes": {}}
    for mix, lens in MIXES.items():
        t0 = time.perf_counter()
        cu, q, k, v, gate, beta, S0 = inputs(lens)
        lmax = max(lens)
        r: dict = {"lens": f"{lens[0]} + {len(lens) - 1} more" if len(lens) > 3 else lens}
        o_ref, S_ref = reference(lens, cu, q, k, v, gate, beta, S0)
        scale_o, scale_S = o_ref.abs().max().item(), S_ref.abs().max().item()

        def err():
            S = S0.clone()
            o = gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, lmax)
            return {"max_do_rel": (o.float() - o_ref).abs().max().item() / scale_o,
                    "max_dS_rel": (S - S_ref).abs().max().item() / scale_S}

        r["err"] = err()
        S = S0.clone()
        for bv, w in ((32, 4), (64, 4), (16, 4), (32, 8)):
            name = f"delta_v{bv}_w{w}_us"
            try:
                r[name] = graph_us([lambda: gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, lmax, block_v=bv,
                                                                   num_warps=w)])
            except Exception as e:  # noqa: BLE001 - one variant's failure is a result
                r[name] = f"{type(e).__name__}: {str(e)[:300]}"
        r["fla_chain_us"] = fla_chain(cu, q, k, v, gate, beta, S0)
        r["fla_err"] = fla_err(cu, q, k, v, gate, beta, S0, o_ref, S_ref)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        res["mixes"][mix] = r
        print("[delta]", mix, json.dumps(r), flush=True)
        (out / "delta_steps.json").write_text(json.dumps(res, indent=1))
    res["fla_in_graph"] = fla_in_graph(MIXES)
    print("[delta] fla in one graph", json.dumps(res["fla_in_graph"]), flush=True)
    (out / "delta_steps.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
