"""Batched continuations (StateCache.rows_batched, statecache.batch) on the CPU in float32.

Every batched answer equals the uncached (plain) forward within 1e-4, the one-at-a-time cached answer, and
transformers' own; over random mixes of hits, grown states and new states with evictions between batches
(hypothesis); a bad row fails alone; rows that cannot be batched come back as None; and the graph-mode bookkeeping
(buckets, captures, a failed capture) with stand-in graphs replaying the Triton batch kernels in the interpreter.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statecache.batch import MAX_PIECE, MAX_SNAPS, BatchRunner
from statecache.cache import CacheSettings, StateCache
from statecache.kernels import TorchKernels
from statecache.runner import ChunkRunner
from tests.cache_util import (MAX_POS, VOCAB, assert_close, down, index_bytes_recount, make_cache, max_diff,
                              one_thread, reference, small_model, toks)


@pytest.fixture(scope="module", autouse=True)
def _model():
    with one_thread():
        small_model()
        yield


def batch_cache(pad=False, max_batch=8, max_piece=MAX_PIECE, max_snaps=MAX_SNAPS, **settings) -> StateCache:
    cache = make_cache(pad, **settings)
    cache.batch = BatchRunner(small_model(), TorchKernels(), max_batch=max_batch, pad=pad, max_pos=MAX_POS,
                              max_piece=max_piece, max_snaps=max_snaps)
    return cache


def check(cache, rows, answers, tol=1e-4):
    """Each answer (where not None) equals the plain forward; bookkeeping consistent, bytes within budget."""
    for (ids, state_len, slots, nopts), a in zip(rows, answers):
        if a is None:
            continue
        assert_close(a.probs, reference(ids, slots, nopts), tol)
        for pr, k in zip(a.probs, nopts):
            assert len(pr) == k and abs(sum(pr) - 1) < 1e-5
        p = down(state_len)
        assert a.reused + a.computed == len(ids) and a.reused % 64 == 0 and 0 < a.reused <= p
        assert a.path == ("hit" if a.reused == p else "partial")
    assert cache.index.bytes <= cache.index.budget_bytes
    assert cache.index.bytes == index_bytes_recount(cache)


def row(state, q, seed, nslots=1):
    ids = state + toks(q, 5000 + seed)
    n = len(ids)
    slots = sorted({max(len(state), n - 1 - 3 * j) for j in range(nslots)})  # in the question
    return ids, len(state), slots, [2 + (seed + j) % 20 for j in range(len(slots))]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_hits_and_grown_states_in_one_batch(pad):
    cache = batch_cache(pad)
    states = [toks(300 + 7 * k, 40 + k) for k in range(4)]
    for k, s in enumerate(states):
        assert cache.row(*row(s, 9, k)).path == "cold"
    grown = states[1] + toks(30, 50)  # p 320: restores 256, plants 320 in the batch
    rows = [row(states[0], 20, 1, 2), row(states[2], 1, 2), row(grown, 12, 3), row(states[3], 64, 4, 3),
            row(states[0], 80, 5)]  # 124 tokens from p: over one 64-token delta piece
    made = cache.stats["ckpts_made"]
    ans = cache.rows_batched(rows)
    assert all(a is not None for a in ans)
    check(cache, rows, ans)
    assert [a.path for a in ans] == ["hit", "hit", "partial", "hit", "hit"]
    assert cache.stats["ckpts_made"] == made + 1 and cache.stats["batched"] == 5
    assert cache.batch.stats["forwards"] == 1  # the grown state plants inside its own piece, beside the questions
    # the grown state's checkpoint is there: its next question is a hit on 320, batched
    again = cache.rows_batched([row(grown, 5, 6)])
    assert again[0].path == "hit" and again[0].reused == 320
    check(cache, [row(grown, 5, 6)], again)


def test_batched_equals_one_at_a_time():
    one, many = batch_cache(), batch_cache()
    states = [toks(260 + 40 * k, 60 + k) for k in range(3)]
    for k, s in enumerate(states):
        one.row(*row(s, 5, k))
        many.row(*row(s, 5, k))
    rows = [row(states[k % 3], 10 + 13 * k, 10 + k, 1 + k % 3) for k in range(7)]
    single = [one.row(*r) for r in rows]
    batched = many.rows_batched(rows)
    for a, b in zip(single, batched):
        assert (a.path, a.reused, a.computed) == (b.path, b.reused, b.computed)
        assert max_diff(a.probs, b.probs) < 1e-5


def test_rows_that_cannot_batch_are_left_to_the_caller():
    cache = batch_cache()
    s = toks(300, 70)
    cache.row(*row(s, 5, 0))
    rows = [row(toks(300, 71), 5, 1),  # nothing saved for this state
            row(s, 600, 2),  # a question longer than a batch piece (MAX_PIECE)
            (row(s, 5, 3)[0], 300, [10], [4]),  # not eligible (slot inside the state)
            row(s, 7, 4)]
    ans = cache.rows_batched(rows)
    assert ans[:3] == [None, None, None] and ans[3].path == "hit"
    check(cache, rows, ans)
    cache.batch = None
    assert cache.rows_batched(rows) == [None] * 4


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_a_state_grown_by_more_than_a_piece_runs_batched(pad):
    """A grown state whose new chunk is longer than a batch piece (here 128 tokens) runs as several pieces in
    successive batched steps beside a hit; it plants its checkpoints as the one-at-a-time path does, and a later row
    hits its new end."""
    cache = batch_cache(pad, max_piece=128)
    s, t = toks(300, 80), toks(200, 81)
    cache.row(*row(s, 5, 0))
    cache.row(*row(t, 5, 1))
    grown = s + toks(330, 82)  # from p 256 to p 576: 320 new state tokens, cut into 128 + 128 + 64
    rows = [row(grown, 6, 2), row(t, 9, 3)]
    forwards, made = cache.batch.stats["forwards"], cache.stats["ckpts_made"]
    ans = cache.rows_batched(rows)
    check(cache, rows, ans)
    assert [a.path for a in ans] == ["partial", "hit"]
    assert ans[0].reused == 256 and cache.batch.stats["forwards"] - forwards >= 3
    solo = make_cache(pad)  # the one-at-a-time path plants as many checkpoints for the grown state
    solo.row(*row(s, 5, 0))
    solo_made = solo.stats["ckpts_made"]
    solo.row(*rows[0])
    assert cache.stats["ckpts_made"] - made == solo.stats["ckpts_made"] - solo_made > 0
    later = row(grown, 11, 4)
    hit = cache.rows_batched([later])[0]
    assert hit.path == "hit" and hit.reused == 576
    check(cache, [later], [hit])


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_a_grown_state_plants_inside_one_piece(pad):
    """A state grown past a stride and its tail runs as one piece from its checkpoint to its question's end: the
    checkpoints it crosses (stride 384, tail 512, end 576) are snapshotted inside it, one forward for the batch; each
    planted checkpoint then serves a row that leaves the state there, as the one-at-a-time path's would."""
    cache = batch_cache(pad)
    s, t = toks(300, 180), toks(200, 181)
    cache.row(*row(s, 5, 0))
    cache.row(*row(t, 5, 1))
    grown = s + toks(330, 182)  # p 256 -> 576: 320 new state tokens and the question in one 512-token piece
    rows = [row(grown, 6, 2), row(t, 9, 3)]
    forwards, made = cache.batch.stats["forwards"], cache.stats["ckpts_made"]
    ans = cache.rows_batched(rows)
    check(cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("partial", 256), ("hit", 192)]
    assert cache.batch.stats["forwards"] - forwards == 1
    solo = make_cache(pad)
    solo.row(*row(s, 5, 0))
    solo_made = solo.stats["ckpts_made"]
    solo.row(*rows[0])
    assert cache.stats["ckpts_made"] - made == solo.stats["ckpts_made"] - solo_made == 3
    for k, cut in enumerate((384, 512, 576)):  # a row leaving the state at each planted checkpoint
        r = row(grown[:cut] + toks(40, 190 + k), 7, 10 + k)
        got = cache.rows_batched([r])[0]
        assert got.reused == cut, (cut, got)
        check(cache, [r], [got])


def test_snapshots_past_a_forwards_slots_split_the_batch():
    """More snapshots than a forward has slots: the rows go in successive forwards, each answered and planted."""
    cache = batch_cache(max_snaps=3)
    states = [toks(260, 200 + k) for k in range(3)]
    for k, s in enumerate(states):
        cache.row(*row(s, 5, k))
    grown = [s + toks(150, 210 + k) for k, s in enumerate(states)]  # 256 -> 384: checkpoints 320 (tail) and 384
    rows = [row(g, 4 + k, 20 + k) for k, g in enumerate(grown)]
    forwards = cache.batch.stats["forwards"]
    ans = cache.rows_batched(rows)
    check(cache, rows, ans)
    assert all(a.path == "partial" for a in ans) and cache.batch.stats["forwards"] - forwards == 3
    later = [row(g, 9, 30 + k) for k, g in enumerate(grown)]
    again = cache.rows_batched(later)
    assert all(a.path == "hit" and a.reused == 384 for a in again)
    check(cache, later, again)


def test_a_bad_row_fails_alone():
    cache = batch_cache()
    states = [toks(300, 80 + k) for k in range(3)]
    for k, s in enumerate(states):
        cache.row(*row(s, 5, k))
    rows = [row(states[k % 3], 8 + k, 20 + k) for k in range(6)]
    bad = list(rows[2])
    bad[0] = bad[0][:-1] + [VOCAB + 3]  # a token past the vocabulary: its forward raises
    rows[2] = tuple(bad)
    ans = cache.rows_batched(rows)
    assert ans[2] is None and all(a is not None for k, a in enumerate(ans) if k != 2)
    check(cache, [r for k, r in enumerate(rows) if k != 2], [a for k, a in enumerate(ans) if k != 2])


def test_a_forward_failing_at_the_wait_counts_nothing(monkeypatch):
    """A forward that fails only when the host waits for it (an asynchronous GPU error): its rows are halved down as
    for any failure, and the failing row is neither counted nor touched as if answered; the others are, once each."""
    cache = batch_cache()
    states = [toks(300, 60 + k) for k in range(4)]
    for k, s in enumerate(states):
        cache.row(*row(s, 5, k))
    rows = [row(states[k], 8 + k, 40 + k) for k in range(4)]
    bad = rows[2][0]
    bad_ckpt = cache.index.lookup(bad, limit=down(300))
    used = bad_ckpt.used
    runner, forward, read = cache.batch, cache.batch.forward, cache.batch.read
    last: list = []
    monkeypatch.setattr(runner, "forward", lambda pieces: last.__setitem__(slice(None), pieces) or forward(pieces))

    def failing_read(out):
        if any(pc.ids is bad for pc in last):
            raise RuntimeError("an asynchronous error (test)")
        return read(out)

    monkeypatch.setattr(runner, "read", failing_read)
    before = dict(cache.stats)
    ans = cache.rows_batched(rows)
    assert ans[2] is None and all(a is not None for k, a in enumerate(ans) if k != 2)
    check(cache, [r for k, r in enumerate(rows) if k != 2], [a for k, a in enumerate(ans) if k != 2])
    assert cache.stats["rows"] - before["rows"] == 3 and cache.stats["hits"] - before["hits"] == 3
    assert cache.stats["batched"] - before.get("batched", 0) == 3
    assert cache.stats["tokens_computed"] - before["tokens_computed"] == sum(a.computed for a in ans if a is not None)
    assert bad_ckpt.used == used  # not touched
    assert all(cache.index.lookup(r[0], limit=down(300)).used > used for k, r in enumerate(rows) if k != 2)


def test_states_in_the_batch_slots_are_refused():
    """A piece whose GDN states are a view of the batch slots (read in place while other sequences write their slots)
    is refused with NotBatched before anything runs."""
    from statecache.batch import NotBatched, Piece

    runner = batch_cache().batch
    cfg = runner.model.cfg
    G, W = len(cfg.linear_layers), cfg.linear_conv_kernel_dim
    conv = torch.zeros(G, W - 1, cfg.conv_dim)
    ok = Piece(toks(64, 7), 0, 64, conv, torch.zeros_like(runner.st.S[:, 0]), None, None, (63,), (4,))
    runner.load([ok])
    runner.forward([ok])  # a state of its own: runs
    bad = Piece(ok.ids, 0, 64, conv, runner.st.S[:, 1], None, None, (63,), (4,))
    with pytest.raises(NotBatched, match="view of the batch slots"):
        runner.forward([ok, bad])


def test_more_rows_than_the_largest_batch():
    cache = batch_cache(max_batch=2)
    states = [toks(280, 90 + k) for k in range(3)]
    for k, s in enumerate(states):
        cache.row(*row(s, 5, k))
    rows = [row(states[k % 3], 3 + k, 30 + k) for k in range(5)]
    ans = cache.rows_batched(rows)
    check(cache, rows, ans)
    assert all(a is not None for a in ans) and cache.batch.stats["forwards"] == 3


def test_matches_transformers(tmp_path):
    """Batched hits and a grown state on checkpoints of tests.oracle_util (GQA, GVA, Dk != Dv, partial rotary)
    against transformers' own model."""
    from statecache.loader import load_weights
    from statecache.model import Qwen35
    from tests.oracle_util import LETTERS, Reference, build_checkpoint, load_reference, max_abs_diff, random_ids

    for name in ("causal_untied_gqa2", "cond_untied_sharded"):
        path = build_checkpoint(tmp_path / name, name, seed=3)
        model = Qwen35(load_weights(path, LETTERS, "cpu", torch.float32))
        ref = Reference(load_reference(path))
        V = model.cfg.vocab_size
        runner = ChunkRunner(model, TorchKernels(), max_pos=512, span_step=128)
        cache = StateCache(runner, CacheSettings(min_prefix=64, stride=128, tail=16))
        cache.batch = BatchRunner(model, TorchKernels(), max_batch=4, max_pos=512)
        states = [random_ids(200 + 30 * k, 10 + k, V) for k in range(3)]
        for k, s in enumerate(states):
            ids = s + random_ids(4, 20 + k, V)
            assert cache.row(ids, len(s), [len(ids) - 1], [4]) is not None
        grown = states[0] + random_ids(80, 30, V)  # p 256 from 192
        rows = []
        for k, s in enumerate([states[0], states[1], grown, states[2]]):
            ids = s + random_ids(9 + 7 * k, 40 + k, V)
            rows.append((ids, len(s), [len(ids) - 1, len(ids) - 4], [3 + k, 26]))
        ans = cache.rows_batched(rows)
        assert [a.path for a in ans] == ["hit", "hit", "partial", "hit"]
        for (ids, _, slots, nopts), a in zip(rows, ans):
            d = max_abs_diff(a.probs, ref.answers(ids, slots, nopts))
            assert d < 1e-4, (name, d)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_mixes_with_evictions(data):
    """Agents with states that repeat, grow or are new; each round batches what can continue from saved states and
    runs the rest one at a time (as the engine does); a budget of 2 MiB evicts between rounds."""
    cache = batch_cache(mb=2, max_batch=4)
    n_agents = data.draw(st.integers(2, 5))
    states = [toks(data.draw(st.integers(200, 330)), 1000 + a) for a in range(n_agents)]
    seed = 0
    for _ in range(data.draw(st.integers(2, 4))):
        rows = []
        for a in range(n_agents):
            what = data.draw(st.sampled_from(["same", "grow", "new", "skip"]))
            if what == "skip":
                continue
            seed += 1
            if what == "grow":
                states[a] = states[a] + toks(data.draw(st.integers(1, 70)), 2000 + seed)
            elif what == "new":
                states[a] = toks(data.draw(st.integers(200, 330)), 3000 + seed)
            if len(states[a]) > 700:
                states[a] = states[a][-300:]
            rows.append(row(states[a], data.draw(st.integers(1, 40)), seed, data.draw(st.integers(1, 3))))
        ans = cache.rows_batched(rows)
        check(cache, rows, ans)
        for r, a in zip(rows, ans):
            if a is None:  # the engine's one-at-a-time path plants it
                single = cache.row(*r)
                assert single is not None
                assert_close(single.probs, reference(r[0], r[2], r[3]))


# ---- graph mode, with stand-in graphs replaying the Triton batch kernels in the interpreter ----------------------------


def test_graph_buckets_and_a_failed_capture(monkeypatch):
    """Graphs keyed by (batch bucket, token bucket) read every per-sequence number from their input buffer: replays
    of graphs captured with empty sequences answer rows of other shapes. A bucket that fails to capture halves the
    batch into buckets that do."""
    from tests.triton_interp import batch_graphs_in_interpreter

    fail = set()
    batch_graphs_in_interpreter(monkeypatch, refuse=fail)
    cache = make_cache(True)
    runner = BatchRunner(small_model(), TorchKernels(), max_batch=4, graphs=True, triton=True, max_pos=MAX_POS,
                         tokens=(64, 128))
    runner.bk.span_kw = dict(n_splits=1)  # one split: the interpreter runs no combine grid (tested on its own)
    cache.batch = runner
    states = [toks(270, 110 + k) for k in range(3)]
    for k, s in enumerate(states):
        cache.row(*row(s, 4, k))
    fail.add(4 * runner.max_slots)  # the 4-sequence bucket refuses: 3 rows run as 1 + 2
    rows = [row(states[k], 3 + 5 * k, 40 + k, 1 + k % 2) for k in range(3)]
    ans = cache.rows_batched(rows)
    assert all(a is not None and a.path == "hit" for a in ans)
    check(cache, rows, ans)
    assert runner.stats["capture_failed"] == 1 and runner.graphs[(4, 128, False)] is None
    assert sorted(k for k, g in runner.graphs.items() if g is not None and g.graph.replays) == [(1, 64, False), (2, 64, False)]


def test_graphs_plant_a_grown_state_inside_its_piece(monkeypatch):
    """Graph mode (stand-in graphs replaying the Triton batch kernels in the interpreter): a grown state's piece keeps
    its new checkpoint's GDN state and conv tails from the device-side snapshot table; the next row hits it."""
    from tests.triton_interp import batch_graphs_in_interpreter

    batch_graphs_in_interpreter(monkeypatch)
    cache = make_cache(True)
    runner = BatchRunner(small_model(), TorchKernels(), max_batch=2, graphs=True, triton=True, max_pos=MAX_POS,
                         tokens=(64, 128, 256))
    runner.bk.span_kw = dict(n_splits=1)
    cache.batch = runner
    s, t = toks(270, 220), toks(200, 221)
    cache.row(*row(s, 4, 0))
    cache.row(*row(t, 4, 1))
    grown = s + toks(60, 222)  # p 256 -> 320: one checkpoint inside a 79-token piece
    rows = [row(grown, 5, 2, 2), row(t, 6, 3)]
    ans = cache.rows_batched(rows)
    check(cache, rows, ans)
    assert [(a.path, a.reused) for a in ans] == [("partial", 256), ("hit", 192)]
    assert sorted(k for k, g in runner.graphs.items() if g is not None and g.graph.replays) == [(2, 128, True)]
    later = row(grown, 9, 4)
    hit = cache.rows_batched([later])[0]
    assert hit.path == "hit" and hit.reused == 320
    check(cache, [later], [hit])
