"""CUDA graph capture and graph inputs, for the batched runner's graphs (statecache.run.batch).

`capture(fn, pool)` runs fn once on a side stream (where lazy initialisation, Triton's autotuning and torch.compile
happen, none of which may run inside a capture: each happens on the first call of a shape, a recompile for a new
token count included), then records one call as a CUDA graph whose memory comes from
`pool`. Graphs in one pool reuse each other's freed intermediates, which is safe because they replay one at a time
on one stream and each graph's output stays allocated. `try_capture` counts, times and logs captures and turns a
failure into None. `fill_options` lays out the answer slots' options; `Staging` is a graph's pinned input copy.
Knows nothing of what fn computes.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

# option tokens a slot may read (the letters A..Z): the row contract's bound
from statecache.rows.contract import MAX_OPTIONS

log = logging.getLogger("statecache.run.graphs")


_SIDE: dict = {}


def side_stream() -> "torch.cuda.Stream":
    """The one stream every capture's warm-up runs on (per device). The caching allocator keeps freed blocks for
    reuse on the stream that used them: a new side stream per capture left each capture's warm-up memory reserved
    for good (63 graphs of up to 8k tokens, in session 10, held ~60 GiB that the cache's budget then lacked)."""
    dev = torch.cuda.current_device()
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream()
    return _SIDE[dev]


def capture(fn, pool, warmup: int = 1):
    """-> (graph, fn's output as captured: the tensors each replay rewrites). One warm-up call: what is lazy happens on
    a shape's first call, and a second call doubled start-up's graph time (s53_run1, H200, 9B shape: 64 ms a graph
    against 141 with two; bench/README.md)."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the host tier's grower (statecache.cache.tiers) may pin memory on its own thread meanwhile, which the
    # default ("global") mode would count against this capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), torch.no_grad():
        out = fn()
    return graph, out


def new_stats() -> dict:
    """A graph owner's counters: captures, their seconds and failures; `gpu_wait_s`, the host's seconds blocked
    waiting for the GPU to finish the owner's forwards (what a row's time is beyond its host work)."""
    return {"captures": 0, "capture_s": 0.0, "capture_failed": 0, "gpu_wait_s": 0.0}


def wait_for_gpu(stats: dict) -> None:
    """Block until the current stream is done, counting the seconds in stats["gpu_wait_s"]."""
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    stats["gpu_wait_s"] += time.perf_counter() - t0


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




def n_options(spec) -> int:
    """How many options a slot spec (an option count, or a sequence of option token ids) has."""
    return int(spec) if isinstance(spec, (int, np.integer)) else len(spec)


def fill_options(out: np.ndarray, options) -> None:
    """Write slots' option specs into out [S, MAX_OPTIONS] (int64), what Qwen35.option_probs reads on the device: a
    count k reads the model's first k letters (written -2 - j for letter j, so the host need not know their ids), a
    sequence its own token ids; -1 past a slot's options; slots past len(options) read two (no NaN in padding)."""
    out[:] = -1
    out[len(options):, :2] = (-2, -3)
    for j, spec in enumerate(options):
        if isinstance(spec, (int, np.integer)):
            out[j, :spec] = _LETTER_CODES[:spec]
        else:
            out[j, : len(spec)] = spec


_LETTER_CODES = -2 - np.arange(MAX_OPTIONS)


class Staging:
    """A pinned host copy of a graph's input buffer, so each run's inputs go over in one asynchronous copy. Before
    it is rewritten, the host waits for its previous copy to have left (only a back-to-back run of the same graph,
    queued behind other GPU work, ever waits): statecache.run.batch.BatchRunner._send."""

    def __init__(self, dev_buf: torch.Tensor):
        cuda = dev_buf.device.type == "cuda"  # else (the CPU tests' stand-in graphs) a plain synchronous copy
        self.dev = dev_buf
        self.host = torch.empty(dev_buf.shape, dtype=dev_buf.dtype, pin_memory=cuda)
        self.np = self.host.numpy()
        self.sent = torch.cuda.Event() if cuda else None
        if self.sent is not None:
            self.sent.record()
