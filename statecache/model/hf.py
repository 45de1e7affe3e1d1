"""transformers' Qwen3.5 modelling module, imported once per process with or without fla's kernels.

statecache's own forward does not use it: the vision tower (statecache.model.vision) builds transformers' module
from it, and the tests, benches and random checkpoints (statecache.dev.checkpoints) use transformers as the oracle.
Knows nothing of rows, the cache or statecache's own forward.
"""

from __future__ import annotations

import importlib
import sys

_HF_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
# Packages transformers' Qwen3.5 code dispatches to when it can import them; both need CUDA (fla also Triton).
_KERNEL_PACKAGES = ("fla", "causal_conv1d")

_bound_to_kernels: bool | None = None  # what hf_qwen3_5 imported that module with (None: not imported by it)


def hf_qwen3_5(kernels: bool | None = False):
    """Import and return transformers' Qwen3.5 modelling module; every import of it in statecache goes through here.

    transformers binds its GDN and conv implementations when that module is first imported: fla's Triton kernels
    (and causal_conv1d) when they import, its own torch code otherwise; the choice holds for the whole process.
    fla's kernels cannot read CPU tensors, so on a GPU host with fla installed a CPU forward through them fails.
    - ``kernels=False`` (default; for forwards on CPU tensors: ``load_reference``, the specialists' router, the
      tests' oracle): fla and causal_conv1d are hidden while that module is imported (``sys.modules[name] = None``,
      restored after: the GPU suite's comparisons still import fla), so transformers takes its torch code;
    - ``kernels=True`` (for transformers on the GPU, the benchmarks' baseline): its kernels where they import;
    - ``kernels=None`` (no GDN forward: building and saving a model, the vision tower): the module as imported,
      else as for ``False``.
    Asking for ``True`` or ``False`` after the module was imported the other way raises (it cannot be undone).
    """
    global _bound_to_kernels
    module = sys.modules.get(_HF_MODELING)
    if module is not None:
        if kernels is not None and _bound_to_kernels is not None and kernels != _bound_to_kernels:
            raise RuntimeError(
                f"transformers' Qwen3.5 code was imported {'with' if _bound_to_kernels else 'without'} fla's kernels "
                f"in this process; hf_qwen3_5(kernels={kernels}) cannot change that (run it in a process of its own)")
        return module
    if kernels:
        module = importlib.import_module(_HF_MODELING)
        _bound_to_kernels = True
        return module
    saved = {name: sys.modules[name] for name in _KERNEL_PACKAGES if name in sys.modules}
    try:
        for name in _KERNEL_PACKAGES:
            sys.modules[name] = None
        module = importlib.import_module(_HF_MODELING)
        _bound_to_kernels = False
        return module
    finally:
        for name in _KERNEL_PACKAGES:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)
