"""Helpers for the state-cache tests: a small random Qwen3.5 (3 GDN layers + 1 attention layer) built once per
process, the step loop over it without an engine (`make_steps`: a StateCache and statecache.step.Steps over the
batched runner, eager on the CPU), the uncached reference (`reference`: the same step loop, no cache), rows of random
tokens, and the comparisons.

The model is wide enough in its attention K/V (4 kv heads x 64) that one position of a group costs 2 KiB, so a
budget of 1 MiB holds only a few states of a few hundred tokens: evictions happen at the smallest whole-MB budget.
"""

from __future__ import annotations

import functools
import tempfile
from contextlib import contextmanager

import numpy as np
import torch

from statecache.cache.config import CacheSettings
from statecache.cache.policy import PlantWhenItFits
from statecache.cache.store import StateCache
from statecache.dev.checkpoints import make_checkpoint
from statecache.kernels.dispatch import TorchKernels
from statecache.model.forward import Qwen35
from statecache.model.loader import load_weights
from statecache.run.batch import BatchRunner
from statecache.step import Steps

VOCAB = 64
LETTER_IDS = list(range(10, 36))
TOL = 1e-4
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
MAX_POS = 1024
SPAN_STEP = 256
_dirs: list[tempfile.TemporaryDirectory] = []  # kept alive for the process (the weights may be memory-mapped)


@functools.lru_cache(maxsize=1)
def small_model() -> Qwen35:
    tmp = tempfile.TemporaryDirectory(prefix="statecache-small-")
    _dirs.append(tmp)
    path = make_checkpoint(tmp.name, seed=7, **SHAPE)
    model = Qwen35(load_weights(path, LETTER_IDS, "cpu", torch.float32))
    assert model.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    return model


@functools.lru_cache(maxsize=1)
def small_runner() -> BatchRunner:
    """The batched runner over the small model (eager; one is enough: it keeps nothing between forwards)."""
    return BatchRunner(small_model(), TorchKernels(), max_slots=4, max_batch=16, max_pos=MAX_POS)


SMALL = {"mb": 64, "stride": 128, "tail": 16, "align": 64, "min_prefix": 64, "host_mb": 0}  # make_steps' cache


def cache_for(runner: BatchRunner, **settings) -> StateCache:
    """A state cache sized for `runner`'s states, of `settings` (CacheSettings fields over SMALL)."""
    return StateCache(CacheSettings(**{**SMALL, **settings}), "cpu", checkpoint_bytes=runner.st.checkpoint_bytes(),
                      position_bytes=runner.st.position_bytes())


def make_steps(cold_ok=None, *, runner: BatchRunner | None = None, cache: StateCache | None = None,
               budget_tokens: int = 1024, chunk_tokens: int = 256, **settings) -> Steps:
    """A step loop over `runner` (default: the small model's) with `cache` (default: a new one of `settings`)."""
    runner = runner if runner is not None else small_runner()
    cache = cache if cache is not None else cache_for(runner, **settings)
    return Steps(cache, runner, cold_ok if cold_ok is not None else PlantWhenItFits(), budget_tokens=budget_tokens,
                 chunk_tokens=chunk_tokens)


def checked(ids, state_len: int, slots, nopts) -> dict:
    """A row as the engine hands it to the step loop (ids an int64 array)."""
    return {"ids": np.asarray(list(ids), dtype=np.int64), "state_len": int(state_len), "slots": [int(x) for x in slots],
            "options": list(nopts)}


def run_rows(steps: Steps, rows, fresh: bool = False) -> list:
    """Rows (ids, state_len, slots, nopts) through `steps` to their end -> their Answers (or RowFailed), in order."""
    for i, r in enumerate(rows):
        steps.add(i, checked(*r), fresh=fresh)
    got: dict = {}
    while steps.pending():
        for key, ans in steps.step():
            got[key] = ans
    return [got[i] for i in range(len(rows))]


@functools.lru_cache(maxsize=1)
def _reference_steps() -> Steps:
    return make_steps(mb=0)


def reference(ids, slots, nopts) -> list[list[float]]:
    """The uncached answer: the whole row run from nothing through the step loop, no cache."""
    return run_rows(_reference_steps(), [(ids, 0, slots, nopts)], fresh=True)[0].probs


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert len(x) == len(y), (len(x), len(y))
    return max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y))


def assert_close(a: list[list[float]], b: list[list[float]], tol: float = TOL) -> None:
    d = max_diff(a, b)
    assert d <= tol, f"cached answer differs from the plain forward by {d:.3g} > {tol}"


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def down(x: int, align: int = 64) -> int:
    return x - x % align


def index_bytes_recount(cache: StateCache) -> int:
    """The index's bytes from scratch: each live checkpoint, plus each group that has one, once."""
    live = cache.index.lru_order()
    groups = {id(c.group): c.group for c in live}
    return sum(c.nbytes for c in live) + sum(g.nbytes for g in groups.values())


@contextmanager
def one_thread():
    """Tiny tensors run several times faster on one intra-op thread than on two (pool overhead dominates)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def answer_in_waves(eng, waves, after_step=None) -> list[dict]:
    """Each wave (rows, steps) is submitted to the engine's step loop, then that many steps run before the next wave
    comes (0: it joins at once); the last wave's rows are stepped to their end. Every row is answered exactly once:
    the results, in row order. after_step(): called after each of the waves' steps."""
    rows, got = [], {}

    def take(pairs) -> None:
        for tag, res in pairs:
            assert tag not in got
            got[tag] = res

    for batch, steps in waves:
        take(eng.submit(batch, list(range(len(rows), len(rows) + len(batch)))))
        rows += batch
        for _ in range(steps):
            take(eng.step())
            if after_step is not None:
                after_step()
    while eng.pending():
        take(eng.step())
    assert sorted(got) == list(range(len(rows)))
    return [got[i] for i in range(len(rows))]
