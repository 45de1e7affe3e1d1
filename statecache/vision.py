"""The vision tower and what image rows hand the text model: embeddings at the image tokens, multimodal positions.

- `VisionTower`: transformers' own Qwen3.5 vision module (`Qwen3_5VisionModel`), built from the checkpoint's
  `vision_config` and loaded with its `model.visual.*` weights; image processor output in, one embedding per image
  token (after the patch merger) out.
- `Embeddings`: those embeddings by image content hash, LRU bounded in bytes, so the tower runs once per image,
  not once per row that shows it.
- `RowImages`: one row's images as the forward needs them: its multimodal positions [3, n] (statecache.images.
  positions), the token list the checkpoint index knows its state by, and for any chunk [s, e) either the
  rotary offset of its text tokens (position - index, the same for every text token after the last image before
  it; a chunk without image tokens needs nothing else, so it runs as the same CUDA graph as a text chunk) or its
  positions and image embeddings (a chunk holding image tokens runs eagerly). The embeddings are fetched only
  when such a chunk runs: a hit that restores a state past its images never runs the tower.
Knows nothing of the cache, the index or rows' text.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .images import ImageRef, ImageSupport, key_ids, positions


class VisionTower:
    """transformers' Qwen3_5VisionModel with a checkpoint's weights, on one device in one dtype."""

    def __init__(self, vision_config, state_dict: dict, device, dtype: torch.dtype):
        """vision_config: transformers' Qwen3_5VisionConfig; state_dict: its weights (names without `model.visual.`)."""
        from .checkpoints import hf_qwen3_5

        hf = hf_qwen3_5(kernels=None)  # the vision tower: no GDN layer
        self.model = hf.Qwen3_5VisionModel._from_config(vision_config, dtype=dtype)
        self.model.load_state_dict(state_dict, strict=True)
        self.model.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = torch.device(device), dtype
        self.out_hidden = vision_config.out_hidden_size

    @classmethod
    def from_checkpoint(cls, model_dir, device, dtype: torch.dtype) -> "VisionTower":
        """The tower of a checkpoint folder (conditional layout): its config's vision_config, its model.visual.*."""
        from safetensors import safe_open
        from transformers import Qwen3_5Config

        from .checkpoints import hf_qwen3_5

        hf_qwen3_5(kernels=None)  # before transformers' Qwen3.5 code is first imported another way
        model_dir = Path(model_dir)
        vcfg = Qwen3_5Config.from_pretrained(str(model_dir)).vision_config
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        pre = "model.visual."
        sd = {}
        for f in files:
            with safe_open(str(model_dir / f), framework="pt") as h:
                sd.update({k[len(pre):]: h.get_tensor(k) for k in h.keys() if k.startswith(pre)})
        return cls(vcfg, sd, device, dtype)

    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image: pixel_values [patches, C*t*p*p], grid (t, h, w) -> [tokens, out_hidden] in the model dtype."""
        thw = torch.tensor([grid], dtype=torch.long, device=self.device)
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=thw)
        if hasattr(out, "pooler_output"):  # transformers >= 5.x: the merger's output
            return out.pooler_output
        return out[0] if isinstance(out, (tuple, list)) else out


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
        before s moves the text after it by max(rows, columns) - its token count (statecache.images.positions)."""
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
