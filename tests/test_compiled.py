"""The torch.compile'd elementwise pieces (the GPU default) compute what the eager ones do, on the CPU in float32:
rows through the step loop over a compiled model (uncached rows, a new state planted, a hit from it; the gates mask
a piece's padding through `live`). Inductor's CPU backend compiles them here (several seconds); a piece that
fails to compile would fall back to eager, so the test also asserts every piece really ran compiled, and that what
the first forward compiled served every later token count (no compile after it: Fused marks the token dimension
dynamic)."""

from __future__ import annotations

from statecache.cache.config import CacheSettings
from statecache.cache.policy import PlantWhenItFits
from statecache.cache.store import StateCache
from statecache.kernels.dispatch import TorchKernels
from statecache.model.forward import Qwen35
from statecache.run.batch import BatchRunner
from statecache.step import Steps
from tests.cache_util import assert_close, one_thread, reference, run_rows, small_model, toks


def test_compiled_pieces_match_eager():
    import torch._dynamo.utils

    stats = torch._dynamo.utils.counters["stats"]
    with one_thread():
        eager = small_model()
        model = Qwen35(eager.w)  # same weights, its own pieces
        model.compile_elementwise()
        runner = BatchRunner(model, TorchKernels(), max_slots=4, max_batch=16, max_pos=1024)
        cache = StateCache(CacheSettings(min_prefix=64, stride=128, host_mb=0), "cpu",
                           checkpoint_bytes=runner.st.checkpoint_bytes(), position_bytes=runner.st.position_bytes())
        steps = Steps(cache, runner, PlantWhenItFits(), budget_tokens=512, chunk_tokens=128)
        rows = [(toks(n, n), 0, [n - 1, n // 2], [4, 7]) for n in (37, 100, 129)]
        graphs = None
        for k in (1, 3):  # one row (one forward, one token count), then all three
            for (ids, _, slots, nopts), ans in zip(rows[:k], run_rows(steps, rows[:k], fresh=True)):
                assert ans.path == "plain"
                assert_close(ans.probs, reference(ids, slots, nopts), 1e-5)
            graphs = graphs or stats["unique_graphs"]  # the pieces compiled for the first forward's token count
        state = toks(300, 5)
        for q in range(2):  # a new state (planted over several pieces), then a hit
            ids = state + toks(21, 50 + q)
            (ans,) = run_rows(steps, [(ids, 300, [320], [5])])
            assert ans.path == ("cold", "hit")[q]
            assert_close(ans.probs, reference(ids, [320], [5]), 1e-5)
        pieces = (model.norm, model.add_norm, model.gnorm, model.qk_prep, model.act, model.gates, model.gate_out)
        assert all(p.ok for p in pieces), [p.__name__ for p in pieces if not p.ok]
        # the forwards since held other token counts: no piece compiled again (Fused marks them dynamic)
        assert stats["unique_graphs"] == graphs, dict(stats)
