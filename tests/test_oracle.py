"""statecache's forward against transformers' own Qwen3.5 (float32, CPU): answers within 1e-4.

Six tiny random checkpoints (tests.oracle_util.CONFIGS: both layouts, tied and untied in each, sharded ones, GQA and
GVA ratios, linear key dim != value dim, partial rotary 0.25 / 0.5 / 1.0, mrope fields) with every parameter
perturbed, and the built-in tiny model with its tokenizer's letter ids, each built once per module. Three of our
paths answer rows, compared with the softmax over transformers' full logits at the slots, restricted to the first
nopts letters:
1. the plain packed path (several rows of different lengths in one cu_seqlens forward);
2. the chunked continuation from a reset state, chunks of their real lengths (pad=False);
3. the same with chunk lengths bucketed and padding masked (pad=True), chunk boundaries off multiples of 64.
Also: rows continuing from checkpoints a packed forward planted (statecache.plant); a conditional checkpoint whose
two tie_word_embeddings flags disagree is read as transformers reads it (by the top-level one); and the delta rule
itself against transformers' chunked and recurrent torch implementations (1e-5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from statecache.checkpoints import hf_qwen3_5, load_reference, make_checkpoint
from statecache.kernels import TorchKernels, delta_rule_reference
from statecache.loader import load_weights
from statecache.model import Qwen35
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner
from tests.oracle_util import CONFIGS, LETTERS, VOCAB, Reference, build_checkpoint, max_abs_diff, random_ids

TOL = 1e-4  # answers (probabilities), float32 on the CPU
DELTA_TOL = 1e-5  # the delta rule's outputs and final state


@dataclass
class Case:
    name: str
    dir: Path
    ref: Reference
    model: Qwen35


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: torch's intra-op threads only spin against each other (and against other test processes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=[*CONFIGS, "tiny"])
def case(request, tmp_path_factory) -> Case:
    """One checkpoint of tests.oracle_util.CONFIGS, or the built-in tiny model with its tokenizer's letter ids."""
    name = request.param
    if name == "tiny":
        from transformers import AutoTokenizer

        from statecache import tiny

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STATECACHE_HOME", str(tmp_path_factory.mktemp("home")))
            path = tiny.tiny_model_dir()
        letters = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    else:
        path = build_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", name, seed=list(CONFIGS).index(name))
        letters = LETTERS
    ref = Reference(load_reference(path), list(letters))
    return Case(name, path, ref, Qwen35(load_weights(path, letters, "cpu", torch.float32)))


def test_reference_is_the_layouts_transformers_class(case):
    layout, _, fields = CONFIGS.get(case.name, ("causal", None, dict(tie_word_embeddings=False)))
    want = "Qwen3_5ForCausalLM" if layout == "causal" else "Qwen3_5ForConditionalGeneration"
    assert type(case.ref.model).__name__ == want
    # the checkpoint's shape reached our model: at least one attention layer, one GDN layer
    assert case.model.cfg.full_layers and case.model.cfg.linear_layers
    assert case.model.cfg.tie_word_embeddings == fields["tie_word_embeddings"]


# (length, slots, nopts): slots anywhere, position 0 and the last token included; nopts 2..26
PLAIN_ROWS = [
    (150, [0, 63, 64, 149], [2, 26, 9, 5]),
    (1, [0], [3]),
    (37, [5, 36], [26, 4]),
    (70, [69], [13]),
    (3, [0, 1, 2], [2, 7, 26]),
    (129, [128, 100], [11, 2]),
]


def _rows(seed: int, vocab: int):
    return [(random_ids(n, seed * 100 + i, vocab), slots, nopts) for i, (n, slots, nopts) in enumerate(PLAIN_ROWS)]


def test_plain_single_padded_rows_match_transformers(case):
    """A lone row zero-padded to a bucket (the GPU's graph form; here eager on the CPU) answers as transformers."""
    rows = _rows(2, case.model.cfg.vocab_size)
    plain = PlainPath(case.model, TorchKernels(), pad=True, bucket=48)
    for row in rows:
        T, S = plain.shape(len(row[0]), len(row[1]))
        assert T % 48 == 0 and T >= len(row[0]) and S >= len(row[1])
        got = plain.forward([row])[0]
        d = max_abs_diff(got, case.ref.answers(*row))
        assert d < TOL, f"{case.name}: padded single row (len {len(row[0])} -> {T}): max |diff| {d:.2e}"
    many = [(random_ids(20, 7, case.model.cfg.vocab_size), list(range(20)), [3] * 20)]  # more slots than any bucket
    assert plain.shape(20, 20) is not None and plain.shape(20, 65) is None
    assert max_abs_diff(plain.forward(many)[0], case.ref.answers(*many[0])) < TOL


@pytest.mark.parametrize("max_tokens", [16384, 160])
def test_plain_packed_path_matches_transformers(case, max_tokens):
    rows = _rows(1, case.model.cfg.vocab_size)
    plain = PlainPath(case.model, TorchKernels(), max_tokens=max_tokens)
    if max_tokens == 16384:
        assert len(plain.batches([len(r[0]) for r in rows])) == 1  # all rows in one packed forward
    else:
        assert len(plain.batches([len(r[0]) for r in rows])) > 1
    ours = plain.forward(rows)
    assert len(ours) == len(rows)
    for k, (row, got) in enumerate(zip(rows, ours)):
        want = case.ref.answers(*row)
        d = max_abs_diff(got, want)
        assert d < TOL, f"{case.name}: plain path row {k} (len {len(row[0])}, slots {row[1]}): max |diff| {d:.2e}"
        for p, n in zip(got, row[2]):
            assert len(p) == n and abs(sum(p) - 1) < 1e-5


# chunk boundaries (a, b) of a row of N tokens: [0, a), [a, b), [b, N); none a multiple of 64 except where noted
N = 170
CHUNKINGS = [
    (37, 101),  # 37, 64 (across the absolute position 64), 69 tokens
    (70, 72),  # a 2-token middle chunk: fewer real tokens than the conv keeps (3)
    (1, 130),  # a 1-token first chunk
    (64, 150),  # 64-aligned first boundary, then 86 and 20 tokens
]


def _chunk_slots(s: int, e: int) -> tuple[list[int], list[int]]:
    """Answer slots in chunk [s, e): its first and last token, and one in between; nopts varied."""
    slots = sorted({s, (s + e) // 2, e - 1})
    return slots, [2 + (7 * x) % 25 for x in slots]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("bounds", CHUNKINGS, ids=[f"{a}-{b}" for a, b in CHUNKINGS])
def test_chunked_continuation_matches_transformers(case, bounds, pad):
    ids = random_ids(N, 7, case.model.cfg.vocab_size)
    runner = ChunkRunner(case.model, TorchKernels(), max_pos=384, span_step=64, pad=pad)
    assert runner.pad == pad and not runner.use_graphs
    # another row first, so the buffers hold stale state, conv inputs and K/V the reset must not let through
    other = random_ids(200, 8, case.model.cfg.vocab_size)
    runner.st.reset()
    runner.run(other, 0, 200)

    runner.st.reset()
    edges = [0, *bounds, N]
    for s, e in zip(edges[:-1], edges[1:]):
        if pad:
            L, _ = runner.shape(s, e)
            assert L in runner.chunks and L >= e - s
        slots, nopts = _chunk_slots(s, e)
        out = runner.run(ids, s, e, slots, nopts)
        got = [out[k, :n].tolist() for k, n in enumerate(nopts)]
        want = case.ref.answers(ids, slots, nopts)
        d = max_abs_diff(got, want)
        assert d < TOL, (f"{case.name}: chunk [{s}, {e}) of chunking {edges} (pad={pad}), slots {slots}: "
                         f"max |diff| {d:.2e}")


def test_padded_state_equals_exact_state(case):
    """After the same chunks, the padded runner's saved state (S, conv inputs, K/V of real positions) is the exact
    runner's."""
    ids = random_ids(N, 9, case.model.cfg.vocab_size)
    states = []
    for pad in (False, True):
        runner = ChunkRunner(case.model, TorchKernels(), max_pos=384, span_step=64, pad=pad)
        runner.st.reset()
        for s, e in [(0, 37), (37, 39), (39, 101)]:
            runner.run(ids, s, e)
        states.append(runner.st)
    a, b = states
    for what, x, y in [("S", a.S, b.S), ("conv", a.conv, b.conv), ("K", a.K[:, :101], b.K[:, :101]),
                       ("V", a.V[:, :101], b.V[:, :101])]:
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4, msg=lambda m: f"{case.name}: padded {what}: {m}")


@pytest.mark.parametrize("top,inner", [(False, True), (True, False)], ids=["top-untied", "top-tied"])
def test_conditional_layout_ties_by_the_top_level_flag(tmp_path, top, inner):
    """Qwen3_5ForConditionalGeneration ties lm_head to the embeddings by the top-level tie_word_embeddings and
    ignores the one in text_config: a checkpoint whose two flags disagree answers as transformers reads it."""
    layout, _, fields = CONFIGS["cond_untied_gqa4"]
    path = make_checkpoint(tmp_path / "ckpt", layout=layout, seed=11, vocab_size=VOCAB,
                           **dict(fields, tie_word_embeddings=top))
    raw = json.loads((path / "config.json").read_text())
    assert raw["tie_word_embeddings"] == top
    raw["text_config"]["tie_word_embeddings"] = inner
    (path / "config.json").write_text(json.dumps(raw))
    ref = Reference.load(path)
    head, embed = ref.model.lm_head.weight, ref.model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == top  # transformers' reading
    model = Qwen35(load_weights(path, LETTERS, "cpu", torch.float32))
    row = (random_ids(90, 3), [0, 45, 89], [26, 3, 17])
    d = max_abs_diff(PlainPath(model, TorchKernels()).forward([row])[0], ref.answers(*row))
    assert d < TOL, f"top-level tie {top}, text_config tie {inner}: max |diff| {d:.2e}"


# ---- the delta rule against transformers' torch implementations -------------------------------------------------

def _hf():
    return hf_qwen3_5()  # fla hidden while it is imported: transformers' own torch functions


def _delta_inputs(T: int, Hk: int, Hv: int, Dk: int, Dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, Hk, Dk), r(T, Hk, Dk), r(T, Hv, Dv)
    A_log, dt_bias = r(Hv) * 0.5, r(Hv)
    g = -A_log.exp() * torch.nn.functional.softplus(r(T, Hv) + dt_bias)  # log decay <= 0, as the model makes it
    beta = torch.sigmoid(r(T, Hv))
    init = r(Hv, Dk, Dv) * 0.3
    return q, k, v, g, beta, init


def _repeat(x, rep):  # GVA as transformers does it: each key head serves `rep` consecutive value heads
    return x.repeat_interleave(rep, dim=1)


@pytest.mark.parametrize("T", [1, 63, 65, 150])
@pytest.mark.parametrize("with_init", [True, False], ids=["init", "zero"])
def test_delta_rule_matches_transformers(T, with_init):
    hf = _hf()
    Hk, Hv, Dk, Dv = 2, 4, 8, 12
    q, k, v, g, beta, init = _delta_inputs(T, Hk, Hv, Dk, Dv, seed=T)
    init = init if with_init else None
    o, S = delta_rule_reference(_repeat(q, Hv // Hk), _repeat(k, Hv // Hk), v, g, beta, init)
    assert o.shape == (T, Hv, Dv) and S.shape == (Hv, Dk, Dv)
    b = lambda x: None if x is None else x[None]  # noqa: E731
    for fn, kw in ((hf.torch_chunk_gated_delta_rule, dict(chunk_size=64)), (hf.torch_recurrent_gated_delta_rule, {})):
        ro, rS = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=b(init),
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        do, dS = (o - ro[0]).abs().max().item(), (S - rS[0]).abs().max().item()
        assert do < DELTA_TOL and dS < DELTA_TOL, \
            f"{fn.__name__} T={T}: output diff {do:.2e}, final state diff {dS:.2e}"


def test_torch_kernels_delta_varlen_matches_transformers():
    """TorchKernels.delta: two packed sequences (cu), each from its own initial state, GVA: as transformers does each
    sequence alone."""
    hf = _hf()
    Hk, Hv, Dk, Dv = 2, 4, 8, 12
    lens = [100, 37]
    seqs = [_delta_inputs(n, Hk, Hv, Dk, Dv, seed=10 + i) for i, n in enumerate(lens)]
    cat = [torch.cat([s[j] for s in seqs])[None] for j in range(5)]
    inits = torch.stack([s[5] for s in seqs])
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    o, S = TorchKernels().delta(*cat, inits, cu)
    start = 0
    for i, (n, (q, k, v, g, beta, init)) in enumerate(zip(lens, seqs)):
        ro, rS = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                 initial_state=init[None], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        assert (o[0, start:start + n] - ro[0]).abs().max() < DELTA_TOL, f"sequence {i} output"
        assert (S[i] - rS[0]).abs().max() < DELTA_TOL, f"sequence {i} final state"
        start += n


def test_delta_rule_padding_is_a_no_op():
    """g = 0, beta = 0 past the real end (the padded chunk's convention) leaves the final state at the real end."""
    Hk, Hv, Dk, Dv = 2, 4, 8, 12
    q, k, v, g, beta, init = _delta_inputs(90, Hk, Hv, Dk, Dv, seed=5)
    real = 53
    g2, beta2 = g.clone(), beta.clone()
    g2[real:], beta2[real:] = 0, 0
    o_pad, S_pad = delta_rule_reference(_repeat(q, 2), _repeat(k, 2), v, g2, beta2, init)
    o, S = delta_rule_reference(_repeat(q[:real], 2), _repeat(k[:real], 2), v[:real], g[:real], beta[:real], init)
    assert (S_pad - S).abs().max() < DELTA_TOL
    assert (o_pad[:real] - o).abs().max() < DELTA_TOL


@pytest.mark.parametrize("L,P,start,Hq,Hkv", [(16, 256, 100, 8, 2), (64, 512, 448, 4, 4), (5, 128, 0, 6, 3)])
def test_grouped_span_attention_matches_reference(L, P, start, Hq, Hkv):
    """The GPU's short-chunk attention (batched matmuls per KV head group) equals the masked SDPA reference."""
    from statecache.kernels import TorchKernels, attend_grouped

    g = torch.Generator().manual_seed(L + P)
    q = torch.randn(L, Hq, 32, generator=g)
    k, v = torch.randn(P, Hkv, 32, generator=g), torch.randn(P, Hkv, 32, generator=g)
    k[start + L :] = 1e4  # keys past the chunk hold garbage: they must be masked
    st = torch.tensor(start)
    ref = TorchKernels().attend_span(q, k, v, st, 32**-0.5)
    got = attend_grouped(q, k, v, st, 32**-0.5)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5)


def test_rows_continue_from_packed_planted_states_match_transformers(case):
    """A packed forward of two new states (and a row that plants nothing) leaves their checkpoints; rows continuing
    from them (the same state, a grown one, one changed in the middle) answer as transformers does."""
    from statecache.cache import CacheSettings, StateCache

    vocab = case.model.cfg.vocab_size
    runner = ChunkRunner(case.model, TorchKernels(), max_pos=512, span_step=64, pad=False)
    cache = StateCache(runner, CacheSettings(min_prefix=64, stride=128, tail=16, align=64))
    a, b = random_ids(200, 31, vocab), random_ids(330, 32, vocab)
    first = [(a + random_ids(9, 33, vocab), 200), (random_ids(50, 34, vocab), None),
             (b + random_ids(5, 35, vocab), 330)]
    rows = [(ids, [len(ids) - 1], [5]) for ids, _ in first]
    outs, planted = PlainPath(case.model, TorchKernels()).run(rows, [cache.plan(s) if s else None for _, s in first])
    outs = [probs for probs, _route in outs]
    for (ids, slots, nopts), got, (_, s), pl in zip(rows, outs, first, planted):
        assert max_abs_diff(got, case.ref.answers(ids, slots, nopts)) < TOL
        if s is not None:
            cache.plant_planted(ids, len(ids), pl.snaps(), pl.K, pl.V)
    mid = list(b)
    mid[150] = (mid[150] + 1) % vocab
    later = [(a + random_ids(12, 36, vocab), 200, "hit", 192), (a + random_ids(76, 37, vocab), 270, "partial", 192),
             (mid + random_ids(4, 38, vocab), 330, "partial", 128), (b + random_ids(20, 39, vocab), 330, "hit", 320)]
    for ids, state_len, path, reused in later:
        slots, nopts = [state_len, len(ids) - 1], [3, 7]
        ans = cache.row(ids, state_len, slots, nopts)
        assert (ans.path, ans.reused) == (path, reused)
        d = max_abs_diff(ans.probs, case.ref.answers(ids, slots, nopts))
        assert d < TOL, f"{case.name}: {path} from a packed planted state: max |diff| {d:.2e}"
