"""The vision tower: transformers' own Qwen3.5 vision module (`Qwen3_5VisionModel`), built from the checkpoint's
`vision_config` and loaded with its `model.visual.*` weights; image processor output in, one embedding per image
token (after the patch merger) out. What image rows hand the text model (embeddings by content hash, multimodal
positions, chunks) is statecache.run.images. Knows nothing of rows, the cache or the text model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class VisionTower:
    """transformers' Qwen3_5VisionModel with a checkpoint's weights, on one device in one dtype."""

    def __init__(self, vision_config, state_dict: dict, device, dtype: torch.dtype):
        """vision_config: transformers' Qwen3_5VisionConfig; state_dict: its weights (names without `model.visual.`)."""
        from statecache.model.hf import hf_qwen3_5

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

        from statecache.model.hf import hf_qwen3_5

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
