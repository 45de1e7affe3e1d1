"""Batched continuations (statecache.run.batch.BatchRunner, as the step loop statecache.step.Steps drives it) on the CPU in
float32.

Every answer of a step's packed forward equals the uncached answer within 1e-4, the answer of the same row run alone,
and transformers' own; hits, a grown state planting inside its piece, a grown state longer than a piece, more
snapshots than a forward holds and more rows than its largest batch; a bad row fails alone and counts nothing; a
piece whose states are a view of the batch slots is refused; and the graph-mode bookkeeping (buckets, captures, a
failed capture, snapshots) with stand-in graphs replaying the Triton batch kernels in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from statecache.cache.store import Answer, StateCache
from statecache.kernels.dispatch import TorchKernels
from statecache.run.batch import MAX_PIECE, MAX_SNAPS, BatchRunner, NotBatched, Piece, bucket
from statecache.step import RowFailed, Steps
from tests.cache_util import (MAX_POS, VOCAB, assert_close, index_bytes_recount, max_diff, one_thread,
                              make_steps, reference, run_rows, small_model, small_runner, toks)


@pytest.fixture(scope="module", autouse=True)
def _model():
    with one_thread():
        small_model()
        yield


def runner_for(pad=False, max_batch=8, max_piece=MAX_PIECE, max_snaps=MAX_SNAPS, **kw) -> BatchRunner:
    return BatchRunner(small_model(), TorchKernels(), max_batch=max_batch, pad=pad, max_pos=MAX_POS,
                       max_piece=max_piece, max_snaps=max_snaps, **kw)


def steps_over(runner: BatchRunner, cache: StateCache | None = None, chunk_tokens: int = 256, **settings) -> Steps:
    """tests.cache_util.make_steps over `runner`, on `cache` or a new one of `settings`."""
    return make_steps(runner=runner, cache=cache, chunk_tokens=chunk_tokens, **settings)


def check(cache, rows, answers, tol=1e-4):
    """Each answer equals the uncached one; bookkeeping consistent, bytes within budget."""
    for (ids, state_len, slots, nopts), a in zip(rows, answers):
        assert isinstance(a, Answer), a
        assert_close(a.probs, reference(ids, slots, nopts), tol)
        for pr, k in zip(a.probs, nopts):
            assert len(pr) == k and abs(sum(pr) - 1) < 1e-5
        p = state_len  # where the deepest checkpoint sits (statecache.cache.index.state_end)
        assert a.reused + a.computed == len(ids) and 0 < a.reused <= p
        assert a.path == ("hit" if a.reused == p else "partial")
    assert cache.index.bytes <= cache.index.budget_bytes
    assert cache.index.bytes == index_bytes_recount(cache)


def row(state, q, seed, nslots=1):
    ids = state + toks(q, 5000 + seed)
    n = len(ids)
    slots = sorted({max(len(state), n - 1 - 3 * j) for j in range(nslots)})  # in the question
    return ids, len(state), slots, [2 + (seed + j) % 20 for j in range(len(slots))]


def warm(steps: Steps, states, q=5) -> None:
    """Each state computed and planted (a row on it, from nothing)."""
    ans = run_rows(steps, [row(s, q, k) for k, s in enumerate(states)])
    assert all(isinstance(a, Answer) and a.path == "cold" for a in ans), ans


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_hits_and_grown_states_in_one_batch(pad):
    runner = runner_for(pad)
    steps = steps_over(runner)
    cache = steps.cache
    states = [toks(300 + 7 * k, 40 + k) for k in range(4)]
    warm(steps, states)
    grown = states[1] + toks(30, 50)  # p 337: restores 307, plants 337 inside its piece
    rows = [row(states[0], 20, 1, 2), row(states[2], 1, 2), row(grown, 12, 3), row(states[3], 64, 4, 3),
            row(states[0], 80, 5)]  # 124 tokens from p: over one 64-token delta chunk
    made, forwards = cache.stats["ckpts_made"], runner.stats["forwards"]
    tokens, padded = runner.stats["tokens"], runner.stats["padded_tokens"]
    by_bucket = {k: list(v) for k, v in runner.stats["buckets"].items()}
    ans = run_rows(steps, rows)
    check(cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("hit", 300), ("hit", 314), ("partial", 307), ("hit", 321),
                                                 ("hit", 300)]
    assert cache.stats["ckpts_made"] == made + 1
    assert runner.stats["forwards"] - forwards == 1  # the grown state plants inside its own piece, beside the hits
    ran = 20 + 1 + (30 + 12) + 64 + 80  # each row's tokens past its checkpoint (the grown state's from 307)
    assert sum(a.computed for a in ans) == ran
    assert runner.stats["tokens"] - tokens == ran
    assert runner.stats["padded_tokens"] - padded == (bucket(ran, runner.tokens) if pad else ran)
    Tb = str(bucket(ran, runner.tokens) if pad else ran)  # the forward counted under its bucket, with its own tokens
    assert runner.stats["buckets"][Tb] == [a + b for a, b in zip(by_bucket.get(Tb, [0, 0]), [1, ran])]
    # the step's line in the log (STEP_LOG_FIELDS): 5 pieces, their tokens and the forward's, the longest (80), the
    # attention pairs of each piece (L * (start + L / 2)), its time, the time since the step before it ended
    pieces, tokens, padded_, longest, pairs, ms, gap = steps.log[-1]
    assert (pieces, tokens, padded_, longest) == (5, ran, int(Tb), 80) and ms > 0 and gap > 0
    starts = [(300, 20), (314, 1), (307, 42), (321, 64), (300, 80)]  # each piece's start and tokens
    assert pairs == round(sum(L * (s + L / 2) for s, L in starts) / 1e6, 4)
    # the grown state's checkpoint is there: its next question is a hit on 337
    again = run_rows(steps, [row(grown, 5, 6)])
    assert again[0].path == "hit" and again[0].reused == 337
    check(cache, [row(grown, 5, 6)], again)


def test_batched_equals_one_at_a_time():
    """The same rows in one step and each alone: the same paths, token counts and answers (a sequence's answer does
    not depend on what else its forward packs)."""
    one, many = steps_over(small_runner()), steps_over(small_runner())
    states = [toks(260 + 40 * k, 60 + k) for k in range(3)]
    warm(one, states)
    warm(many, states)
    rows = [row(states[k % 3], 10 + 13 * k, 10 + k, 1 + k % 3) for k in range(7)]
    single = [run_rows(one, [r])[0] for r in rows]
    steps_before = many.stats["steps"]
    batched = run_rows(many, rows)
    assert many.stats["steps"] - steps_before == 1
    for a, b in zip(single, batched):
        assert (a.path, a.reused, a.computed) == (b.path, b.reused, b.computed)
        assert max_diff(a.probs, b.probs) < 1e-5


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_a_state_grown_by_more_than_a_piece_runs_in_several_pieces(pad):
    """A grown state whose new part is longer than the runner's piece (here 128 tokens) runs as several pieces in
    successive steps, the first beside a hit; it plants the checkpoints the cache's plan names for it, and a later
    row hits its new end."""
    runner = runner_for(pad, max_piece=128)
    steps = steps_over(runner)
    cache = steps.cache
    s, t = toks(300, 80), toks(200, 81)
    warm(steps, [s, t])
    grown = s + toks(330, 82)  # from p 300 to p 630: 330 new state tokens, cut into 84 + 128 + 118 (and the question)
    rows = [row(grown, 6, 2), row(t, 9, 3)]
    forwards, made = runner.stats["forwards"], cache.stats["ckpts_made"]
    ans = run_rows(steps, rows)
    check(cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("partial", 300), ("hit", 200)]
    assert runner.stats["forwards"] - forwards >= 3
    assert cache.stats["ckpts_made"] - made == len(cache.plan(len(grown), 300)) == 4  # 384, 512, 576, 630
    later = row(grown, 11, 4)
    hit = run_rows(steps, [later])[0]
    assert hit.path == "hit" and hit.reused == 630
    check(cache, [later], [hit])


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_a_grown_state_plants_inside_one_piece(pad):
    """A state grown past a stride and its tail runs as one piece from its checkpoint to its question's end (a step
    whose chunk holds it): the checkpoints it crosses (stride 384, tail 448, its end 500) are snapshotted inside it, one
    forward for the step; each planted checkpoint then serves a row that leaves the state there."""
    runner = runner_for(pad)
    steps = steps_over(runner, chunk_tokens=512)
    cache = steps.cache
    s, t = toks(300, 180), toks(200, 181)
    warm(steps, [s, t])
    grown = s + toks(200, 182)  # p 300 -> 500: 200 new state tokens and the question in one 206-token piece
    rows = [row(grown, 6, 2), row(t, 9, 3)]
    forwards, made = runner.stats["forwards"], cache.stats["ckpts_made"]
    ans = run_rows(steps, rows)
    check(cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("partial", 300), ("hit", 200)]
    assert runner.stats["forwards"] - forwards == 1
    assert cache.stats["ckpts_made"] - made == len(cache.plan(len(grown), 300)) == 3
    for k, cut in enumerate((384, 448, 500)):  # a row leaving the state at each planted checkpoint
        r = row(grown[:cut] + toks(40, 190 + k), 7, 10 + k)
        got = run_rows(steps, [r])[0]
        assert got.reused == cut, (cut, got)
        check(cache, [r], [got])


def test_snapshots_past_a_forwards_slots_split_the_step():
    """More snapshots than a forward has slots: the step's pieces go in successive forwards, each answered and
    planted."""
    runner = runner_for(max_snaps=3)
    steps = steps_over(runner)
    cache = steps.cache
    states = [toks(260, 200 + k) for k in range(3)]
    warm(steps, states)
    grown = [s + toks(150, 210 + k) for k, s in enumerate(states)]  # 260 -> 410: checkpoints 384 (tail) and 410
    rows = [row(g, 4 + k, 20 + k) for k, g in enumerate(grown)]
    forwards, steps_before = runner.stats["forwards"], steps.stats["steps"]
    ans = run_rows(steps, rows)
    check(cache, rows, ans)
    assert all(a.path == "partial" for a in ans)
    assert steps.stats["steps"] - steps_before == 1 and runner.stats["forwards"] - forwards == 3
    later = [row(g, 9, 30 + k) for k, g in enumerate(grown)]
    again = run_rows(steps, later)
    assert all(a.path == "hit" and a.reused == 410 for a in again)
    check(cache, later, again)


def test_a_bad_row_fails_alone_and_counts_nothing():
    """A row whose forward raises (a token past the vocabulary) fails alone: its step's forward is halved until it
    stands alone; it is neither counted nor its checkpoint touched as if answered; the others are, once each."""
    steps = steps_over(small_runner())
    cache = steps.cache
    states = [toks(300, 80 + k) for k in range(5)]
    warm(steps, states)
    rows = [row(states[k % 5], 8 + k, 20 + k) for k in range(6)]  # the bad row's state (2) is its alone
    bad = list(rows[2])
    bad[0] = bad[0][:-1] + [VOCAB + 3]  # a token past the vocabulary: its forward raises
    rows[2] = tuple(bad)
    bad_ckpt = cache.index.lookup(rows[2][0], limit=300)
    used, latest = bad_ckpt.used, max(c.used for c in cache.index.lru_order())
    before = dict(cache.stats)
    ans = run_rows(steps, rows)
    assert isinstance(ans[2], RowFailed) and ans[2].code == "internal"
    good = [k for k in range(6) if k != 2]
    check(cache, [rows[k] for k in good], [ans[k] for k in good])
    assert cache.stats["rows"] - before["rows"] == 5 and cache.stats["hits"] - before["hits"] == 5
    assert cache.stats["batched"] - before["batched"] == 5
    assert cache.stats["tokens_computed"] - before["tokens_computed"] == sum(ans[k].computed for k in good)
    assert steps.stats["failed"] == 1
    assert bad_ckpt.used == used  # not touched
    assert all(cache.index.lookup(rows[k][0], limit=300).used > latest for k in good)


def test_states_in_the_batch_slots_are_refused():
    """A piece whose GDN states are a view of the batch slots (read in place while other sequences write their slots)
    is refused with NotBatched before anything runs."""
    runner = runner_for()
    cfg = runner.model.cfg
    G, W = len(cfg.linear_layers), cfg.linear_conv_kernel_dim
    conv = torch.zeros(G, W - 1, cfg.conv_dim)
    ok = Piece(toks(64, 7), 0, 64, conv, torch.zeros_like(runner.st.S[:, 0]), None, None, (63,), (4,))
    runner.load([ok])
    runner.forward([ok])  # a state of its own: runs
    bad = Piece(ok.ids, 0, 64, conv, runner.st.S[:, 1], None, None, (63,), (4,))
    forwards = runner.stats["forwards"]
    with pytest.raises(NotBatched, match="view of the batch slots"):
        runner.forward([ok, bad])
    assert runner.stats["forwards"] == forwards


def test_more_rows_than_the_largest_batch():
    """Five hits over a runner of at most 2 sequences a forward: three steps of at most two, each row answered."""
    runner = runner_for(max_batch=2)
    steps = steps_over(runner)
    states = [toks(280, 90 + k) for k in range(3)]
    warm(steps, states)
    rows = [row(states[k % 3], 3 + k, 30 + k) for k in range(5)]
    forwards = runner.stats["forwards"]
    ans = run_rows(steps, rows)
    check(steps.cache, rows, ans)
    assert all(a.path == "hit" for a in ans) and runner.stats["forwards"] - forwards == 3


def test_matches_transformers(tmp_path):
    """Hits and a grown state in one step on checkpoints of tests.oracle_util (GQA, GVA, Dk != Dv, partial rotary)
    against transformers' own model."""
    from statecache.model.forward import Qwen35
    from statecache.model.loader import load_weights
    from tests.oracle_util import LETTERS, Reference, build_checkpoint, load_reference, max_abs_diff, random_ids

    for name in ("causal_untied_gqa2", "cond_untied_sharded"):
        path = build_checkpoint(tmp_path / name, name, seed=3)
        model = Qwen35(load_weights(path, LETTERS, "cpu", torch.float32))
        ref = Reference(load_reference(path))
        V = model.cfg.vocab_size
        runner = BatchRunner(model, TorchKernels(), max_batch=4, max_pos=512)
        steps = steps_over(runner)
        states = [random_ids(200 + 30 * k, 10 + k, V) for k in range(3)]
        warm_rows = []
        for k, s in enumerate(states):
            ids = s + random_ids(4, 20 + k, V)
            warm_rows.append((ids, len(s), [len(ids) - 1], [4]))
        assert all(a.path == "cold" for a in run_rows(steps, warm_rows))
        grown = states[0] + random_ids(80, 30, V)  # p 256 from 192
        rows = []
        for k, s in enumerate([states[0], states[1], grown, states[2]]):
            ids = s + random_ids(9 + 7 * k, 40 + k, V)
            rows.append((ids, len(s), [len(ids) - 1, len(ids) - 4], [3 + k, 26]))
        forwards = runner.stats["forwards"]
        ans = run_rows(steps, rows)
        assert [a.path for a in ans] == ["hit", "hit", "partial", "hit"]
        assert runner.stats["forwards"] - forwards == 1
        for (ids, _, slots, nopts), a in zip(rows, ans):
            d = max_abs_diff(a.probs, ref.answers(ids, slots, nopts))
            assert d < 1e-4, (name, d)


# ---- graph mode, with stand-in graphs replaying the Triton batch kernels in the interpreter ---------------------


@pytest.fixture
def interp_graphs(monkeypatch):
    """tests.triton_interp.batch_graphs_in_interpreter, returning the set of refused capture shapes."""
    from tests.triton_interp import batch_graphs_in_interpreter

    refuse: set = set()
    batch_graphs_in_interpreter(monkeypatch, refuse=refuse)
    return refuse


def graph_runner(max_batch, tokens) -> BatchRunner:
    runner = BatchRunner(small_model(), TorchKernels(), max_batch=max_batch, graphs=True, triton=True,
                         max_pos=MAX_POS, tokens=tokens)
    return runner


def replayed(runner) -> list:
    return sorted(k for k, g in runner.graphs.items() if g is not None and g.graph.replays)


def test_graph_buckets_and_a_failed_capture(interp_graphs):
    """Graphs keyed by (batch bucket, token bucket) read every per-sequence number from their input buffer: replays
    of graphs captured with empty sequences answer rows of other shapes. A bucket that fails to capture halves the
    step's forward into buckets that do."""
    warm_steps = steps_over(small_runner())  # the states computed eagerly; the graph runner answers on the same cache
    states = [toks(270, 110 + k) for k in range(3)]
    warm(warm_steps, states, q=4)
    runner = graph_runner(4, (64, 128))
    steps = steps_over(runner, warm_steps.cache)
    interp_graphs.add(4 * runner.max_slots)  # the 4-sequence bucket refuses: 3 rows run as 1 + 2
    rows = [row(states[k], 20 + 2 * k, 40 + k, 1 + k % 2) for k in range(3)]  # 20 + 22 + 24 tokens: bucket 128
    ans = run_rows(steps, rows)
    assert all(isinstance(a, Answer) and a.path == "hit" for a in ans), ans
    check(steps.cache, rows, ans)
    assert runner.stats["capture_failed"] == 1 and runner.graphs[(4, 128, False)] is None
    assert replayed(runner) == [(1, 64, False), (2, 64, False)]


def test_graphs_plant_a_grown_state_inside_its_piece(interp_graphs):
    """Graph mode: a grown state's piece keeps its new checkpoint's GDN state and conv tails from the device-side
    snapshot table; the next row hits it."""
    warm_steps = steps_over(small_runner())
    s, t = toks(270, 220), toks(200, 221)
    warm(warm_steps, [s, t], q=4)
    runner = graph_runner(2, (64, 128, 256))
    steps = steps_over(runner, warm_steps.cache)
    grown = s + toks(60, 222)  # p 270 -> 330: one checkpoint inside a 65-token piece
    rows = [row(grown, 5, 2, 2), row(t, 6, 3)]
    ans = run_rows(steps, rows)
    check(steps.cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("partial", 270), ("hit", 200)]
    assert replayed(runner) == [(2, 128, True)]
    later = row(grown, 9, 4)
    hit = run_rows(steps, [later])[0]
    assert hit.path == "hit" and hit.reused == 330
    check(steps.cache, [later], [hit])
