"""statecache's forward against transformers' own Qwen3.5 (float32, CPU): answers within 1e-4.

Six tiny random checkpoints (tests.oracle_util.CONFIGS: both layouts, tied and untied in each, sharded ones, GQA and
GVA ratios, linear key dim != value dim, partial rotary 0.25 / 0.5 / 1.0, mrope fields) with every parameter
perturbed, and the built-in tiny model with its tokenizer's letter ids, each built once per module. Rows run through
the step loop (statecache.step.Steps over the batched runner, eager on the CPU: the engine's one runner) and are
compared with the softmax over transformers' full logits at the slots, restricted to the first nopts letters:
1. uncached (rows run fresh: no lookup, nothing planted): rows of different lengths packed in one step's forward, or
   spread over several steps by a small step budget; lone rows with the runner's shapes bucketed and the padding
   masked (pad=True); a question with more slots than a piece holds, cut at its slots (pieces off multiples of 64);
2. cached: a state growing chunk by chunk (plain while too short, cold, continued from its checkpoints, a hit with a
   new question), exact and padded runner, after another row left stale state in the runner's buffers; rows
   continuing from the checkpoints that several new states planted in one packed step (the same state, a grown one,
   one changed in the middle);
3. the engine over the tiny model: `Engine.uncached` (a split row included) and `Engine.answer` (cold, hit, partial).
Also: the padded step loop plants the exact one's checkpoints and K/V; a conditional checkpoint whose two
tie_word_embeddings flags disagree is read as transformers reads it (by the top-level one); and the delta rule
itself against transformers' chunked and recurrent torch implementations (1e-5).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from statecache.cache.config import CacheSettings
from statecache.dev.checkpoints import load_reference, make_checkpoint
from statecache.kernels.dispatch import TorchKernels, delta_rule_reference
from statecache.model.forward import Qwen35
from statecache.model.hf import hf_qwen3_5
from statecache.model.loader import load_weights
from statecache.run.batch import BatchRunner
from statecache.step import Steps
from tests.cache_util import make_steps, run_rows
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

        from statecache.dev import tiny

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


def steps_over(model: Qwen35, pad: bool = False, budget: int = 1024, **settings) -> Steps:
    """The step loop over `model` (tests.cache_util.make_steps with its own runner: eager; pad: shapes bucketed,
    padding masked)."""
    runner = BatchRunner(model, TorchKernels(), max_slots=4, max_batch=16, max_pos=1024, pad=pad)
    return make_steps(runner=runner, budget_tokens=budget, **settings)


def uncached(steps: Steps, rows) -> list:
    """Rows (ids, slots, nopts) run fresh through `steps` (from nothing, no lookup, nothing planted) -> Answers."""
    return run_rows(steps, [(ids, 0, slots, nopts) for ids, slots, nopts in rows], fresh=True)


@pytest.mark.parametrize("budget", [1024, 160])
def test_uncached_packed_rows_match_transformers(case, budget):
    """Rows of different lengths run fresh through the step loop: with a step budget that holds them all, packed
    in one forward; with a small budget, spread over several steps."""
    rows = _rows(1, case.model.cfg.vocab_size)
    steps = steps_over(case.model, budget=budget)
    ours = uncached(steps, rows)
    assert len(ours) == len(rows)
    if budget == 1024:
        assert steps.stats["steps"] == steps.runner.stats["forwards"] == 1, steps.stats
        assert steps.runner.stats["sequences"] == len(rows)  # all six in one forward
    else:
        assert steps.stats["steps"] > 2, steps.stats
    for k, (row, ans) in enumerate(zip(rows, ours)):
        assert ans.path == "plain" and ans.reused == 0
        d = max_abs_diff(ans.probs, case.ref.answers(*row))
        assert d < TOL, f"{case.name}: uncached row {k} (len {len(row[0])}, slots {row[1]}): max |diff| {d:.2e}"
        for p, n in zip(ans.probs, row[2]):
            assert len(p) == n and abs(sum(p) - 1) < 1e-5
    assert len(steps.cache.index) == 0  # fresh rows plant nothing


def test_uncached_lone_padded_rows_match_transformers(case):
    """A lone row through a padded runner (its forward's tokens bucketed, the padding masked: the GPU's graph form,
    here eager on the CPU) answers as transformers; so does a question with more slots than a piece holds, cut at
    its slots into pieces that continue each other's state from positions off multiples of 64."""
    rows = _rows(2, case.model.cfg.vocab_size)
    steps = steps_over(case.model, pad=True)
    runner = steps.runner
    assert runner.pad and not runner.use_graphs
    assert [runner.shape(1, len(r[0]))[1] for r in rows] == [192, 64, 64, 128, 64, 192]  # every one padded
    for row in rows:
        forwards = runner.stats["forwards"]
        (ans,) = uncached(steps, [row])
        d = max_abs_diff(ans.probs, case.ref.answers(*row))
        assert d < TOL, f"{case.name}: lone padded row (len {len(row[0])}): max |diff| {d:.2e}"
        assert runner.stats["forwards"] - forwards == 1
    many = (random_ids(20, 7, case.model.cfg.vocab_size), list(range(20)), [3] * 20)  # 20 slots, 4 a piece
    pieces = steps.stats["pieces"]
    (ans,) = uncached(steps, [many])
    assert steps.stats["pieces"] - pieces == 5
    assert max_abs_diff(ans.probs, case.ref.answers(*many)) < TOL


# chunk edges (a, b) of a row of N tokens: [0, a), [a, b), [b, N); none a multiple of 64 except where noted
N = 170
CHUNKINGS = [
    (37, 101),  # 37, 64 (across the absolute position 64), 69 tokens
    (70, 72),  # a 2-token middle chunk: fewer real tokens than the conv keeps (3)
    (1, 130),  # a 1-token first chunk
    (64, 150),  # 64-aligned first edge, then 86 and 20 tokens
]
# per chunking, (path, tokens reused) of the rows whose state ends at each edge (state_len a, then b; checkpoints
# at p = state_len, and at p - 16 and the multiples of the stride 128 below it aligned down to 64, each at least 16
# from p and from the position restored), then of a hit with a new question on the state of b tokens
CHUNK_PATHS = {
    (37, 101): [("plain", 0), ("plain", 0), ("cold", 0), ("hit", 101)],
    (70, 72): [("plain", 0), ("cold", 0), ("partial", 70), ("partial", 70)],  # 72: too near 70 to plant
    (1, 130): [("plain", 0), ("plain", 0), ("cold", 0), ("hit", 130)],
    (64, 150): [("plain", 0), ("cold", 0), ("partial", 64), ("hit", 150)],
}


def _chunk_slots(s: int, e: int) -> tuple[list[int], list[int]]:
    """Answer slots in chunk [s, e): its first and last token, and one in between; nopts varied."""
    slots = sorted({s, (s + e) // 2, e - 1})
    return slots, [2 + (7 * x) % 25 for x in slots]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("bounds", CHUNKINGS, ids=[f"{a}-{b}" for a, b in CHUNKINGS])
def test_growing_state_through_the_step_loop_matches_transformers(case, bounds, pad):
    """A state that grows chunk by chunk, each row asking about its newest chunk (state [0, s), question [s, e)):
    plain while too short to cache, then cold, then continued from the checkpoints the earlier rows planted (the
    question's piece starting at the checkpoint and running to the row's end, of its real length or padded); then
    a hit with a new question; then the whole row uncached with every chunk's slots (cut at its slots into pieces).
    Another row runs first, so the runner's buffers hold stale state, conv inputs and K/V."""
    vocab = case.model.cfg.vocab_size
    ids = random_ids(N, 7, vocab)
    steps = steps_over(case.model, pad=pad)
    assert steps.runner.pad == pad
    assert run_rows(steps, [(random_ids(200, 8, vocab), 190, [199], [5])])[0].path == "cold"
    edges = [0, *bounds, N]
    got, all_slots, all_nopts = [], [], []
    for s, e in zip(edges[:-1], edges[1:]):
        slots, nopts = _chunk_slots(s, e)
        (ans,) = run_rows(steps, [(ids[:e], s, slots, nopts)])
        d = max_abs_diff(ans.probs, case.ref.answers(ids, slots, nopts))  # causal: the full row's logits serve
        assert d < TOL, (f"{case.name}: chunk [{s}, {e}) of edges {edges} (pad={pad}), {ans.path} from "
                         f"{ans.reused}, slots {slots}: max |diff| {d:.2e}")
        got.append((ans.path, ans.reused))
        all_slots += slots
        all_nopts += nopts
    b = bounds[1]
    asked = ids[:b] + random_ids(30, 9, vocab)
    slots, nopts = [b, b + 29], [4, 26]
    (ans,) = run_rows(steps, [(asked, b, slots, nopts)])
    got.append((ans.path, ans.reused))
    d = max_abs_diff(ans.probs, case.ref.answers(asked, slots, nopts))
    assert d < TOL, f"{case.name}: a hit on the state of {b} tokens (pad={pad}): max |diff| {d:.2e}"
    assert got == CHUNK_PATHS[bounds]
    pieces = steps.stats["pieces"]
    (ans,) = uncached(steps, [(ids, all_slots, all_nopts)])
    assert steps.stats["pieces"] - pieces == -(-len(all_slots) // 4)  # 8 or 9 slots, 4 a piece
    d = max_abs_diff(ans.probs, case.ref.answers(ids, all_slots, all_nopts))
    assert d < TOL, f"{case.name}: the whole row uncached, slots {all_slots} (pad={pad}): max |diff| {d:.2e}"


def test_padded_step_loop_plants_the_exact_states(case):
    """After the same rows (a cold state, then a grown one continuing from its checkpoint), the padded step loop's
    checkpoints (GDN states, conv tails) and group K/V are the exact one's, at the same positions."""
    ids = random_ids(N, 9, case.model.cfg.vocab_size)
    rows = [(ids[:101], 70, [100], [5]), (ids, 150, [169], [7])]
    planted = []
    for pad in (False, True):
        steps = steps_over(case.model, pad=pad)
        got = [run_rows(steps, [row])[0] for row in rows]
        assert [(a.path, a.reused) for a in got] == [("cold", 0), ("partial", 70)]
        for row, a in zip(rows, got):
            assert max_abs_diff(a.probs, case.ref.answers(row[0], row[2], row[3])) < TOL
        planted.append({c.pos: c for c in steps.cache.index.lru_order()})
    exact, padded = planted
    assert sorted(exact) == sorted(padded) == [70, 128, 150]
    for pos, c in exact.items():
        p = padded[pos]
        for what, x, y in [("conv", c.payload[0], p.payload[0]), ("S", c.payload[1], p.payload[1]),
                           ("K", c.group.payload[0], p.group.payload[0]), ("V", c.group.payload[1], p.group.payload[1])]:
            assert x.shape == y.shape
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{case.name}: padded {what} at {pos}: {m}")


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
    d = max_abs_diff(uncached(steps_over(model), [row])[0].probs, ref.answers(*row))
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


def _packed_delta_inputs(lens, seed: int, Hk=2, Hv=4, Dk=8, Dv=12):
    """Sequences of `lens` tokens (GVA), each its own (q, k, v, g, beta, init), and the same packed for a kernels
    object's `delta`: (seqs, [q, k, v, g, beta] each [1, T, ...], inits [B, Hv, Dk, Dv], cu int32)."""
    seqs = [_delta_inputs(n, Hk, Hv, Dk, Dv, seed=seed + i) for i, n in enumerate(lens)]
    cat = [torch.cat([s[j] for s in seqs])[None] for j in range(5)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, cat, torch.stack([s[5] for s in seqs]), cu


def test_torch_kernels_delta_varlen_matches_transformers():
    """TorchKernels.delta: two packed sequences (cu), each from its own initial state, GVA: as transformers does each
    sequence alone."""
    hf = _hf()
    lens = [100, 37]
    seqs, cat, inits, cu = _packed_delta_inputs(lens, seed=10)
    o, S = TorchKernels().delta(*cat, inits, cu)
    start = 0
    for i, (n, (q, k, v, g, beta, init)) in enumerate(zip(lens, seqs)):
        ro, rS = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                 initial_state=init[None], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        assert (o[0, start:start + n] - ro[0]).abs().max() < DELTA_TOL, f"sequence {i} output"
        assert (S[i] - rS[0]).abs().max() < DELTA_TOL, f"sequence {i} final state"
        start += n


def test_cuda_kernels_build_without_fla_and_fall_back_to_torch(monkeypatch):
    """CudaKernels (the GPU's set) imports no fla to build: the step loop runs statecache's own Triton kernels, so a
    host without fla serves on them. Its whole-sequence conv and delta rule, fla's where it imports, are then the
    torch ones (CPU tensors here: the same numbers as TorchKernels)."""
    pytest.importorskip("triton")
    from statecache.kernels.dispatch import CudaKernels

    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    kernels = CudaKernels()
    lens = [50, 23]
    _, cat, inits, cu = _packed_delta_inputs(lens, seed=20)
    (o, S), (ro, rS) = kernels.delta(*cat, inits, cu), TorchKernels().delta(*cat, inits, cu)
    assert torch.equal(o, ro) and torch.equal(S, rS)
    x, w = torch.randn(1, sum(lens), 6), torch.randn(6, 4)
    assert torch.equal(kernels.conv(x, w, cu), TorchKernels().conv(x, w, cu))
    assert kernels._fla_ops() == ()


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
    from statecache.kernels.dispatch import TorchKernels, attend_grouped

    g = torch.Generator().manual_seed(L + P)
    q = torch.randn(L, Hq, 32, generator=g)
    k, v = torch.randn(P, Hkv, 32, generator=g), torch.randn(P, Hkv, 32, generator=g)
    k[start + L :] = 1e4  # keys past the chunk hold garbage: they must be masked
    st = torch.tensor(start)
    ref = TorchKernels().attend_span(q, k, v, st, 32**-0.5)
    got = attend_grouped(q, k, v, st, 32**-0.5)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-5)


def test_rows_continue_from_states_planted_in_one_packed_step_match_transformers(case):
    """Two new states (and a row too short to cache) in one step's packed forward plant their checkpoints; rows
    continuing from them (the same state, a grown one, one changed in the middle) answer as transformers does."""
    vocab = case.model.cfg.vocab_size
    steps = steps_over(case.model)
    a, b = random_ids(200, 31, vocab), random_ids(330, 32, vocab)
    first = [(a + random_ids(9, 33, vocab), 200), (random_ids(50, 34, vocab), 0), (b + random_ids(5, 35, vocab), 330)]
    rows = [(ids, s, [len(ids) - 1], [5]) for ids, s in first]
    outs = run_rows(steps, rows)
    assert [x.path for x in outs] == ["cold", "plain", "cold"]
    assert steps.runner.stats["sequences"] >= steps.runner.stats["forwards"] + 2  # the three shared a forward
    for (ids, _, slots, nopts), got in zip(rows, outs):
        assert max_abs_diff(got.probs, case.ref.answers(ids, slots, nopts)) < TOL
    # a: p 200 and its tail (184) aligned down, the stride's 128; b: p 330, its tail (314) aligned down, 256, and the
    # stride's 128
    assert sorted(c.pos for c in steps.cache.index.lru_order()) == [128, 128, 200, 256, 330]
    mid = list(b)
    mid[150] = (mid[150] + 1) % vocab
    later = [(a + random_ids(12, 36, vocab), 200, "hit", 200), (a + random_ids(76, 37, vocab), 270, "partial", 200),
             (mid + random_ids(4, 38, vocab), 330, "partial", 128), (b + random_ids(20, 39, vocab), 330, "hit", 330)]
    for ids, state_len, path, reused in later:
        slots, nopts = [state_len, len(ids) - 1], [3, 7]
        (ans,) = run_rows(steps, [(ids, state_len, slots, nopts)])
        assert (ans.path, ans.reused) == (path, reused)
        d = max_abs_diff(ans.probs, case.ref.answers(ids, slots, nopts))
        assert d < TOL, f"{case.name}: {path} from a state planted in a packed step: max |diff| {d:.2e}"


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """The engine over the built-in tiny model, and transformers' model of it with the tokenizer's letters."""
    from statecache.dev import tiny
    from statecache.engine import Engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STATECACHE_HOME", str(tmp_path_factory.mktemp("home")))
        path = tiny.tiny_model_dir()
    eng = Engine(path, device="cpu", dtype="float32",
                 settings=CacheSettings(mb=64, stride=128, tail=16, align=64, min_prefix=64, host_mb=0))
    return eng, Reference(load_reference(path), list(eng.letter_ids))


def test_engine_uncached_and_cached_answers_match_transformers(tiny_engine):
    """The engine's own step loop on the tiny model: `uncached` (rows of different lengths, one with six slots at
    one position, split into parts and joined) and `answer` (a new state cold, a hit with another question, a grown
    state partial from its checkpoint) answer as transformers."""
    eng, ref = tiny_engine
    vocab = eng.vocab_size
    rows = [{"ids": ids, "state_len": 0, "slots": slots, "nopts": nopts} for ids, slots, nopts in _rows(3, vocab)]
    ids = random_ids(40, 301, vocab)
    rows.append({"ids": ids, "state_len": 10, "slots": [39] * 6 + [20], "nopts": [2, 3, 4, 5, 6, 26, 7]})
    split = eng.counts["split"]
    for row, got in zip(rows, eng.uncached(rows)):
        d = max_abs_diff(got, ref.answers(row["ids"], row["slots"], row["nopts"]))
        assert d < TOL, f"tiny engine: uncached row (len {len(row['ids'])}, slots {row['slots']}): max |diff| {d:.2e}"
    assert eng.counts["split"] == split + 1 and len(eng.cache.index) == 0
    state = random_ids(250, 302, vocab)
    cached = [(state + random_ids(20, 303, vocab), 250, "cold", 0), (state + random_ids(9, 304, vocab), 250, "hit", 250),
              (state + random_ids(80, 305, vocab), 320, "partial", 250)]
    for ids, state_len, path, reused in cached:
        row = {"ids": ids, "state_len": state_len, "slots": [state_len, len(ids) - 1], "nopts": [4, 26]}
        (res,) = eng.answer([row])
        assert (res["path"], res["reused"]) == (path, reused), res
        d = max_abs_diff(res["probs"], ref.answers(ids, row["slots"], row["nopts"]))
        assert d < TOL, f"tiny engine: {path} row: max |diff| {d:.2e}"
        assert max_abs_diff(res["probs"], eng.uncached([row])[0]) < TOL
