"""CUDA graph capture, shared by the chunk runner and the plain path.

`capture(fn, pool)` runs fn twice on a side stream (where lazy initialisation, fla's autotuning and torch.compile
happen, none of which may run inside a capture), then records one call as a CUDA graph whose memory comes from
`pool`. Graphs in one pool reuse each other's freed intermediates, which is safe because they replay one at a time
on one stream and each graph's output stays allocated. Knows nothing of what fn computes.
"""

from __future__ import annotations

import torch


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
