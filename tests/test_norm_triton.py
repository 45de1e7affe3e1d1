"""statecache.kernels.norm against the model's eager pieces (add_rmsnorm, silu_mul).

Without CUDA the kernels run in Triton's interpreter (float32); with CUDA, compiled, in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import CUDA, DEV, load

norm_triton = load("statecache.kernels.norm", "_add_rmsnorm_kernel")

from statecache.model import forward as model  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (7, 96), (64, 256)])
def test_add_rmsnorm_matches_eager(T, N, dtype):
    h, d = _rand(T, N, dtype=dtype, seed=1), _rand(T, N, dtype=dtype, seed=2)
    w1 = 1 + 0.1 * _rand(N, seed=3)
    h_ref, x_ref = model.add_rmsnorm(h, d, w1, 1e-6)
    h_out, x_out = norm_triton.add_rmsnorm(h, d, w1, 1e-6)
    assert h_out.dtype == h_ref.dtype and x_out.dtype == x_ref.dtype
    assert torch.equal(h_out, h_ref)  # one rounding of the same sum
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding step of the output at most
    assert (x_out.float() - x_ref.float()).abs().max().item() < tol


def test_add_rmsnorm_float32_residual():
    """A float32 residual stream (Qwen35(residual_fp32=True)) with model-dtype updates, strided inputs."""
    h, d = _rand(5, 64, seed=4), _rand(5, 80, seed=5)[:, 8:72]
    w1 = 1 + 0.1 * _rand(64, seed=6)
    h_ref, x_ref = model.add_rmsnorm(h, d, w1, 1e-6)
    h_out, x_out = norm_triton.add_rmsnorm(h, d, w1, 1e-6)
    assert (h_out - h_ref).abs().max().item() < 1e-6 and (x_out - x_ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 32), (9, 48), (64, 128)])
def test_silu_mul_matches_eager(T, I, dtype):
    gu = 3 * _rand(T, 2 * I, dtype=dtype, seed=7)
    ref = model.silu_mul(gu)
    out = norm_triton.silu_mul(gu)
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert out.shape == ref.shape and (out.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 4, 16), (9, 3, 32), (64, 8, 64)])
def test_gated_rmsnorm_matches_eager(T, H, D, dtype):
    x = _rand(T, H, D, dtype=dtype, seed=8)
    z = _rand(T, H * D + 40, dtype=dtype, seed=9)[:, 8 : 8 + H * D].reshape(T, H, D)  # a strided slice, as in the model
    w = (1 + 0.1 * _rand(D, seed=10)).to(dtype)
    ref = model.gated_rmsnorm(x, z, w, 1e-6)
    out = norm_triton.gated_rmsnorm(x, z, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == ref.dtype and (out.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
