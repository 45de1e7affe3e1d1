"""statecache.kernels.conv.conv_chunk against the generic chunk conv (TorchKernels.conv_into).

Without CUDA the kernel runs in Triton's interpreter (float32, within 1e-5); with CUDA, compiled, in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import CUDA, DEV, load

conv_triton = load("statecache.kernels.conv", "_conv_chunk_kernel")

from statecache.kernels.dispatch import TorchKernels  # noqa: E402

REF = TorchKernels()


def _case(L: int, C: int, W: int, real: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(L, C + 24, generator=g).to(DEV, dtype)  # x is a strided slice of a wider projection output
    x = big[:, 8 : 8 + C]
    w = torch.randn(C, W, generator=g).to(DEV, dtype)
    tail = torch.randn(W - 1, C, generator=g).to(DEV, dtype)
    return x, w, tail, torch.tensor(real, device=DEV)


@pytest.mark.parametrize("L,real", [(1, 1), (16, 16), (16, 5), (64, 64), (64, 2), (128, 100), (7, 3)])
@pytest.mark.parametrize("C", [48, 128])
def test_conv_chunk_matches_generic(L, real, C):
    x, w, tail, r = _case(L, C, 4, real)
    t_ref, t_ours = tail.clone(), tail.clone()
    y_ref = REF.conv_into(x, w, t_ref, r)
    y = conv_triton.conv_chunk(x, w, t_ours, r)
    tol = 2e-5 if CUDA else 1e-5
    assert (y - y_ref).abs().max().item() < tol
    assert torch.equal(t_ours, t_ref)  # the new tail: the last W - 1 real inputs, copied exactly


def test_conv_chunk_chains_like_one_sequence():
    """Two chunks through the saved tail equal one conv over the whole sequence (zeros before it)."""
    C, W = 40, 4
    x, w, _, _ = _case(24, C, W, 24, seed=3)
    tail = torch.zeros(W - 1, C, device=DEV)
    whole = REF.conv(x[None], w)[0]
    a = conv_triton.conv_chunk(x[:10], w, tail, torch.tensor(10, device=DEV))
    b = conv_triton.conv_chunk(x[10:], w, tail, torch.tensor(14, device=DEV))
    assert (torch.cat([a, b]) - whole).abs().max().item() < 2e-5


@pytest.mark.skipif(not CUDA, reason="bf16 on the GPU")
def test_conv_chunk_bf16():
    x, w, tail, r = _case(64, 8192, 4, 50, torch.bfloat16)
    t_ref, t_ours = tail.float(), tail.clone()  # the reference in float32 from the same bf16 values
    y_ref = REF.conv_into(x.float(), w.float(), t_ref, r)
    y = conv_triton.conv_chunk(x, w, t_ours, r)
    assert bool(((y.float() - y_ref).abs() <= 8e-3 * y_ref.abs() + 1e-3).all())  # only the output's rounding differs
    assert torch.equal(t_ours.float(), t_ref)


def test_conv_chunk_refuses_long_chunks():
    x, w, tail, r = _case(conv_triton.MAX_ROWS + 1, 16, 4, 1)
    with pytest.raises(ValueError):
        conv_triton.conv_chunk(x, w, tail, r)
