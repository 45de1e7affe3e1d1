"""CUDA graph capture and graph inputs, shared by the chunk runner and the plain path.

`capture(fn, pool)` runs fn twice on a side stream (where lazy initialisation, fla's autotuning and torch.compile
happen, none of which may run inside a capture), then records one call as a CUDA graph whose memory comes from
`pool`. Graphs in one pool reuse each other's freed intermediates, which is safe because they replay one at a time
on one stream and each graph's output stays allocated. `try_capture` counts, times and logs captures and turns a
failure into None. `pack_inputs` lays out a graph's one input buffer. Knows nothing of what fn computes.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("statecache.graphs")


def capture(fn, pool, warmup: int = 2):
    """-> (graph, fn's output as captured: the tensors each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        out = fn()
    return graph, out


def new_stats() -> dict:
    return {"captures": 0, "capture_s": 0.0, "capture_failed": 0}


def try_capture(fn, pool, stats: dict, failures: list[str], what: str):
    """capture(fn, pool), counted in stats (see new_stats); None when it fails, the reason logged and appended to
    failures (the caller then runs that shape another way)."""
    t0 = time.perf_counter()
    try:
        return capture(fn, pool)
    except Exception as e:  # noqa: BLE001 - the shape stays uncaptured
        torch.cuda.synchronize()
        failures.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
        log.warning("CUDA graph %s failed to capture", failures[-1])
        stats["capture_failed"] += 1
        return None
    finally:
        stats["captures"] += 1
        stats["capture_s"] += time.perf_counter() - t0


def pack_inputs(L: int, S: int, ids=(), slots=(), nopts=(), scalars=()) -> torch.Tensor:
    """One host tensor [L + 2 * S + len(scalars)] (long): ids zero-padded to L | slots | option counts (2 past the
    real slots) | scalars (the chunk runner's start and real length). ids may be a list or an int64 numpy array."""
    inp = torch.zeros(L + 2 * S + len(scalars), dtype=torch.long)
    inp[: len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    inp[L + S : L + 2 * S] = 2
    inp[L : L + len(slots)] = torch.as_tensor(slots, dtype=torch.long)
    inp[L + S : L + S + len(nopts)] = torch.as_tensor(nopts, dtype=torch.long)
    inp[L + 2 * S :] = torch.as_tensor(scalars, dtype=torch.long)
    return inp
