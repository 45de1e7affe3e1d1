"""GPU checks (skipped without CUDA): fla / FlashAttention kernels against the torch reference, and cached rows
through the step loop's CUDA graphs against the uncached forward of the same rows (Engine.uncached: the same step
loop from nothing) on the tiny model. The timings live in bench/ (load_bench.py, gpu_delta_steps.py); agreement
with float32 and transformers over many rows in bench/gpu_agree32.py."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def kernels():
    from statecache.kernels.dispatch import CudaKernels, TorchKernels

    pytest.importorskip("fla", reason="flash-linear-attention is not installed (CudaKernels' conv and delta are its)")
    return TorchKernels(), CudaKernels()


def test_delta_rule_matches_reference(kernels):
    ref, fla = kernels
    torch.manual_seed(0)
    T, Hk, Hv, D = 200, 2, 4, 64
    q, k = torch.randn(1, T, Hk, D, device="cuda"), torch.randn(1, T, Hk, D, device="cuda")
    v = torch.randn(1, T, Hv, D, device="cuda")
    g, beta = -torch.rand(1, T, Hv, device="cuda") * 0.5, torch.rand(1, T, Hv, device="cuda")
    init = torch.randn(2, Hv, D, D, device="cuda") * 0.1
    cu = torch.tensor([0, 77, 200], dtype=torch.int32, device="cuda")
    (o1, s1), (o2, s2) = ref.delta(q, k, v, g, beta, init, cu), fla.delta(q, k, v, g, beta, init, cu)
    assert (o1 - o2).abs().max() < 1e-3 and (s1 - s2).abs().max() < 5e-3


def test_conv_and_attention_match_reference(kernels):
    ref, fla = kernels
    torch.manual_seed(1)
    x, w = torch.randn(1, 150, 96, device="cuda"), torch.randn(96, 4, device="cuda")
    cu = torch.tensor([0, 50, 150], dtype=torch.int32, device="cuda")
    assert (ref.conv(x, w, cu) - fla.conv(x, w, cu)).abs().max() < 1e-4
    bf = torch.bfloat16
    q, kk, vv = (torch.randn(150, n, 64, device="cuda", dtype=bf) for n in (8, 2, 2))
    assert (ref.attend_packed(q, kk, vv, cu, 100, 0.125) - fla.attend_packed(q, kk, vv, cu, 100, 0.125)).abs().max() < 2e-2
    K, V = torch.randn(512, 2, 64, device="cuda", dtype=bf), torch.randn(512, 2, 64, device="cuda", dtype=bf)
    start = torch.tensor(130, device="cuda")
    a, b = ref.attend_span(q[:64], K, V, start, 0.125), fla.attend_span(q[:64], K, V, start, 0.125)
    assert (a.float() - b.float()).abs().max() < 2e-2


def test_graph_cached_rows_match_plain_bf16(kernels):
    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="bfloat16", settings=CacheSettings(min_prefix=64, stride=128), compile=False)
    assert eng.runner.use_graphs
    g = torch.Generator().manual_seed(0)
    state = torch.randint(0, eng.vocab_size, (300,), generator=g).tolist()
    rows = [{"ids": state + torch.randint(0, eng.vocab_size, (20,), generator=g).tolist(), "state_len": 300,
             "slots": [319], "nopts": [4]} for _ in range(3)]
    got = eng.answer(rows)
    assert [r["path"] for r in got] == ["cold", "hit", "hit"], ([r.get("path") for r in got], eng.phases, eng.counts,
                                                                  eng.cache.stats)
    want = eng.uncached(rows)
    for r, p in zip(got, want):  # two bf16 runs (from a checkpoint, from nothing), as in the mixed-steps test
        assert max(abs(a - b) for a, b in zip(r["probs"][0], p[0])) < 2e-2


def test_graph_cached_image_rows_match_plain_bf16(kernels):
    """Image rows on the tiny model with a vision tower: cold, hit (real CUDA graphs with the rotary shift) and a
    grown state, against an engine without a cache; the tower runs once."""
    import io

    import numpy as np
    from PIL import Image

    from statecache.cache.config import CacheSettings
    from statecache.dev.tiny import tiny_vl_model_dir
    from statecache.engine import Engine

    eng = Engine(tiny_vl_model_dir(), device="cuda", dtype="bfloat16", settings=CacheSettings(min_prefix=64, stride=128),
                 compile=False)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    state = "the agent reads the page. " * 12 + "<|image|>" + " and then the form below it." * 12
    qs = [{"text": f"question {k}?", "options": ["a", "b", "c", "d"]} for k in range(3)]
    rows = [{"state": state, "questions": [qs[0]], "images": [buf.getvalue()]},
            {"state": state, "questions": [qs[1]], "images": [buf.getvalue()]},
            {"state": state + " one more step." * 30, "questions": [qs[2]], "images": [buf.getvalue()]}]
    got = [eng.answer([r])[0] for r in rows]
    assert [r["path"] for r in got] == ["cold", "hit", "partial"], got
    assert eng.embeddings.stats["vision_runs"] == 1
    plain = Engine(tiny_vl_model_dir(), device="cuda", dtype="bfloat16", settings=CacheSettings(mb=0), compile=False)
    want = plain.answer(rows)
    for r, p in zip(got, want):
        assert p["path"] == "plain"
        assert max(abs(a - b) for a, b in zip(r["probs"][0], p["probs"][0])) < 1e-2


def test_specialists_graph_rows_match_plain(kernels):
    """The tiny model with its 3-route specialists on CUDA, float32: cached rows (one chunk graph per shape for
    every route, mispredictions forced through the guess) answer and route as the uncached forward
    (fla's kernels may compute in TF32: a looser tolerance than the CPU tests' 1e-4)."""
    from statecache.cache.config import CacheSettings
    from statecache.dev.tiny import tiny_specialists_dir
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128), compile=False,
                 specialists=tiny_specialists_dir())
    assert eng.runner.use_graphs
    g = torch.Generator().manual_seed(0)
    state = torch.randint(0, eng.vocab_size, (300,), generator=g).tolist()
    rows = [{"ids": state + torch.randint(0, eng.vocab_size, (20,), generator=g).tolist(), "state_len": 300,
             "slots": [319], "nopts": [4]} for _ in range(6)]
    wrong = iter([2, 0, 1, 2, 0, 1])
    own = eng.cache.guess
    eng.cache.guess = lambda best: next(wrong) if best is not None else own(best)
    got = eng.answer(rows)
    want = eng.uncached(rows, results=True)
    for r, w in zip(got, want):
        assert r["route"] == w["route"]
        assert max(abs(a - b) for a, b in zip(r["probs"][0], w["probs"][0])) < 5e-3
    assert eng.cache.stats["mispredict"] >= 1


def test_specialists_batched_hits_match_plain(kernels):
    """The tiny model with its 3-route specialists on CUDA, float32: hits on several saved states in one batch go
    through the step loop (a route per sequence) and answer and route as the uncached
    forward."""
    from statecache.cache.config import CacheSettings
    from statecache.dev.tiny import tiny_specialists_dir
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128), compile=False,
                 specialists=tiny_specialists_dir())
    assert eng.runner is not None and eng.runner.spec is eng.specialists
    g = torch.Generator().manual_seed(1)
    states = [torch.randint(0, eng.vocab_size, (256 + 64 * k,), generator=g).tolist() for k in range(4)]

    def rows(n):
        return [{"ids": s + torch.randint(0, eng.vocab_size, (n,), generator=g).tolist(), "state_len": len(s),
                 "slots": [len(s) + n - 1], "nopts": [4]} for s in states]
    eng.answer(rows(9))  # plants each state
    stepped = eng.phases["step_rows"]
    hits = rows(17)
    got = eng.answer(hits)
    assert [r["path"] for r in got] == ["hit"] * len(hits), [r.get("path") for r in got]
    assert eng.phases["step_rows"] - stepped == len(hits)
    want = eng.uncached(hits, results=True)
    for r, w in zip(got, want):
        assert r["route"] == w["route"]
        assert max(abs(a - b) for a, b in zip(r["probs"][0], w["probs"][0])) < 5e-3


def test_rows_with_options_through_graphs_match_plain(kernels):
    """Token rows naming their own option ids (issue 25), hits batched with rows of other option sets and nopts rows,
    through the CUDA graphs (keyed without the options: the ids are device inputs each replay reads), answer as the
    uncached forward of the same rows; a second batch with other options replays the same graphs."""
    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128), compile=False)
    V = eng.vocab_size
    g = torch.Generator().manual_seed(3)
    states = [torch.randint(0, V, (256 + 64 * k,), generator=g).tolist() for k in range(4)]

    def rows(n, shift):
        out = []
        for k, s in enumerate(states):
            r = {"ids": s + torch.randint(0, V, (n,), generator=g).tolist(), "state_len": len(s),
                 "slots": [len(s) + n - 3, len(s) + n - 1]}
            if k % 2:
                r["nopts"] = [2 + k, 4]
            else:
                r["options"] = [[(shift + 7 * j + k) % V for j in range(2 + k)], [V - 1, shift, 5]]
            out.append(r)
        return out

    eng.answer(rows(9, 0))  # plants each state
    for shift in (11, 101):
        hits = rows(17, shift)
        captures = eng.runner.stats["captures"]
        got = eng.answer(hits)
        want = eng.uncached(hits)
        assert [r["path"] for r in got] == ["hit"] * len(hits)
        for r, p in zip(got, want):
            for a, b in zip(r["probs"], p):
                assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 5e-3
        if shift == 101:
            assert eng.runner.stats["captures"] == captures  # the same graphs served other option ids


def test_rows_restored_from_the_pinned_host_tier_match_plain(kernels):
    """The host tier on CUDA (statecache.cache.tiers.HostPool: slabs registered with the driver beside forwards, copies on
    the pool's own streams): with a device budget that holds about one state, earlier states move to the host and a
    row that returns to one is a hit copied back, answering as the uncached forward of the same row (float32, the tiny model, CUDA graphs)."""
    from statecache.cache.config import CacheSettings
    from statecache.cache.index import DEVICE
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128, mb=1, host_mb=64),
                 compile=False)
    eng.cache.host._preparer.join(60)  # its slab's pages faulted in (the serving thread registers it beside a forward)
    V = eng.vocab_size
    g = torch.Generator().manual_seed(7)
    n = 2 * eng.cache.index.budget_bytes // eng.cache.state_bytes(300) + 2  # twice what the device budget holds
    states = [torch.randint(0, V, (300,), generator=g).tolist() for _ in range(n)]

    def row(s, n):
        ids = s + torch.randint(0, V, (n,), generator=g).tolist()
        return {"ids": ids, "state_len": len(s), "slots": [len(ids) - 1], "nopts": [4]}

    for s in states:
        assert eng.answer([row(s, 8)])[0]["path"] == "cold"
    assert eng.cache.index.counts["demoted"] > 0 and eng.cache.host.stats["slabs"] >= 1
    first = eng.cache.index.lookup(states[0], limit=300)
    assert first is not None and first.pos == 300 and first.tier != DEVICE  # the oldest state went to the host
    assert eng.cache.host.slabs[0].is_pinned()
    again = [row(states[0], 9), row(states[1], 11)]
    for r in again:
        got = eng.answer([r])[0]
        want = eng.uncached([r])[0]
        assert got["path"] == "hit" and got["reused"] == 300
        assert max(abs(a - b) for a, b in zip(got["probs"][0], want[0])) < 1e-3
    info = eng.cache.info()
    assert info["restored_host"] >= 1 and info["host"]["copies_up"] >= 2 and info["host"]["up_ms"] > 0
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
    assert eng.cache.index.host_bytes <= eng.cache.index.host_budget_bytes


def test_waves_through_the_host_tier_with_steps_in_flight_match_plain(kernels):
    """The host tier under the step loop (float32, the tiny model, CUDA graphs): a device budget of about one state,
    waves of rows returning to earlier states while new ones arrive, so copies up (on their own stream, beside the
    step in flight) and copies down (evictions, on theirs) interleave with forwards and with each other; every
    answer is the uncached forward's, and both budgets hold."""
    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine
    from tests.cache_util import answer_in_waves

    eng = Engine(device="cuda", dtype="float32", settings=CacheSettings(min_prefix=64, stride=128, mb=1, host_mb=64),
                 compile=False, step_tokens=512, step_chunk=128)
    eng.cache.host._preparer.join(60)
    V = eng.vocab_size
    g = torch.Generator().manual_seed(5)
    states = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(200, 400, (8,), generator=g)]

    def row(s):
        ids = s + torch.randint(0, V, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        return {"ids": ids, "state_len": len(s), "slots": [len(ids) - 1], "nopts": [4]}

    order = torch.randint(0, len(states), (48,), generator=g).tolist()
    rows = [row(states[i]) for i in order]
    waves = [(rows[k:k + 6], int(torch.randint(0, 3, (1,), generator=g))) for k in range(0, len(rows), 6)]
    got = answer_in_waves(eng, waves)
    want = eng.uncached(rows)
    for r, w in zip(got, want):
        assert "probs" in r, r
        assert max(abs(a - b) for a, b in zip(r["probs"][0], w[0])) < 1e-3
    info = eng.cache.info()
    assert info["restored_host"] >= 4 and info["host"]["copies_down"] >= 4, info
    assert sum(r["path"] == "hit" for r in got) >= 8
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
    assert eng.cache.index.host_bytes <= eng.cache.index.host_budget_bytes


def test_steps_mix_new_pages_hits_and_grown_states_bf16(kernels):
    """The step loop through the batch runner's CUDA graphs (tiny model, bf16): two new pages advance in chunks over
    several steps while hits of an earlier state and a grown state ride beside them; every answer is near the uncached
    forward's, and the pages' planted states are continued from afterwards."""
    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="bfloat16", settings=CacheSettings(min_prefix=64, stride=128), compile=False,
                 step_tokens=512, step_chunk=128)
    assert eng.steps is not None and eng.runner.use_graphs
    V = eng.vocab_size
    g = torch.Generator().manual_seed(11)

    def t(n):
        return torch.randint(0, V, (n,), generator=g).tolist()

    def row(s, q):
        ids = s + t(q)
        return {"ids": ids, "state_len": len(s), "slots": [len(ids) - 2, len(ids) - 1], "nopts": [3, 4]}

    a, p1, p2 = t(300), t(700), t(520)
    assert eng.answer([row(a, 9)])[0]["path"] == "cold"
    rows = [row(p1, 12), row(a, 7), row(a + t(90), 10), row(p2, 6), row(a, 21)]
    got = dict(eng.submit(rows, list(range(len(rows)))))
    steps = 0
    while eng.pending():
        got.update(eng.step())
        steps += 1
    res = [got[i] for i in range(len(rows))]
    assert [r["path"] for r in res] == ["cold", "hit", "partial", "cold", "hit"] and steps >= 5
    again = [row(p1, 8), row(p2, 9), row(a + t(90)[:0], 5)]
    res2 = eng.answer(again)
    assert [r["path"] for r in res2] == ["hit", "hit", "hit"]
    want = eng.uncached(rows + again)
    for r, w in zip(res + res2, want):
        for got_slot, want_slot in zip(r["probs"], w):
            assert max(abs(x - y) for x, y in zip(got_slot, want_slot)) < 2e-2


def test_a_9000_token_state_is_cached_through_the_step_bf16(kernels):
    """A 9,000-token state (past the largest graph's packed tokens: a step's 2,048)
    through the step loop's CUDA graphs on the tiny model, bf16: planted, then continued from by a hit and by a
    grown state, every answer near the uncached forward's."""
    from statecache.cache.config import CacheSettings
    from statecache.engine import Engine

    eng = Engine(device="cuda", dtype="bfloat16", settings=CacheSettings(min_prefix=64, stride=1024), compile=False)
    assert eng.steps is not None and eng.runner.use_graphs
    g = torch.Generator().manual_seed(12)

    def t(n):
        return torch.randint(0, eng.vocab_size, (n,), generator=g).tolist()

    s = t(9000)
    grown = s + t(300)
    rows = [{"ids": x + t(12), "state_len": len(x), "slots": [len(x) + 11], "nopts": [4]} for x in (s, s, grown)]
    got = [eng.answer([r])[0] for r in rows]
    assert [r["path"] for r in got] == ["cold", "hit", "partial"], [r.get("path") for r in got]
    want = eng.uncached(rows)
    for r, p in zip(got, want):
        assert max(abs(a - b) for a, b in zip(r["probs"][0], p[0])) < 2e-2
