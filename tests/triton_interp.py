"""Loading a module of Triton kernels for a test: compiled on CUDA, else in Triton's interpreter (TRITON_INTERPRET=1,
which tests/conftest.py sets at start-up and Triton reads when a kernel is decorated; a module imported before it
was set is reloaded). Skips the calling test module when triton is not installed."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar (a 1-element array) into a loop bound with int(array), which numpy
    >= 2.4 refuses (triton-lang/triton#9171). Apply upstream's fix (#9172): squeeze first. Idempotent."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "statecache_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.statecache_fixed = True
    interpreter._patch_lang_tensor = patched


def load(name: str, kernel: str):
    """The module `name` with its kernels runnable here; `kernel` names one of them (checked for interpretation)."""
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    mod = importlib.import_module(name)
    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod.__dict__[kernel], InterpretedFunction):  # imported earlier without the env var
            mod = importlib.reload(mod)
        _interpreter_index_fix()
    return mod


def interpreter_launch_sizes(monkeypatch, conv_mod, gdn_mod, span_mod) -> None:
    """The batch kernels' launches as the interpreter runs them soonest. It runs the programs of a grid one after
    another in Python, each op on whole blocks with numpy, so fewer, larger programs finish sooner: one channel block
    for the conv, one value block and one key slice for the delta rule, key tiles of 128 and one split (no combine
    grid) for span attention (the replayed-graph tests of images and specialists took 93 s against 126 on a 2-core
    machine like CI's). What each kernel computes does not depend on them; their GPU launch sizes are tested in
    tests/test_*_triton.py (here in the interpreter, whole in the GPU suite)."""
    import triton

    conv, delta, span = conv_mod.conv_batch, gdn_mod.delta_batch, span_mod.attend_batch

    def conv_batch(x, *a, **kw):
        return conv(x, *a, **{"block_c": triton.next_power_of_2(x.shape[1]), **kw})

    def delta_batch(q, k, v, *a, **kw):
        return delta(q, k, v, *a, **{"block_v": v.shape[2], "block_k": k.shape[2], **kw})

    def attend_batch(*a, **kw):
        return span(*a, **{"block_n": 128, **kw, "n_splits": 1})

    monkeypatch.setattr(conv_mod, "conv_batch", conv_batch)
    monkeypatch.setattr(gdn_mod, "delta_batch", delta_batch)
    monkeypatch.setattr(span_mod, "attend_batch", attend_batch)


def batch_graphs_in_interpreter(monkeypatch, refuse=frozenset()) -> None:
    """statecache.run.batch's CUDA graphs on this machine: the batch kernels loaded (interpreted without CUDA, at
    `interpreter_launch_sizes`) and graph capture replaced by a stand-in graph (tests.test_graph_modes.ReplayGraph) that replays the forward; the
    warm-up runs once (the interpreter is slow). A capture whose output has a first dimension in `refuse` (a set the
    test may fill later) fails, as a refused capture would."""
    import statecache.run.graphs as graphs_mod
    from tests.test_graph_modes import ReplayGraph

    mods = [load(mod, kernel) for mod, kernel in (("statecache.kernels.conv", "_conv_chunk_kernel"),
                                                  ("statecache.kernels.gdn", "_delta_chunk_kernel"),
                                                  ("statecache.kernels.span", "_span_batch_kernel"))]
    if not CUDA:
        interpreter_launch_sizes(monkeypatch, *mods)

    def capture(fn, pool, warmup=1):
        out = fn()
        if out.shape[0] in refuse:
            raise RuntimeError("capture refused (test)")
        return ReplayGraph(fn, out), out

    monkeypatch.setattr(graphs_mod, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
