"""The `cold_ok` policy: may a new state (nothing saved to continue from) be planted now?

This is the one place that decides it. The engine (and the step scheduler, statecache.sched, when a new state's
first piece is granted) builds a `ColdContext` for each new state it is about to run and asks the policy once; yes:
the steps that compute the state plant its checkpoints (statecache.step); no: its rows run plain and nothing is
planted. The step loop only carries out the answer. An operator replaces
the default with any callable `(ColdContext) -> bool`, named by import path in the settings
(`load_policy("package.module:attr")`).

The default (`PlantWhenItFits`) declines only where planting cannot pay: the state's checkpoints and K/V
would not fit in the cache's device budget, or would take more than `max_share` of it, so holding it would evict
most of what is there, and (with a host tier) more than `max_share` of the host tier too: what a new state evicts
from the device moves to the host, and the state itself follows there, to be copied back when it is read. A backlog does not stop planting: every forward plants, so the next question about
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

    state_tokens: int  # tokens of the state: p, where its deepest checkpoint would sit (its state_len)
    state_bytes: int  # bytes its checkpoints and its K/V would take in the cache
    budget_bytes: int  # the cache's budget
    used_bytes: int  # bytes the cache holds now
    sharing_rows: int  # rows of this batch that share the state (the row itself included)
    batch_rows: int  # rows in the batch being run (the step loop: rows in its schedule, started or waiting)
    waiting_rows: int  # rows waiting behind this batch (the backlog the caller sees), 0 when unknown
    host_budget_bytes: int = 0  # the cache's host tier (0: none)


ColdPolicy = Callable[[ColdContext], bool]


@dataclass(frozen=True)
class PlantWhenItFits:
    """Plant every new state whose checkpoints fit in `max_share` of the device budget, or fit the device budget and
    `max_share` of the host tier; decline the rest."""

    max_share: float = 0.5

    def __call__(self, ctx: ColdContext) -> bool:
        if ctx.budget_bytes <= 0 or ctx.state_bytes > ctx.budget_bytes:
            return False
        return ctx.state_bytes <= self.max_share * max(ctx.budget_bytes, ctx.host_budget_bytes)


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
