"""statecache.kernels.gdn.delta_chunk against kernels.delta_rule_reference, float32, within 1e-4.

Without CUDA the kernel runs in Triton's interpreter (tests.triton_interp sets TRITON_INTERPRET=1 before triton
and the module are imported); with CUDA it runs compiled, its dots in tf32x3 so that float32 tolerances hold.
Shapes stay small for the interpreter. Skipped when triton is not importable.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import CUDA, DEV, load

gdn = load("statecache.kernels.gdn", "_delta_chunk_kernel")

from statecache.kernels.dispatch import delta_rule_reference  # noqa: E402

if not CUDA:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.sum, InterpretedFunction):  # tl.sum, tl.cumsum: decorated when triton was imported
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
                    allow_module_level=True)

PREC = "tf32x3"  # for the GPU (float32 tolerances); the interpreter ignores it
TOL = dict(atol=1e-4, rtol=1e-4)


def make(L, Hk, Hv, Dk, Dv, seed=0, key_mean=0.0, beta_shift=0.0, g_scale=1.0):
    """Random inputs: q, k [L, Hk, Dk], v [L, Hv, Dv], g (negative), beta [L, Hv], S [Hv, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    if CUDA:  # delta_chunk refuses key slices under 64 wide for 33..64 tokens on CUDA (they faulted on an H200)
        Dk = max(Dk, 64)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = r(L, Hk, Dk), r(L, Hk, Dk) + key_mean, r(L, Hv, Dv)
    g = -F.softplus(r(L, Hv)) * g_scale
    beta = torch.sigmoid(r(L, Hv) + beta_shift)
    S = r(Hv, Dk, Dv)
    return [t.to(DEV) for t in (q, k, v, g, beta, S)]


def reference(q, k, v, g, beta, S):
    rep = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    return delta_rule_reference(q, k, v, g, beta, S)


def run(q, k, v, g, beta, S, **kw):
    S = S.clone()
    o = gdn.delta_chunk(q, k, v, g, beta, S, dot_precision=PREC, **kw)
    return o, S


@pytest.mark.parametrize("L, Hk, Hv, Dk, Dv, block_v, block_k", [
    (1, 2, 4, 16, 16, 16, 64),
    (7, 2, 4, 32, 32, 16, 16),  # several value and key slices
    (16, 2, 2, 16, 16, 32, 64),  # Hv == Hk
    (17, 1, 2, 32, 16, 16, 32),  # Dk != Dv
    (33, 2, 2, 32, 32, 32, 16),
    (64, 2, 4, 16, 32, 32, 16),
    (64, 1, 1, 32, 16, 16, 32),
])
def test_matches_reference(L, Hk, Hv, Dk, Dv, block_v, block_k):
    q, k, v, g, beta, S = make(L, Hk, Hv, Dk, Dv, seed=L)
    if CUDA and L > 32:  # see make(): CUDA refuses narrower key slices for 33..64 tokens
        block_k = max(block_k, 64)
    o, S_new = run(q, k, v, g, beta, S, block_v=block_v, block_k=block_k)
    o_ref, S_ref = reference(q, k, v, g, beta, S)
    assert o.dtype == v.dtype and o.shape == (L, Hv, Dv)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S_new, S_ref, **TOL)


def test_correlated_keys():
    """Keys at cosine ~0.5, beta near 1, weak decay: (I + A)^-1 is tame but the powers of A are huge, which
    breaks a Neumann-product solve; the block-doubling solve must stay at float32 accuracy."""
    q, k, v, g, beta, S = make(64, 1, 2, 32, 16, seed=3, key_mean=1.0, beta_shift=3.0, g_scale=0.01)
    o, S_new = run(q, k, v, g, beta, S)
    o_ref, S_ref = reference(q, k, v, g, beta, S)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S_new, S_ref, **TOL)


def test_padding_rows_leave_the_state():
    """Tokens past the real length come with g = 0 and beta = 0 (and arbitrary q, k, v)."""
    L, n = 40, 29
    q, k, v, g, beta, S = make(L, 2, 4, 16, 16, seed=5)
    g[n:], beta[n:] = 0.0, 0.0
    o, S_new = run(q, k, v, g, beta, S)
    o_ref, S_ref = reference(q[:n], k[:n], v[:n], g[:n], beta[:n], S)
    torch.testing.assert_close(o[:n], o_ref, **TOL)
    torch.testing.assert_close(S_new, S_ref, **TOL)


def test_store_state_false():
    q, k, v, g, beta, S = make(20, 2, 4, 16, 16, seed=7)
    S_kept = S.clone()
    o = gdn.delta_chunk(q, k, v, g, beta, S_kept, store_state=False, dot_precision=PREC)
    assert torch.equal(S_kept, S)
    torch.testing.assert_close(o, reference(q, k, v, g, beta, S)[0], **TOL)


def test_strided_views():
    """q, k, v split from one [L, C] projection, g and beta column slices, S one slot of a padded pool."""
    L, Hk, Hv, Dk, Dv = 24, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(L, 2 * Hk * Dk + Hv * Dv, generator=gen).to(DEV)
    q, k, v = torch.split(qkv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(L, Hk, Dk), k.reshape(L, Hk, Dk), v.reshape(L, Hv, Dv)
    gb = torch.randn(L, 3 * Hv, generator=gen).to(DEV)
    g, beta = -F.softplus(gb)[:, :Hv], torch.sigmoid(gb)[:, Hv:2 * Hv]
    pool = torch.randn(3, Hv, Dk, 2 * Dv, generator=gen).to(DEV)
    S = pool[1, :, :, :Dv]  # [Hv, Dk, Dv], not contiguous
    assert not (q.is_contiguous() or v.is_contiguous() or beta.is_contiguous() or S.is_contiguous())
    S0, pool0 = S.clone(), pool.clone()
    o = gdn.delta_chunk(q, k, v, g, beta, S, dot_precision=PREC)
    o_ref, S_ref = reference(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)
    pool0[1, :, :, :Dv] = pool[1, :, :, :Dv]
    assert torch.equal(pool, pool0)  # nothing written outside the view


@pytest.mark.parametrize("split", [(64, 23), (30, 40)])
def test_chained_chunks(split):
    """Two calls carrying the state equal the reference on the whole sequence (which chunks it by 64)."""
    a, b = split
    q, k, v, g, beta, S0 = make(a + b, 2, 4, 16, 16, seed=13)
    S = S0.clone()
    o1 = gdn.delta_chunk(q[:a], k[:a], v[:a], g[:a], beta[:a], S, dot_precision=PREC)
    o2 = gdn.delta_chunk(q[a:], k[a:], v[a:], g[a:], beta[a:], S, dot_precision=PREC)
    o_ref, S_ref = reference(q, k, v, g, beta, S0)
    torch.testing.assert_close(torch.cat([o1, o2]), o_ref, **TOL)
    torch.testing.assert_close(S, S_ref, **TOL)


def test_bf16_inputs():
    """bf16 q, k, v, beta (as in the model): the output comes back in bf16, the state stays float32."""
    q, k, v, g, beta, S = make(40, 2, 4, 32, 16, seed=17)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    o, S_new = run(q, k, v, g, beta, S)
    o_ref, S_ref = reference(q, k, v, g, beta, S)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), o_ref, atol=1e-2 * o_ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(S_new, S_ref, **TOL)


@pytest.mark.skipif(not CUDA, reason="the refusal is CUDA's")
def test_refuses_narrow_key_heads_for_long_chunks_on_cuda():
    q, k, v, g, beta, S = (t.to(DEV) for t in make(40, 2, 4, 64, 16))
    with pytest.raises(ValueError):
        gdn.delta_chunk(q[..., :32], k[..., :32], v, g, beta, S[:, :32].contiguous())
