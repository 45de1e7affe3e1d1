"""GPU check of the batched delta rule (`gdn_triton.delta_batch`) on step-like mixes at the 9B GDN shape (16 key heads,
32 value heads, 128 x 128 state per head, bf16 inputs, float32 states), in its two forms over their launch knobs:
the one-kernel form (a program per value head, value slice and sequence runs its sequence's 64-token chunks one after
another, each chunk's triangular solve included) and the split form (every chunk's solve and query scores at once,
then a lighter pass per sequence), beside fla's chain of chunked kernels on the same sequences and states (what a
chunk-parallel form can reach; its precision with bf16 operands is `fla_err`). Each timing is the median replay of a
CUDA graph holding one call (microseconds); each mix also reports how far each form's outputs and final states are
from a float32 reference of the same inputs (`kernels.delta_rule_reference`, sequence by sequence), so that speed is
never bought with precision. (fla's whole rule in one step-sized graph was measured in s49_run3 and stays out:
bench/README.md.)

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

from gpu_timing import graph_us  # noqa: E402

from statecache.kernels import gdn as gdn_triton  # noqa: E402
from statecache.kernels.dispatch import delta_rule_reference  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
MIXES = {  # name: sequence lengths in one call (a step: new-page chunks and hits' questions)
    "page2048": [2048],
    "page1024+16hits": [1024] + [64] * 16,
    "pages1536+512": [1536, 512],
    "page1024+48hits32": [1024] + [32] * 48,
    "4pages256+32hits": [256] * 4 + [48] * 32,
    "3pages512+8hits": [512] * 3 + [60] * 8,  # a 16-agent step (s49: ~1,800 tokens in ~7 pieces of at most 512)
    "16hits48": [48] * 16,
    "hit40": [40],
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

        def err(split):
            S = S0.clone()
            o = gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, lmax, split=split)
            return {"max_do_rel": (o.float() - o_ref).abs().max().item() / scale_o,
                    "max_dS_rel": (S - S_ref).abs().max().item() / scale_S}

        r["err"] = err(False)
        r["split_err"] = err(True)
        S = S0.clone()
        for split in (False, True):
            for bv, w in ((32, 4), (64, 4), (16, 4), (32, 8)):
                name = f"{'split' if split else 'delta'}_v{bv}_w{w}_us"
                try:
                    r[name] = graph_us([lambda: gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, lmax, block_v=bv,
                                                                       num_warps=w, split=split)])
                except Exception as e:  # noqa: BLE001 - one variant's failure is a result
                    r[name] = f"{type(e).__name__}: {str(e)[:300]}"
        r["fla_chain_us"] = fla_chain(cu, q, k, v, gate, beta, S0)
        r["fla_err"] = fla_err(cu, q, k, v, gate, beta, S0, o_ref, S_ref)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        res["mixes"][mix] = r
        print("[delta]", mix, json.dumps(r), flush=True)
        (out / "delta_steps.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
