"""statecache.kernels.span.attend_span against the torch reference (TorchKernels.attend_span).

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the module is imported), in
float32, within 1e-5. With CUDA: the compiled kernels, float32 (ieee dots) and bf16, and a CUDA-graph replay with
`start` changed between replays.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import CUDA, DEV, load

span_triton = load("statecache.kernels.span", "_span_split_kernel")

from statecache.kernels.dispatch import TorchKernels  # noqa: E402

TOL = 2e-4 if CUDA else 1e-5  # float32: exact-ish dots in the interpreter, ieee dots (other order) on the GPU
REF = TorchKernels()


def _case(L, P, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, Hq, D, generator=g)
    k, v = torch.randn(P, Hkv, D, generator=g), torch.randn(P, Hkv, D, generator=g)
    return q.to(DEV), k.to(DEV), v.to(DEV)


def _check(q, k, v, start: int, tol=TOL, **kw):
    st = torch.tensor(start, dtype=torch.long, device=q.device)
    scale = q.shape[-1] ** -0.5
    out = span_triton.attend_span(q, k, v, st, scale, **kw)
    ref = REF.attend_span(q.float(), k.float(), v.float(), st, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - ref).abs().max().item()
    assert err < tol, err
    return out


# (L, P, start, Hq, Hkv, D, kwargs): start = 0 and P - L, L off the row block, L = 1, P off the tile and split
# sizes, R = 1, 2, 4, one split (direct write), more splits than key tiles (empty splits), the default rule.
CASES = [
    (8, 8, 0, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=2, min_split_keys=1)),
    (16, 48, 32, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=3, min_split_keys=1)),
    (13, 45, 20, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=2, min_split_keys=1)),
    (1, 37, 36, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=3, min_split_keys=1)),
    (1, 37, 0, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=3, min_split_keys=1)),
    (5, 70, 30, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=1)),
    (5, 70, 30, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=16, min_split_keys=1)),
    (7, 90, 50, 2, 2, 32, dict(block_m=16, block_n=16, n_splits=4, min_split_keys=1)),
    (9, 75, 60, 8, 2, 64, dict(block_m=32, block_n=16, n_splits=3, min_split_keys=1)),
    (6, 100, 40, 8, 2, 32, dict(block_m=16, block_n=32, n_splits=5, min_split_keys=40)),
    (10, 60, 50, 4, 2, 32, dict(block_m=16, block_n=16)),
    (3, 130, 3, 4, 2, 32, dict(block_m=16, block_n=16, n_splits=4, min_split_keys=1)),
]


@pytest.mark.parametrize("L,P,start,Hq,Hkv,D,kw", CASES)
def test_matches_reference(L, P, start, Hq, Hkv, D, kw):
    q, k, v = _case(L, P, Hq, Hkv, D)
    _check(q, k, v, start, **kw)


@pytest.mark.parametrize("fill", [1e30, float("nan")])
def test_keys_past_the_chunk_are_never_read(fill):
    L, P, start, Hq, Hkv, D = 6, 80, 20, 4, 2, 32
    q, k, v = _case(L, P, Hq, Hkv, D, seed=1)
    kw = dict(block_m=16, block_n=16, n_splits=3, min_split_keys=1)
    clean = _check(q, k, v, start, **kw)
    kg, vg = k.clone(), v.clone()
    end = start + L
    if fill != fill:  # NaN
        kg[end:], vg[end:] = fill, fill
    else:
        g = torch.Generator().manual_seed(2)
        kg[end:] = fill * torch.randn(P - end, Hkv, D, generator=g).to(DEV)
        vg[end:] = fill * torch.randn(P - end, Hkv, D, generator=g).to(DEV)
    st = torch.tensor(start, device=DEV)
    dirty = span_triton.attend_span(q, kg, vg, st, D ** -0.5, **kw)
    assert torch.equal(dirty, clean)


def test_strided_views():
    """q a slice of a wider projection, k/v rows of a bigger [A, P_max, Hkv, D] buffer, v with D not innermost."""
    L, P, start, Hq, Hkv, D, A, P_max = 7, 50, 30, 4, 2, 32, 3, 64
    g = torch.Generator().manual_seed(3)
    proj = torch.randn(L, 3 * Hq * D, generator=g).to(DEV)
    q = proj[:, Hq * D:2 * Hq * D].view(L, Hq, D)
    Kb = torch.randn(A, P_max, Hkv, D, generator=g).to(DEV)
    Vb = torch.randn(A, P_max, D, Hkv, generator=g).to(DEV).transpose(2, 3)  # [A, P_max, Hkv, D], d-stride Hkv
    k, v = Kb[1, :P], Vb[2, :P]
    assert k.storage_offset() > 0 and not (q.is_contiguous() or v.is_contiguous())
    for kw in (dict(block_m=16, block_n=16, n_splits=3, min_split_keys=1), dict(block_m=16, block_n=16, n_splits=1)):
        _check(q, k, v, start, **kw)
    q2 = torch.randn(L, Hq, 2 * D, generator=g).to(DEV)[..., D:]  # head stride 2D
    _check(q2, k, v, start, block_m=16, block_n=16, n_splits=2, min_split_keys=1)


@pytest.mark.skipif(not CUDA, reason="compiled kernels need CUDA")
def test_bf16_9b_shape_and_graph_replay():
    L, P, Hq, Hkv, D = 64, 1024, 16, 4, 256
    q, k, v = (t.bfloat16() for t in _case(L, P, Hq, Hkv, D, seed=4))
    _check(q, k, v, 512, tol=2e-2)
    st = torch.tensor(0, dtype=torch.long, device=DEV)
    span_triton.attend_span(q, k, v, st, D ** -0.5)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = span_triton.attend_span(q, k, v, st, D ** -0.5)
    for start in (0, 300, P - L):
        st.fill_(start)
        graph.replay()
        ref = REF.attend_span(q.float(), k.float(), v.float(), st, D ** -0.5)
        assert (out.float() - ref).abs().max().item() < 2e-2
