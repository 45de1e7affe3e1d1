"""Runs one chunk of one row from the static state buffers: eagerly (CPU), or as one CUDA graph replay.

Graphs are keyed by (bucketed chunk length, attention span) only; chunk start, real length, the specialists route,
the rotary shift (image rows: position - index of the chunk's text, 0 otherwise), answer slots and their option
counts live in device buffers read inside the graph, so one graph serves every row, position and route. A chunk
holding image tokens runs eagerly with its multimodal positions and image embeddings
(statecache.vision.RowImages.chunk), with its route like any other. With specialists the route's masked adapters
(statecache.specialists.lora's B_fixed) are prepared before each run, outside the graph, and only when the route
changed since the buffer was last masked (`StackedLora.hold_route`): a graph replay only reads them.
All graphs share one memory pool. Capturing runs the chunk twice to warm up, which overwrites the state buffers:
callers `ensure` every shape a row needs *before* restoring its checkpoint. A shape that fails to capture is
remembered as failed and reported through `ensure` (the row then takes the plain path).
This module knows nothing of checkpoints, rows' tokens beyond the chunk it is handed, or eviction.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from .graphs import MAX_OPTIONS, Staging, new_stats, pack_inputs, try_capture, wait_for_gpu
from .mixers import ChunkMixer, ChunkState
from .specialists.lora import FixedRoute

CHUNKS = (64, 128, 256, 512, 1024, 1536, 2048)  # chunk lengths a graph is captured for (bench/chunk_buckets.py)


def bucket(n: int, sizes) -> int | None:
    for b in sizes:
        if n <= b:
            return b
    return None


@dataclass
class _Graph:
    inp: torch.Tensor  # [input_size(L, max_slots, 4)] long: ids | slots | options | start | real | route | shift; one copy a run
    ids: torch.Tensor  # [L] long
    slots: torch.Tensor  # [max_slots] long, relative to the chunk start
    options: torch.Tensor  # [max_slots, MAX_OPTIONS] long (statecache.graphs.fill_options)
    start: torch.Tensor  # long scalar: the chunk's first position
    real: torch.Tensor  # long scalar: its real (unpadded) length
    route: torch.Tensor  # long [1]: the specialists route the adapter layers run with (0: the trunk)
    shift: torch.Tensor  # long scalar: rotary position - index of the chunk's tokens (image rows; else 0)
    out: torch.Tensor  # [max_slots, MAX_OPTIONS] float32 probabilities
    graph: "torch.cuda.CUDAGraph | None"
    staging: Staging | None = None  # the pinned host side of inp (graphs only)


class NotCaptured(Exception):
    """A chunk shape could not be captured as a CUDA graph."""


class ChunkRunner:
    def __init__(self, model, kernels, *, max_pos: int = 8192, span_step: int = 1024, max_slots: int = 4,
                 graphs: bool | None = None, pad: bool | None = None, chunks=CHUNKS, pool=None, specialists=None):
        self.model, self.kernels = model, kernels
        # specialists (statecache.specialists.Specialists | None): every chunk runs with the route in its inputs and
        # leaves its real tokens' router feature sum in `fsum` [H] (float32)
        self.spec = specialists
        if specialists is not None:  # fold the adapters into the weights now, before any graph is captured
            specialists.lora.attach(model.w)
        self.fsum = torch.zeros(model.cfg.hidden_size, device=model.device) if specialists is not None else None
        self.device = model.device
        self.use_graphs = (self.device.type == "cuda") if graphs is None else graphs
        self.pad = self.use_graphs if pad is None else (pad or self.use_graphs)  # bucket chunk lengths
        self.chunks = tuple(chunks)
        self.spans = tuple(range(span_step, max_pos + 1, span_step))
        self.max_pos = self.spans[-1]
        self.max_slots = max_slots
        self.st = ChunkState.allocate(model.cfg, self.max_pos, self.device, model.dtype)
        self.graphs: dict[tuple[int, int], _Graph | None] = {}
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.use_graphs else None  # shared with the plain path
        self.stats = new_stats()
        self.failures: list[str] = []
        self._out_host: torch.Tensor | None = None  # pinned landing place of `read`
        self.kv_owner: tuple[int, int] | None = None  # the cache's tag for the K/V the buffers hold; capture clears it

    @property
    def max_chunk(self) -> int:
        return self.chunks[-1]

    def shape(self, s: int, e: int) -> tuple[int, int] | None:
        """(chunk length, span) of chunk [s, e); None when it is longer than the largest chunk or span."""
        L = bucket(e - s, self.chunks) if self.pad else e - s
        if L is None or L > self.max_chunk or s + L > self.max_pos:
            return None
        # graphs are keyed by a bucketed span; eager chunks attend over exactly the keys they have
        return L, (bucket(s + L, self.spans) if self.pad else s + L)

    def split(self, s: int, e: int) -> list[int] | None:
        """The ends of chunks covering [s, e), each with a shape: [e] when it has one; else pieces of the largest
        chunk lengths whose padding still fits below max_pos. None when there is no way."""
        out = []
        while s < e:
            if self.shape(s, e) is not None:
                out.append(e)
                return out
            L = max((b for b in self.chunks if b <= e - s and s + b <= self.max_pos), default=None)
            if L is None:
                return None
            s += L
            out.append(s)
        return out

    # ---- the chunk forward ----------------------------------------------------------------------------------------

    def _forward(self, g: _Graph, L: int, span: int, mm=None) -> torch.Tensor:
        """mm: None, or (positions [3, L], embeds) for a chunk holding image tokens (eager only)."""
        mix = ChunkMixer(self.kernels, self.st, L, span, g.start, g.real)
        # the route's masked adapters are held before the forward (_hold), not masked inside it
        lora = None if self.spec is None else FixedRoute(self.spec.lora, self.spec.router, g.route, owner=self)
        if mm is None:
            h = self.model.body(g.ids, mix.pos + g.shift, mix, lora)  # [L, H]
        else:
            h = self.model.body(g.ids, mm[0], mix, lora, embeds=mm[1])
        if lora is not None:
            self.fsum.copy_((lora.f * mix.live[:, None]).sum(0))
        return self.model.option_probs(h.index_select(0, g.slots), g.options)  # [max_slots, MAX_OPTIONS]

    def _buffers(self, inp: torch.Tensor, L: int) -> _Graph:
        """The graph's views of its input buffer inp (see pack_inputs; on the device)."""
        S = self.max_slots
        ids, slots, options, scalars = torch.split(inp, [L, S, S * MAX_OPTIONS, 4])
        return _Graph(inp=inp, ids=ids, slots=slots, options=options.view(S, MAX_OPTIONS), start=scalars[0], real=scalars[1], route=scalars[2:3],
                      shift=scalars[3],
                      out=None, graph=None)

    def _capture(self, L: int, span: int) -> _Graph | None:
        """The shape's graph; None when it fails to capture (rows needing it take the plain path)."""
        self.kv_owner = None  # the warm-up runs overwrite the state buffers
        g = self._buffers(pack_inputs(L, self.max_slots, scalars=(0, L, 0, 0)).to(self.device), L)
        self._hold(0, g)  # the warm-up runs and the capture read B_fixed (their results are dropped)
        got = try_capture(lambda: self._forward(g, L, span), self.pool, self.stats, self.failures, f"chunk ({L}, {span})")
        if got is None:
            return None
        g.graph, g.out = got
        g.staging = Staging(g.inp)
        return g

    def _hold(self, route: int, g: _Graph) -> None:
        """Specialists: B_fixed holds `route` (g.route on the device) for this runner's next forward."""
        if self.spec is not None:
            self.spec.lora.hold_route(route, g.route, self)

    def ensure(self, chunks: list[tuple[int, int]]) -> bool:
        """Capture the graphs for these chunks [(s, e)] now (before any restore). False if one cannot be run."""
        for s, e in chunks:
            key = self.shape(s, e)
            if key is None:
                return False
            if not self.use_graphs:
                continue
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
            if self.graphs[key] is None:
                return False
        return True

    def precapture(self, progress=sys.stderr) -> dict:
        """Capture every (chunk, span) graph now, printing progress; returns the count and seconds spent."""
        t0 = time.perf_counter()
        keys = [(L, P) for P in self.spans for L in self.chunks if L <= P]
        for n, key in enumerate(keys, 1):
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
            if progress is not None:
                print(f"\rprecapture {n}/{len(keys)} graphs ({time.perf_counter() - t0:.1f} s)", end="", file=progress, flush=True)
        if progress is not None:
            print(file=progress)
        return {"graphs": sum(g is not None for g in self.graphs.values()), "seconds": round(time.perf_counter() - t0, 2),
                "failed": self.failures[:3]}

    def run(self, ids, s: int, e: int, slots=None, options=None, route: int = 0, images=None) -> torch.Tensor:
        """Chunk [s, e) of ids (an int64 numpy array or a list of ints) from the current state -> probabilities
        [max_slots, MAX_OPTIONS] at `slots` (absolute positions in [s, e)), over each slot's options (one spec per slot:
        an option count or token ids, statecache.graphs.fill_options); rows past len(slots) are padding.
        route: the specialists route the adapter layers run with (specialists only). images: the row's
        statecache.vision.RowImages, or None (a text row)."""
        key = self.shape(s, e)
        if key is None:
            raise NotCaptured(f"chunk [{s}, {e}) has no shape")
        L, span = key
        rel = [x - s for x in slots or ()]
        shift = images.shift(s) if images is not None else 0
        if images is not None and images.has_image(s, e):  # eagerly, with positions and embeddings
            inp = pack_inputs(L, self.max_slots, ids[s:e], rel, options or (), (s, e - s, route, shift))
            g = self._buffers(inp.to(self.device), L)
            self._hold(route, g)
            with torch.no_grad():
                return self._forward(g, L, span, images.chunk(s, e, L))
        if not self.use_graphs:
            inp = pack_inputs(L, self.max_slots, ids[s:e], rel, options or (), (s, e - s, route, shift))
            g = self._buffers(inp.to(self.device), L)
            self._hold(route, g)
            with torch.no_grad():
                return self._forward(g, L, span)
        g = self.graphs.get(key)
        if g is None:
            raise NotCaptured(f"no graph for {key}")
        g.staging.send(L, self.max_slots, ids[s:e], rel, options or (), (s, e - s, route, shift))
        self._hold(route, g)
        g.graph.replay()
        return g.out

    def read(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """The first n rows of a run's output on the host (float32), once the GPU is done: through a pinned buffer
        on CUDA (one asynchronous copy and a stream sync instead of a pageable copy)."""
        if out.device.type != "cuda":
            return out[:n].float()
        if self._out_host is None or self._out_host.shape != out.shape:
            self._out_host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
        self._out_host.copy_(out, non_blocking=True)
        wait_for_gpu(self.stats)
        return self._out_host[:n].clone()

    def reset_graphs(self) -> None:
        self.graphs.clear()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()
