"""`Fused`: a torch.compile'd function that falls back, for good, to its eager form if compiling or running fails.

Used for the elementwise pieces of the forward (norms, gates, rotary, masked softmax): on CUDA each becomes one
or two Triton kernels instead of several eager ones. Compilation problems must never stop the service, so any
exception from the compiled form switches that piece to eager and logs once. Knows nothing of the model.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("statecache.kernels.fuse")


class Fused:
    def __init__(self, fn):
        self.eager = fn
        self.__name__ = fn.__name__
        # automatic dynamic shapes: the token count turns symbolic on its second value; feature sizes stay static,
        # which keeps the generated kernels free of runtime index division (bench/README.md: compile)
        self.fast = torch.compile(fn, dynamic=None, fullgraph=True)
        self.ok = True

    def __call__(self, *args):
        if self.ok:
            try:
                return self.fast(*args)
            except Exception as e:  # noqa: BLE001 - compile problems must not stop the service
                self.ok = False
                log.warning("torch.compile of %s failed (%s: %s); using the eager form", self.__name__,
                            type(e).__name__, str(e)[:200])
        return self.eager(*args)
