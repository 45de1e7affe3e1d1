"""The torch.compile'd elementwise pieces (the GPU default) compute what the eager ones do, on the CPU in float32:
plain rows, a padded lone row, and cached rows (whose gates mask padding through `live`). Inductor's CPU backend
compiles them here (about half a minute); a piece that fails to compile would fall back to eager, so the test also
asserts every piece really ran compiled."""

from __future__ import annotations

from statecache.cache import CacheSettings, StateCache
from statecache.kernels import TorchKernels
from statecache.model import Qwen35
from statecache.plain import PlainPath
from statecache.runner import ChunkRunner
from tests.cache_util import assert_close, one_thread, reference, small_model, toks


def test_compiled_pieces_match_eager():
    with one_thread():
        eager = small_model()
        model = Qwen35(eager.w)  # same weights, its own pieces
        model.compile_elementwise()
        rows = [(toks(n, n), [n - 1, n // 2], [4, 7]) for n in (37, 100, 129)]
        got = PlainPath(model, TorchKernels()).forward(rows)
        for row, g in zip(rows, got):
            assert_close(g, reference(*row), 1e-5)
        assert_close(PlainPath(model, TorchKernels(), pad=True, bucket=64).forward(rows[:1])[0], reference(*rows[0]), 1e-5)
        cache = StateCache(ChunkRunner(model, TorchKernels(), pad=True), CacheSettings(min_prefix=64, stride=128))
        state = toks(300, 5)
        for q in range(2):  # a cold row (padded chunks), then a hit
            ids = state + toks(21, 50 + q)
            ans = cache.row(ids, 300, [320], [5])
            assert ans is not None and ans.path == ("cold", "hit")[q]
            assert_close(ans.probs, reference(ids, [320], [5]), 1e-5)
        pieces = (model.norm, model.add_norm, model.gnorm, model.qk_prep, model.act, model.gates, model.gate_out)
        assert all(p.ok for p in pieces), [p.__name__ for p in pieces if not p.ok]
