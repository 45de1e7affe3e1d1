"""What image rows hand the text model: embeddings at the image tokens, multimodal positions.

- `Embeddings`: the vision tower's (statecache.model.vision) embeddings by image content hash, LRU bounded in bytes,
  so the tower runs once per image, not once per row that shows it.
- `RowImages`: one row's images as the forward needs them: its multimodal positions [3, n] (statecache.rows.images.
  positions), the token list the checkpoint index knows its state by, and for any chunk [s, e) either the
  rotary offset of its text tokens (position - index, the same for every text token after the last image before
  it; a chunk without image tokens needs nothing else, so it runs as the same CUDA graph as a text chunk) or its
  positions and image embeddings (a chunk holding image tokens runs eagerly). The embeddings are fetched only
  when such a chunk runs: a hit that restores a state past its images never runs the tower.
Knows nothing of the cache, the index or rows' text.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from statecache.model.vision import VisionTower
from statecache.rows.images import ImageRef, ImageSupport, key_ids, positions


class Embeddings:
    """Image embeddings on the device by content hash (sha256), least recently used dropped beyond `max_bytes`."""

    def __init__(self, support: ImageSupport, tower: VisionTower, max_bytes: int = 512 * 2**20):
        self.support, self.tower, self.max_bytes = support, tower, max_bytes
        self._d: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.stats = {"vision_runs": 0, "embed_hits": 0}

    def get(self, ref: ImageRef) -> torch.Tensor:
        e = self._d.get(ref.digest)
        if e is not None:
            self._d.move_to_end(ref.digest)
            self.stats["embed_hits"] += 1
            return e
        pv, grid = self.support.pixels(ref.data)
        e = self.tower(pv, grid)
        if e.shape[0] != ref.n:
            raise RuntimeError(f"the vision tower gave {e.shape[0]} embeddings for an image of {ref.n} tokens")
        self.stats["vision_runs"] += 1
        self._d[ref.digest] = e
        self.bytes += e.numel() * e.element_size()
        while self.bytes > self.max_bytes and len(self._d) > 1:
            _, old = self._d.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return e

    def clear(self) -> None:
        self._d.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)


class RowImages:
    """One row's images (located ImageRefs, in order) for the forward; see the module docstring."""

    def __init__(self, ids: list[int], refs: list[ImageRef], embeddings: Embeddings, device):
        self.refs, self.emb, self.device = refs, embeddings, device
        self.n = len(ids)
        self.merge = embeddings.support.merge
        self._pos = None  # [3, n] int64 (numpy), made when a chunk holding image tokens first needs it
        self.keys = key_ids(ids, refs)
        self.digests = tuple(r.digest for r in refs)

    @property
    def pos(self):
        if self._pos is None:
            self._pos = positions(self.n, self.refs, self.merge)
        return self._pos

    def has_image(self, s: int, e: int) -> bool:
        return any(r.start < e and s < r.end for r in self.refs)

    def shift(self, s: int) -> int:
        """position - index of a text token at s (the rotary offset a chunk of text from s runs with): each image
        before s moves the text after it by max(rows, columns) - its token count (statecache.rows.images.positions)."""
        m = self.merge
        return sum(max(r.grid[1] // m, r.grid[2] // m) - r.n for r in self.refs if r.end <= s)

    def chunk(self, s: int, e: int, L: int):
        """Chunk [s, e) padded to L tokens -> (positions [3, L] long, (index [k] long, embeddings [k, H])) on the
        device; padding continues the positions. The index is relative to s."""
        pos = np.empty((3, L), dtype=np.int64)
        pos[:, : e - s] = self.pos[:, s:e]
        pos[:, e - s :] = self.pos[:, e - 1 : e] + np.arange(1, L - (e - s) + 1)
        idx, vals = [], []
        for r in self.refs:
            a, b = max(s, r.start), min(e, r.end)
            if a < b:
                idx.append(torch.arange(a - s, b - s))
                vals.append(self.emb.get(r)[a - r.start : b - r.start])
        index = torch.cat(idx).to(self.device) if idx else torch.empty(0, dtype=torch.long, device=self.device)
        values = torch.cat(vals) if vals else None
        return torch.from_numpy(pos).to(self.device), ((index, values) if values is not None else None)
