"""The plain path: rows with nothing to reuse, no checkpoints.

Two forms:
- packed: many rows in one variable-length forward (cu_seqlens), greedily up to `max_tokens` per forward; the
  throughput form for a backed-up queue.
- single: one row alone, its tokens zero-padded to a multiple of `bucket` (everything is causal, so padding after
  the row changes nothing before it). On CUDA each (padded length, slot bucket) is one CUDA graph, captured on
  first use into one shared pool, so a lone uncached row pays no Python or launch overhead. A shape that fails
  to capture is remembered and that row runs packed instead.
A row with images (a fourth item: its statecache.vision.RowImages) always runs packed: its tokens take their
multimodal positions and, at the image tokens, the vision tower's embeddings; the other rows in the same forward
keep their 1-D positions (expanded to three equal rows).
Knows nothing of the cache, the memo or Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .graphs import new_stats, pack_inputs, try_capture
from .mixers import PackedMixer

SLOT_BUCKETS = (4, 16, 64)  # answer slots a single-row graph has room for


@dataclass
class _Graph:
    inp: torch.Tensor  # [T + 2 * S] long: ids | slots | nopts
    out: torch.Tensor | None  # [S, n_letters] float32
    graph: "torch.cuda.CUDAGraph | None"


class PlainPath:
    def __init__(self, model, kernels, max_tokens: int = 16384, *, graphs: bool | None = None, pad: bool | None = None,
                 bucket: int = 64, max_graph_tokens: int = 8192, pool=None):
        self.model, self.kernels, self.max_tokens = model, kernels, max_tokens
        self.use_graphs = (model.device.type == "cuda") if graphs is None else graphs
        self.pad = self.use_graphs if pad is None else (pad or self.use_graphs)  # single rows padded to `bucket`
        self.bucket, self.max_graph_tokens = bucket, max_graph_tokens
        self.graphs: dict[tuple[int, int], _Graph | None] = {}
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

    @torch.no_grad()
    def forward(self, rows: list[tuple]) -> list[list[list[float]]]:
        """rows: (ids, slots, nopts) or (ids, slots, nopts, images) each -> per row, per slot, the option
        probabilities. images: None or the row's statecache.vision.RowImages."""
        results: list = [None] * len(rows)
        for batch in self.batches([len(r[0]) for r in rows]):
            if len(batch) == 1 and self.pad and _images(rows[batch[0]]) is None:
                got = self._single(*rows[batch[0]])
                if got is not None:
                    results[batch[0]] = got
                    continue
            self._packed(rows, batch, results)
        return results

    # ---- packed ---------------------------------------------------------------------------------------------------

    def _packed(self, rows, batch: list[int], results: list) -> None:
        dev = self.model.device
        ids = torch.tensor([t for i in batch for t in rows[i][0]], dtype=torch.long)
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
        nopts = torch.tensor([o for i in batch for o in rows[i][2]], dtype=torch.long)
        cu = torch.tensor(starts, dtype=torch.int32, device=dev)
        mix = PackedMixer(self.kernels, cu, max(lens))
        h = self.model.body(ids.to(dev), pos.to(dev), mix, embeds)  # [T, H]
        probs = self.model.letter_probs(h.index_select(0, slot_idx.to(dev)), nopts.to(dev)).float().cpu()
        j = 0
        for i in batch:
            slots, no = rows[i][1], rows[i][2]
            results[i] = [probs[j + k, : no[k]].tolist() for k in range(len(slots))]
            j += len(slots)

    # ---- single, padded (one CUDA graph per shape) ----------------------------------------------------------------

    def shape(self, n: int, n_slots: int) -> tuple[int, int] | None:
        """(padded length, slot bucket) of a lone row; None when it is too long or has too many slots."""
        T = -(-n // self.bucket) * self.bucket
        S = next((b for b in SLOT_BUCKETS if n_slots <= b), None)
        if T > self.max_graph_tokens or S is None:
            return None
        return T, S

    def _run(self, inp: torch.Tensor, T: int, S: int) -> torch.Tensor:
        ids, slots, nopts = torch.split(inp, [T, S, S])
        dev = inp.device
        cu = torch.arange(0, 2 * T, T, dtype=torch.int32, device=dev)  # [0, T], made on the device (graph-safe)
        h = self.model.body(ids, torch.arange(T, device=dev), PackedMixer(self.kernels, cu, T))  # [T, H]
        return self.model.letter_probs(h.index_select(0, slots), nopts)  # [S, n_letters]

    def _capture(self, T: int, S: int) -> _Graph | None:
        """The shape's graph; None when it fails to capture (rows of this shape then run packed)."""
        g = _Graph(inp=pack_inputs(T, S).to(self.model.device), out=None, graph=None)
        got = try_capture(lambda: self._run(g.inp, T, S), self.pool, self.stats, self.failures, f"plain ({T}, {S})")
        if got is None:
            return None
        g.graph, g.out = got
        return g

    def _single(self, ids, slots, nopts) -> list[list[float]] | None:
        key = self.shape(len(ids), len(slots))
        if key is None:
            return None
        T, S = key
        inp = pack_inputs(T, S, ids, slots, nopts)
        if self.use_graphs:
            if key not in self.graphs:
                self.graphs[key] = self._capture(T, S)
            g = self.graphs[key]
            if g is None:
                return None
            g.inp.copy_(inp)  # from pageable memory: the host tensor may go as soon as this returns
            g.graph.replay()
            out = g.out
        else:
            out = self._run(inp.to(self.model.device), T, S)
        probs = out[: len(slots)].float().cpu()
        return [probs[k, : nopts[k]].tolist() for k in range(len(slots))]


def _images(row: tuple):
    return row[3] if len(row) > 3 else None
