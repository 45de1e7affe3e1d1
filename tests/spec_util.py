"""The specialists oracle: transformers' Qwen3.5 plus peft (`PeftModel` with every route's adapter loaded, the trunk
with adapters disabled) and the router computed from transformers' ``output_hidden_states``. Rows with images pass
transformers' image inputs (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`) as keywords.

The router's weights are read back from the folder's files here (safetensors), not from statecache's loader, so a
mix-up in either shows as a disagreement.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from statecache.dev.checkpoints import load_reference


class SpecReference:
    def __init__(self, model_dir, spec_dir, letters: list[int]):
        from peft import PeftModel

        d = Path(spec_dir)
        meta = json.loads((d / "router.json").read_text())
        self.names, self.layer, self.eps = meta["routes"], meta["router_layer"], meta["eps"]
        rw = load_file(str(d / "router.safetensors"))
        self.w, self.b = rw["weight"].float(), rw["bias"].float()
        base = load_reference(model_dir)
        pm = PeftModel.from_pretrained(base, str(d / self.names[1]), adapter_name=self.names[1])
        for n in self.names[2:]:
            pm.load_adapter(str(d / n), adapter_name=n)
        self.pm = pm.eval()
        self.letters = letters
        self._memo: dict = {}

    def route(self, ids: list[int], **kw) -> int:
        with torch.no_grad(), self.pm.disable_adapter():
            hs = self.pm(input_ids=torch.tensor([ids]), output_hidden_states=True, **kw).hidden_states[self.layer][0].float()
        f = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + self.eps)
        return int((self.w @ f.mean(0) + self.b).argmax())

    def logits(self, ids: list[int], route: int, **kw) -> torch.Tensor:
        pv = kw.get("pixel_values")
        key = (tuple(ids), route, None if pv is None else hash(pv.numpy().tobytes()))
        if key not in self._memo:
            with torch.no_grad():
                if route == 0:
                    with self.pm.disable_adapter():
                        out = self.pm(input_ids=torch.tensor([ids]), **kw).logits[0]
                else:
                    self.pm.set_adapter(self.names[route])
                    out = self.pm(input_ids=torch.tensor([ids]), **kw).logits[0]
            self._memo[key] = out.float()
        return self._memo[key]

    def answers(self, ids, slots, nopts, route: int | None = None, **kw) -> tuple[int, list[list[float]]]:
        """(the route the router picks, or `route` when given; per slot the letter probabilities with that route).
        kw: transformers' image inputs for a row with images."""
        r = self.route(ids, **kw) if route is None else route
        full = self.logits(ids, r, **kw)
        from tests.oracle_util import option_ids

        return r, [torch.softmax(full[s, option_ids(self.letters, n)], -1).tolist() for s, n in zip(slots, nopts)]
