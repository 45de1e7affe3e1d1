"""The batched Triton kernels (conv_triton.conv_batch, gdn_triton.delta_batch, span_triton.attend_batch) against the
one-sequence torch reference run sequence by sequence (statecache.run.batch.BatchKernels' eager loop).

Without CUDA they run in Triton's interpreter, float32. Cases: sequences of different lengths (1 token, more than
one 64-token delta piece, empty padding sequences), tokens of no sequence at the end, grouped heads, cached keys
in separate buffers (groups) at arbitrary addresses, starts off the key tile.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import CUDA, DEV, load

conv_triton = load("statecache.kernels.conv", "_conv_chunk_kernel")
gdn_triton = load("statecache.kernels.gdn", "_delta_chunk_kernel")
span_triton = load("statecache.kernels.span", "_span_batch_kernel")

from statecache.kernels.dispatch import TorchKernels  # noqa: E402
from statecache.run.batch import BatchKernels, BatchKV  # noqa: E402

TOL = 2e-3 if CUDA else 2e-5
REF = BatchKernels(TorchKernels(), triton=False)


def _cu(lens, pad_tokens=0):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.long, device=DEV), cu[-1] + pad_tokens


LENS = [pytest.param([5, 1, 17], 0, id="three"), pytest.param([3, 0, 9, 0], 6, id="empty-and-orphans"),
        pytest.param([70, 2], 3, id="over-one-piece"), pytest.param([150, 3, 130], 2, id="over-two-conv-blocks")]


@pytest.mark.parametrize("lens,pad", LENS)
def test_conv_batch(lens, pad):
    g = torch.Generator().manual_seed(1)
    cu, T = _cu(lens, pad)
    C, W = 40, 4
    x = torch.randn(T, C + 8, generator=g)[:, 4 : 4 + C].to(DEV)  # a strided view, as the projection split gives
    w = torch.randn(C, W, generator=g).to(DEV)
    tails = torch.randn(len(lens), W - 1, C, generator=g).to(DEV)
    ref_tails = tails.clone()
    y = conv_triton.conv_batch(x, w, tails, cu, max(lens))
    ref = REF.conv(x, w, ref_tails, cu, max(lens), lens)
    assert (y - ref).abs().max().item() < TOL
    assert (tails - ref_tails).abs().max().item() == 0
    assert y[cu[-1]:].abs().max().item() == 0 if pad else True


@pytest.mark.parametrize("lens,pad", LENS)
@pytest.mark.parametrize("Hk,Hv", [(2, 4), (2, 2)])
def test_delta_batch(lens, pad, Hk, Hv):
    g = torch.Generator().manual_seed(2)
    cu, T = _cu(lens, pad)
    Dk, Dv = (64 if CUDA else 16), 32  # on CUDA 33..64-token launches need 64-wide key slices (delta_batch refuses less)
    q, k = (torch.randn(T, Hk, Dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(T, Hv, Dv, generator=g).to(DEV)
    gate = (-torch.rand(T, Hv, generator=g) * 0.5).to(DEV)
    beta = torch.rand(T, Hv, generator=g).to(DEV)
    S = torch.randn(len(lens), Hv, Dk, Dv, generator=g).to(DEV)
    S_ref = S.clone()
    o = gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, max(lens), dot_precision="ieee")
    ref = REF.delta(q, k, v, gate, beta, S_ref, cu, max(lens), lens)
    assert (o - ref).abs().max().item() < TOL
    assert (S - S_ref).abs().max().item() < TOL
    if pad:
        assert o[cu[-1]:].abs().max().item() == 0


def test_delta_batch_snapshots():
    """States kept inside sequences (at any position, in any slot order: the chunks are cut there) equal the state of
    a run over the sequence's first tokens only; sequences without snapshots are as without them, the outputs and
    final states of the others as without them within rounding; the eager loop's snapshots agree."""
    from statecache.run.batch import Snaps

    g = torch.Generator().manual_seed(5)
    lens, Hk, Hv = [200, 70, 5, 128], 2, 4
    cu, T = _cu(lens, 3)
    Dk, Dv = (64 if CUDA else 16), 32
    q, k = (torch.randn(T, Hk, Dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(T, Hv, Dv, generator=g).to(DEV)
    gate = (-torch.rand(T, Hv, generator=g) * 0.5).to(DEV)
    beta = torch.rand(T, Hv, generator=g).to(DEV)
    S0 = torch.randn(len(lens), Hv, Dk, Dv, generator=g).to(DEV)
    host = [[(192, 3), (37, 0), (130, 4)], [(64, 1)], [], [(3, 2)]]  # (offset, slot) per sequence
    at = torch.zeros(len(lens), 3, 2, dtype=torch.long)
    at[:, :, 1] = -1
    for b, mine in enumerate(host):
        for m, (c, slot) in enumerate(mine):
            at[b, m] = torch.tensor([c, slot])
    snap = torch.full((6, Hv, Dk, Dv), 7.0, device=DEV)
    S = S0.clone()
    o = gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, max(lens), snap=snap, snap_at=at.to(DEV),
                               dot_precision="ieee")
    S_plain = S0.clone()
    o_plain = gdn_triton.delta_batch(q, k, v, gate, beta, S_plain, cu, max(lens), dot_precision="ieee")
    assert (o - o_plain).abs().max().item() < TOL and (S - S_plain).abs().max().item() < TOL
    plain = slice(int(cu[2]), int(cu[3]))  # the sequence without snapshots: run exactly as without them
    assert (o[plain] - o_plain[plain]).abs().max().item() == 0 and (S[2] - S_plain[2]).abs().max().item() == 0
    ref_snap, S_ref = snap.clone(), S0.clone()
    ref = REF.delta(q, k, v, gate, beta, S_ref, cu, max(lens), lens, (ref_snap, Snaps(at, torch.zeros(1), host)))
    assert (o - ref).abs().max().item() < TOL and (S - S_ref).abs().max().item() < TOL
    for b, mine in enumerate(host):
        for c, slot in mine:
            want = S0[b : b + 1].clone()  # the state after the sequence's first c tokens, run on their own
            s0 = int(cu[b])
            REF.delta(q[s0 : s0 + c], k[s0 : s0 + c], v[s0 : s0 + c], gate[s0 : s0 + c], beta[s0 : s0 + c], want,
                      torch.tensor([0, c]), c, [c])
            assert (snap[slot] - want[0]).abs().max().item() < TOL, (b, c)
            assert (ref_snap[slot] - want[0]).abs().max().item() < TOL, (b, c)
    assert (snap[5] == 7.0).all()  # a slot nobody asked for is left alone


def _sourced_inputs(lens, pad, seed):
    """Delta-rule inputs of packed sequences of these lengths, each sequence's state in a tensor of its own (`own`),
    slots S filled with 5.0 and the element offsets `off` of each state from its slot."""
    g = torch.Generator().manual_seed(seed)
    cu, T = _cu(lens, pad)
    B, Hk, Hv = len(lens), 2, 4
    Dk, Dv = (64 if CUDA else 16), 32
    q, k = (torch.randn(T, Hk, Dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(T, Hv, Dv, generator=g).to(DEV)
    gate = (-torch.rand(T, Hv, generator=g) * 0.5).to(DEV)
    beta = torch.rand(T, Hv, generator=g).to(DEV)
    own = [torch.randn(Hv, Dk, Dv, generator=g).to(DEV) for _ in range(B)]  # each sequence's state, anywhere
    S = torch.full((B, Hv, Dk, Dv), 5.0, device=DEV)
    es = S.element_size()
    off = torch.tensor([(own[b].data_ptr() - S[b].data_ptr()) // es for b in range(B)], dtype=torch.long, device=DEV)
    assert (off % 16 == 0).all()
    return cu, T, B, (q, k, v, gate, beta), own, S, off


@pytest.mark.parametrize("lens,pad", LENS)
def test_delta_batch_sources(lens, pad):
    """Sequences continuing from states in their own tensors (src_off: nothing copied into the slots first) give what
    the same states copied into the slots give; keep=0 leaves a slot's final state unwritten (a sequence longer than a
    chunk still writes the states between its chunks there), keep=1 writes it; snapshots are kept either way."""
    cu, T, B, (q, k, v, gate, beta), own, S, off = _sourced_inputs(lens, pad, 9)
    S_copy = torch.stack(own)
    o_copy = gdn_triton.delta_batch(q, k, v, gate, beta, S_copy, cu, max(lens), dot_precision="ieee")
    keep = torch.tensor([b % 2 for b in range(B)], dtype=torch.long, device=DEV)
    before = [x.clone() for x in own]
    o = gdn_triton.delta_batch(q, k, v, gate, beta, S, cu, max(lens), src_off=off, keep=keep, dot_precision="ieee")
    assert (o - o_copy).abs().max().item() < TOL
    for b, n in enumerate(lens):
        assert (own[b] - before[b]).abs().max().item() == 0  # the sources are only read
        if n == 0 or (not keep[b] and n <= 64):
            assert (S[b] == 5.0).all(), b  # nothing ran, or its one chunk's end state is not wanted
        elif keep[b]:
            assert (S[b] - S_copy[b]).abs().max().item() < TOL, b
        else:  # several chunks, final state not kept: the slot holds the state before its last chunk
            assert not (S[b] == 5.0).all() and (S[b] - S_copy[b]).abs().max().item() > TOL, b


# blocks of 16 on a GPU; 32 in the interpreter, whose time grows with programs and key tiles (35 -> 20 s for the two
# longest cases here): either way several row blocks and key tiles, none of them full
BLOCKS = dict(block_m=16, block_n=16) if CUDA else dict(block_m=32, block_n=32)


@pytest.mark.parametrize("lens,pad", LENS)
@pytest.mark.parametrize("kw", [dict(BLOCKS, n_splits=1), dict(BLOCKS, n_splits=3, min_split_keys=1)])
def test_attend_batch(lens, pad, kw):
    g = torch.Generator().manual_seed(3)
    cu, T = _cu(lens, pad)
    Hq, Hkv, D, A = 4, 2, 32, 2
    starts = [37, 0, 64, 5][: len(lens)]
    q = torch.randn(T, Hq, D, generator=g).to(DEV)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(DEV) for _ in range(2))
    groups = [(torch.randn(A, st + 3, Hkv, D, generator=g).to(DEV), torch.randn(A, st + 3, Hkv, D, generator=g).to(DEV))
              if st else (None, None) for st in starts]
    a = 1
    es = k.element_size()
    off = torch.tensor([[(K[a].data_ptr() - k.data_ptr()) // es, (V[a].data_ptr() - v.data_ptr()) // es] if K is not None
                        else [0, 0] for K, V in groups], dtype=torch.long, device=DEV)
    st = torch.tensor(starts, dtype=torch.long, device=DEV)
    o = span_triton.attend_batch(q, k, v, cu, st, off, max(lens), D**-0.5, **kw)
    ref = REF.attend(a, q, k, v, cu, st, BatchKV(groups, None, None, None), max(lens), D**-0.5, lens)
    assert (o - ref).abs().max().item() < TOL
    if pad:
        assert o[cu[-1]:].abs().max().item() == 0
