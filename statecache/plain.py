"""The plain path: many rows packed into one variable-length forward (cu_seqlens), no checkpoints.

Highest throughput for rows with nothing to reuse. Rows are packed greedily up to `max_tokens` per forward.
Knows nothing of the cache, the memo or Redis.
"""

from __future__ import annotations

import torch

from .mixers import PackedMixer


class PlainPath:
    def __init__(self, model, kernels, max_tokens: int = 16384):
        self.model, self.kernels, self.max_tokens = model, kernels, max_tokens

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
    def forward(self, rows: list[tuple[list[int], list[int], list[int]]]) -> list[list[list[float]]]:
        """rows: (ids, slots, nopts) each -> per row, per slot, the option probabilities."""
        results: list = [None] * len(rows)
        for batch in self.batches([len(r[0]) for r in rows]):
            dev = self.model.device
            ids = torch.tensor([t for i in batch for t in rows[i][0]], dtype=torch.long)
            lens = [len(rows[i][0]) for i in batch]
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            pos = torch.cat([torch.arange(n) for n in lens])
            slot_idx = torch.tensor([starts[k] + s for k, i in enumerate(batch) for s in rows[i][1]], dtype=torch.long)
            nopts = torch.tensor([o for i in batch for o in rows[i][2]], dtype=torch.long)
            cu = torch.tensor(starts, dtype=torch.int32, device=dev)
            mix = PackedMixer(self.kernels, cu, max(lens))
            h = self.model.body(ids.to(dev), pos.to(dev), mix)  # [T, H]
            probs = self.model.letter_probs(h.index_select(0, slot_idx.to(dev)), nopts.to(dev)).float().cpu()
            j = 0
            for i in batch:
                _, slots, no = rows[i]
                results[i] = [probs[j + k, : no[k]].tolist() for k in range(len(slots))]
                j += len(slots)
        return results
