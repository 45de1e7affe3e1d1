"""The `cold_ok` policy: may a new state (nothing saved to continue from) be planted now?

This is the one place that decides it. The engine builds a `ColdContext` for each new state it is about to
run and asks the policy once; yes: the state's first row runs in the batch's packed forward, which plants its
checkpoints (statecache.plant); no: its rows run plain and nothing is planted. The cache and the plain path
only carry out the answer. An operator replaces
the default with any callable `(ColdContext) -> bool`, named by import path in the settings
(`load_policy("package.module:attr")`).

The default (`PlantWhenItFits`) declines only where planting cannot pay: the state's checkpoints and K/V
would not fit in the cache's budget (or would take more than `max_share` of it, so holding it would evict
most of what is there). A backlog does not stop planting: every forward plants, so the next question about
the same state finds it.

Knows nothing of the model, tensors, Redis or the worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ColdContext:
    """What the engine knows about one new state when it asks the policy."""

    state_tokens: int  # tokens of the state (the row's state_len rounded down to the cache's alignment)
    state_bytes: int  # bytes its checkpoints and its K/V would take in the cache
    budget_bytes: int  # the cache's budget
    used_bytes: int  # bytes the cache holds now
    sharing_rows: int  # rows of this batch that share the state (the row itself included)
    batch_rows: int  # rows in the batch being run
    waiting_rows: int  # rows waiting behind this batch (the backlog the caller sees), 0 when unknown


ColdPolicy = Callable[[ColdContext], bool]


@dataclass(frozen=True)
class PlantWhenItFits:
    """Plant every new state whose checkpoints fit in `max_share` of the budget; decline the rest."""

    max_share: float = 0.5

    def __call__(self, ctx: ColdContext) -> bool:
        return ctx.budget_bytes > 0 and ctx.state_bytes <= self.max_share * ctx.budget_bytes


def load_policy(path: str | None) -> ColdPolicy:
    """The policy named by `path` ("module:attr", an object or a class to instantiate with no arguments);
    the default `PlantWhenItFits()` when `path` is empty."""
    if not path:
        return PlantWhenItFits()
    module_name, _, attrs = path.partition(":")
    if not attrs:
        raise ValueError(f"cold_ok policy {path!r}: expected 'package.module:attr'")
    obj = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise ValueError(f"cold_ok policy {path!r} is not callable")
    return obj
