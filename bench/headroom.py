"""Headroom of the eviction policy: tokens reused by LRU beside Belady's offline choice, the same bytes, one tier.

    python bench/headroom.py [--agents 32] [--rows 1500] [--mb 5] [--host-mb 0] [--seed 0] [--json FILE]

The trace is bench/load_bench.py's `AgentTrace`, agents taking turns (`interleaved`: the order a closed loop of
agents with equal think times gives; a real run's order is close to it, not equal). Each row runs through a real
statecache.cache.index.CheckpointIndex as statecache.cache.store drives it: the deepest token-exact checkpoint is restored, the
positions of statecache.cache.index.plan_chunks from there (with the fork point, `shared_depth`) are planted as one group
whose attention K/V of [0, p) counts once, bytes per checkpoint and per K/V position of the built-in tiny model
(statecache.cache.budget, float32); then the budget is enforced. Policies:
- `lru`: the index as it is (its least recently used checkpoint goes first);
- `belady`: the checkpoint whose tokens [0, pos) the trace asks for again farthest in the future goes first (never
  again: first of all): the offline choice, with the trace's future known;
- `unbounded`: no budget (the reference; load_bench's `unbounded_reuse` is the same figure);
- with --host-mb, `lru+host`: the two-tier index (device LRU into a host tier of that size).
Reported: tokens reused (share of the state tokens) per policy. Belady's rule is optimal for equal sizes and one
access per key; with groups shared by their checkpoints and a row served by its deepest match it is the usual
offline estimate, not a proven bound.

Knows the index, the planner and the sizes; no model, no torch at run time beyond the configuration.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.load_bench import AgentTrace  # noqa: E402
from statecache.cache.budget import checkpoint_bytes, kv_bytes  # noqa: E402
from statecache.cache.index import CheckpointIndex, plan_chunks  # noqa: E402

ALIGN, STRIDE, TAIL, MAX_CHUNK = 64, 2048, 16, 2048


def prefix_keys(ids: np.ndarray, upto: int) -> list[bytes]:
    """A key for ids[:k] at every aligned k <= upto (the same chained hash for the same tokens)."""
    raw, step, h, out = ids[:upto].tobytes(), 8 * ALIGN, 0, []
    for j in range(upto // ALIGN):
        h = hash((h, raw[j * step : (j + 1) * step]))
        out.append(h)
    return out


class BeladyIndex(CheckpointIndex):
    """The index with Belady's victim: the checkpoint whose prefix is next asked for farthest in the future."""

    def __init__(self, *a, uses: dict, **kw):
        super().__init__(*a, **kw)
        self.uses, self.now = uses, 0

    def _next_use(self, c) -> float:
        times = self.uses.get(c.payload, ())
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else float("inf")

    def _victim(self, lru):
        return max(lru, key=self._next_use)


def run(rows, policy: str, budget: int, host: int, ckpt_b: int, kv_pos_b: int, uses: dict) -> dict:
    if policy == "belady":
        ix = BeladyIndex(budget, align=ALIGN, uses=uses)
    else:
        ix = CheckpointIndex(10**18 if policy == "unbounded" else budget, align=ALIGN,
                             host_budget_bytes=host if policy == "lru+host" else 0)
    reused = total = 0
    for t, (ids, state_len, keys) in enumerate(rows):
        if isinstance(ix, BeladyIndex):
            ix.now = t
        p = state_len - state_len % ALIGN
        best = ix.lookup(ids, limit=p)
        if best is not None and best.tier != 0 and not ix.promote(best):
            best = ix.lookup(ids, limit=p, host=False)
        c0 = best.pos if best is not None else 0
        reused += c0
        total += p
        if best is not None:
            ix.touch(best)
        x = ix.shared_depth(ids, p)
        ends = plan_chunks(c0, state_len, stride=STRIDE, tail=TAIL, align=ALIGN, max_chunk=MAX_CHUNK,
                           extra=(x,) if c0 < x < p else ())
        if ends:
            g = ix.add_group(ids[:p], None, p * kv_pos_b)
            for e in ends:
                ix.add_checkpoint(g, e, keys[e // ALIGN - 1], ckpt_b)  # payload: the prefix's key (Belady reads it)
        ix.evict()
    return {"tokens_reused": reused, "state_tokens": total, "share": round(reused / max(1, total), 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1500)
    ap.add_argument("--mb", type=float, default=5.0, help="the device budget, MiB")
    ap.add_argument("--host-mb", type=float, default=0.0, help="also run LRU with a host tier of this size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-state", type=int, default=2000)
    ap.add_argument("--max-state", type=int, default=6000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from statecache.dev.tiny import tiny_model_dir
    from statecache.model.config import load_config

    cfg = load_config(tiny_model_dir())
    ckpt_b, kv_pos_b = checkpoint_bytes(cfg, 4), kv_bytes(cfg, 1, 4)
    trace = AgentTrace(a.agents, a.seed, (0, cfg.vocab_size), a.min_state, a.max_state)
    rows, uses = [], {}
    for t, r in enumerate(trace.interleaved(a.rows)):
        ids = np.asarray(r.ids, dtype=np.int64)
        p = r.state_len - r.state_len % ALIGN
        keys = prefix_keys(ids, p)
        for k in keys:
            uses.setdefault(k, []).append(t)
        rows.append((ids, r.state_len, keys))
    budget, host = int(a.mb * 2**20), int(a.host_mb * 2**20)
    policies = ["unbounded", "lru", "belady"] + (["lru+host"] if host else [])
    out = {"agents": a.agents, "rows": a.rows, "mb": a.mb, "host_mb": a.host_mb, "seed": a.seed,
           "checkpoint_bytes": ckpt_b, "kv_bytes_per_token": kv_pos_b,
           **{pol: run(rows, pol, budget, host, ckpt_b, kv_pos_b, uses) for pol in policies}}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
