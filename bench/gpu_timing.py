"""GPU timing helpers the bench scripts share: CUDA-graph replays timed with CUDA events (no launch overhead)."""

from __future__ import annotations

import statistics

import torch


def replay_median_ms(graph, reps: int = 20) -> float:
    """GPU milliseconds of one replay of a captured CUDA graph, median of reps (CUDA events)."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def graph_us(fns, calls: int | None = None, reps: int = 10) -> float:
    """GPU microseconds per call: `calls` calls (default: one each) cycling through fns, captured in one CUDA graph
    after a warm-up of each on a side stream (where compiling and autotuning happen); median of reps replays."""
    calls = calls or len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    return round(1000 * replay_median_ms(graph, reps) / calls, 2)
