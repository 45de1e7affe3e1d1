"""Specialists: routed LoRA adapters over the trunk model.

A router reads the hidden state entering `router_layer` and picks a route for the whole row; route 0 is the
trunk, every other route runs the layers from `split` (the first adapted layer) with its own PEFT LoRA adapter.
- `folder`: the on-disk format (router.json, router.safetensors, one PEFT adapter folder per route), its checks
  and loading (`load_specialists`, `SpecialistsError`);
- `lora`: every route's adapters per fused projection (A folded into the model's projection weights, B stacked)
  and the per-forward bindings that do the model's adapted projections;
Random specialists folders written by peft itself (tests, the tiny model, benchmarks) are statecache.dev.specialists.
The step loop's use of routes (guess, rerun on a misprediction, route-aware checkpoints) is statecache.step's.
"""

from statecache.model.specialists.folder import Router, Specialists, SpecialistsError, load_specialists, site_modules
from statecache.model.specialists.lora import StackedLora, TokenRoutes

__all__ = ["Router", "Specialists", "SpecialistsError", "StackedLora", "TokenRoutes",
           "load_specialists", "site_modules"]
