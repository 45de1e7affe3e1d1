"""The plain path: rows with nothing to reuse, no checkpoints.

Two forms:
- packed: many rows in one variable-length forward (cu_seqlens), greedily up to `max_tokens` per forward; the
  throughput form for a backed-up queue.
- single: one row alone, its tokens zero-padded to a multiple of `bucket` (everything is causal, so padding after
  the row changes nothing before it). On CUDA each (padded length, slot bucket) is one CUDA graph, captured on
  first use into one shared pool (or, by an engine that precaptures, at start-up for short rows only:
  `precapture`; then a shape without a graph runs packed), so a lone uncached row pays no Python or launch overhead.
  A shape that fails to capture is remembered and that row runs packed instead.
- planting: a row that leaves checkpoints is packed with the others (statecache.plant.PlantMixer splits the delta
  rule at its positions). `forwards` says which rows go together.
A row with images (a fourth item: its statecache.vision.RowImages) always runs packed (never single): its tokens take their multimodal positions and, at the image tokens, the vision tower's
embeddings; the other rows in the same forward keep their 1-D positions (expanded to three equal rows). It may
leave checkpoints like any other (statecache.plant.PlantMixer splits only the delta rule; the attention K/V it
keeps are rotated with the row's own multimodal positions).
With specialists every row picks its own route inside the forward (statecache.specialists.lora.RoutedRows: the
router reads the hidden state entering its layer, which no adapter touches), so one pass gives both the route
and the answer, and a packed forward may mix routes. Knows nothing of the cache, the memo or Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .graphs import MAX_OPTIONS, fill_options, n_options, new_stats, pack_inputs, try_capture
from .index import as_ids
from .mixers import PackedMixer
from .plant import Planted, PlantMixer
from .specialists.lora import RoutedRows

SLOT_BUCKETS = (4, 16, 64)  # answer slots a single-row graph has room for


@dataclass
class _Graph:
    inp: torch.Tensor  # [input_size(T, S, 1)] long: ids | slots | options | real length (statecache.graphs)
    out: torch.Tensor | None  # [S, MAX_OPTIONS] float32
    route: torch.Tensor  # [1] long: the row's specialists route (each replay rewrites it)
    graph: "torch.cuda.CUDAGraph | None"


class PlainPath:
    def __init__(self, model, kernels, max_tokens: int = 16384, *, graphs: bool | None = None, pad: bool | None = None,
                 bucket: int = 64, max_graph_tokens: int = 8192, pool=None, specialists=None,
                 between_layers: int = 4):
        self.model, self.kernels, self.max_tokens = model, kernels, max_tokens
        self.spec = specialists  # statecache.specialists.Specialists | None
        if specialists is not None:  # fold the adapters into the weights now, before any graph is captured
            specialists.lora.attach(model.w)
        self.use_graphs = (model.device.type == "cuda") if graphs is None else graphs
        self.pad = self.use_graphs if pad is None else (pad or self.use_graphs)  # single rows padded to `bucket`
        self.bucket, self.max_graph_tokens = bucket, max_graph_tokens
        self.graphs: dict[tuple[int, int], _Graph | None] = {}
        # capture a lone row's graph on its shape's first use; an engine that precaptured turns this off, so nothing
        # is captured while it serves (a shape never met runs packed instead)
        self.capture_on_demand = True
        self.between_layers = between_layers  # a packed forward calls `between` every this many layers (0: never)
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.use_graphs else None
        self.stats = new_stats()
        self.failures: list[str] = []

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices of rows packed greedily into forwards of at most max_tokens tokens (a longer row goes alone)."""
        out: list[list[int]] = []
        cur, tok = [], 0
        for i, n in enumerate(lengths):
            if cur and tok + n > self.max_tokens:
                out.append(cur)
                cur, tok = [], 0
            cur.append(i)
            tok += n
        if cur:
            out.append(cur)
        return out

    def forwards(self, rows: list[tuple]) -> list[list[int]]:
        """Indices of the rows each forward of `run` takes, in the order they run: packed greedily (`batches`)."""
        return self.batches([len(r[0]) for r in rows])

    def forward(self, rows: list[tuple]) -> list[list[list[float]]]:
        """rows: (ids, slots, options) or (ids, slots, options, images) each -> per row, per slot, the option
        probabilities. options: per slot an option count (the first letters) or its option token ids. images: None or the row's statecache.vision.RowImages."""
        return [probs for probs, _ in self.answer(rows)]

    def answer(self, rows: list[tuple]) -> list[tuple[list[list[float]], int | None]]:
        """rows: as `forward` -> per row (per slot the option probabilities, its specialists route or None without
        specialists)."""
        return self.run(rows)[0]

    @torch.no_grad()
    def run(self, rows: list[tuple], plans: list[list[int] | None] | None = None, between=None
            ) -> tuple[list[tuple[list[list[float]], int | None]], list[Planted | None]]:
        """rows: (ids, slots, options) or (ids, slots, options, images) each; plans: per row its checkpoint positions
        (ascending, in (0, len(ids)]) or None -> (per row (per slot the option probabilities, its route or None); per
        row its Planted, None where its plan was). Planting is trunk only: with specialists, plans must all be None.
        between: called every few layers of a packed forward (chunked prefill: the caller answers short work that
        arrived meanwhile)."""
        plans = plans if plans is not None else [None] * len(rows)
        if len(plans) != len(rows):
            raise ValueError(f"{len(plans)} plans for {len(rows)} rows")
        if self.spec is not None and any(pl is not None for pl in plans):
            raise ValueError("the packed forward plants only without specialists")
        results: list = [None] * len(rows)
        planted: list = [None] * len(rows)
        for batch in self.forwards(rows):
            text = _images(rows[batch[0]]) is None
            if len(batch) == 1 and self.pad and plans[batch[0]] is None and text:
                got = self._single(*rows[batch[0]][:3])
                if got is not None:
                    results[batch[0]] = got
                    continue
            self._packed(rows, batch, results, plans, planted, between)
            self.stats["packed_forwards"] = self.stats.get("packed_forwards", 0) + 1
        return results, planted

    # ---- packed ---------------------------------------------------------------------------------------------------

    def _packed(self, rows, batch: list[int], results: list, plans=None, planted=None, between=None) -> None:
        dev = self.model.device
        ids = torch.from_numpy(np.concatenate([as_ids(rows[i][0]) for i in batch]))  # lists or int64 arrays
        lens = [len(rows[i][0]) for i in batch]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        pos = torch.cat([torch.arange(n) for n in lens])
        embeds = None
        if any(_images(rows[i]) is not None for i in batch):  # multimodal positions [3, T], image embeddings
            pos = pos.expand(3, -1).clone()
            idx, vals = [], []
            for k, i in enumerate(batch):
                if (im := _images(rows[i])) is not None:
                    p3, e = im.chunk(0, lens[k], lens[k])
                    pos[:, starts[k] : starts[k + 1]] = p3.cpu()
                    if e is not None:
                        idx.append(e[0] + starts[k])
                        vals.append(e[1])
            embeds = (torch.cat(idx).to(dev), torch.cat(vals)) if idx else None
        slot_idx = torch.tensor([starts[k] + s for k, i in enumerate(batch) for s in rows[i][1]], dtype=torch.long)
        specs = [o for i in batch for o in rows[i][2]]
        options = np.empty((len(specs), MAX_OPTIONS), dtype=np.int64)
        fill_options(options, specs)
        cu = torch.tensor(starts, dtype=torch.int32, device=dev)
        if plans is not None and any(plans[i] is not None for i in batch):
            cfg = self.model.cfg
            mix = PlantMixer(self.kernels, cu, lens, [plans[i] for i in batch], len(cfg.linear_layers),
                             len(cfg.full_layers))
        else:
            mix = PackedMixer(self.kernels, cu, max(lens))
        if between is not None and self.between_layers > 0:
            mix.every_layers, mix.layers_every = between, self.between_layers
        lora = None
        if self.spec is not None:
            seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
            lora = RoutedRows(self.spec.lora, self.spec.router, seq, None, len(lens))
        h = self.model.body(ids.to(dev), pos.to(dev), mix, lora, embeds=embeds)  # [T, H]
        probs = self.model.option_probs(h.index_select(0, slot_idx.to(dev)), torch.from_numpy(options).to(dev)).float().cpu()
        routes = lora.routes.tolist() if lora is not None else [None] * len(batch)
        j = 0
        for k_row, i in enumerate(batch):
            slots, no = rows[i][1], rows[i][2]
            results[i] = ([probs[j + k, : n_options(no[k])].tolist() for k in range(len(slots))], routes[k_row])
            j += len(slots)
        if isinstance(mix, PlantMixer):
            for i, pl in zip(batch, mix.planted):
                planted[i] = pl

    # ---- single, padded (one CUDA graph per shape) ----------------------------------------------------------------

    def shape(self, n: int, n_slots: int) -> tuple[int, int] | None:
        """(padded length, slot bucket) of a lone row; None when it is too long or has too many slots."""
        T = -(-n // self.bucket) * self.bucket
        S = next((b for b in SLOT_BUCKETS if n_slots <= b), None)
        if T > self.max_graph_tokens or S is None:
            return None
        return T, S

    def _run(self, inp: torch.Tensor, T: int, S: int, route: torch.Tensor) -> torch.Tensor:
        ids, slots, options, real = torch.split(inp, [T, S, S * MAX_OPTIONS, 1])
        dev = inp.device
        cu = torch.arange(0, 2 * T, T, dtype=torch.int32, device=dev)  # [0, T], made on the device (graph-safe)
        lora = None
        if self.spec is not None:  # one row: every token is in row 0; padding does not count towards its route
            ar = torch.arange(T, device=dev)
            lora = RoutedRows(self.spec.lora, self.spec.router, torch.zeros_like(ar), ar < real, 1)
        h = self.model.body(ids, torch.arange(T, device=dev), PackedMixer(self.kernels, cu, T), lora)  # [T, H]
        if lora is not None:
            route.copy_(lora.routes)
        return self.model.option_probs(h.index_select(0, slots), options.view(S, MAX_OPTIONS))  # [S, MAX_OPTIONS]

    def _capture(self, T: int, S: int) -> _Graph | None:
        """The shape's graph; None when it fails to capture (rows of this shape then run packed)."""
        dev = self.model.device
        g = _Graph(inp=pack_inputs(T, S, scalars=(T,)).to(dev), out=None, graph=None,
                   route=torch.zeros(1, dtype=torch.long, device=dev))
        got = try_capture(lambda: self._run(g.inp, T, S, g.route), self.pool, self.stats, self.failures, f"plain ({T}, {S})")
        if got is None:
            return None
        g.graph, g.out = got
        return g

    def precapture(self, max_tokens: int = 512, slot_buckets=(SLOT_BUCKETS[0],)) -> dict:
        """Capture the lone-row graphs of short rows now (padded lengths up to max_tokens, the given slot buckets):
        where a graph saves most (a short row run eagerly is host-bound); longer lone rows run packed once
        `capture_on_demand` is off. Returns the counts and seconds spent."""
        t0 = time.perf_counter()
        if self.use_graphs:
            for T in range(self.bucket, min(max_tokens, self.max_graph_tokens) + 1, self.bucket):
                for S in slot_buckets:
                    if (T, S) not in self.graphs:
                        self.graphs[(T, S)] = self._capture(T, S)
        return {"graphs": sum(g is not None for g in self.graphs.values()), "seconds": round(time.perf_counter() - t0, 2)}

    def _single(self, ids, slots, options) -> tuple[list[list[float]], int | None] | None:
        key = self.shape(len(ids), len(slots))
        if key is None:
            return None
        T, S = key
        inp = pack_inputs(T, S, ids, slots, options, (len(ids),))
        if self.use_graphs:
            if key not in self.graphs:
                if not self.capture_on_demand:  # serving: no capture stalls; the row runs packed (eagerly)
                    return None
                self.graphs[key] = self._capture(T, S)
            g = self.graphs[key]
            if g is None:
                return None
            g.inp.copy_(inp)  # from pageable memory: the host tensor may go as soon as this returns
            g.graph.replay()
            if self.spec is not None:  # the replay masked B_fixed with the row's route, unseen by the host
                self.spec.lora.forget_route()
            out, route = g.out, g.route
        else:
            route = torch.zeros(1, dtype=torch.long, device=self.model.device)
            out = self._run(inp.to(self.model.device), T, S, route)
        probs = out[: len(slots)].float().cpu()
        return [probs[k, : n_options(options[k])].tolist() for k in range(len(slots))], (int(route) if self.spec is not None else None)


def _images(row: tuple):
    return row[3] if len(row) > 3 else None
