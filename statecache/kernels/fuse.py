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
    """`token_args`: positions of the tensor arguments whose first dimension is the token count, marked dynamic on
    every call (0.35 us a mark on this CPU), so that every compile, the first included and those that other guards
    bring (q and k through one piece, strided differently), already serves every token count. Without marks torch
    compiles once for the first count and again, symbolic, at the second (automatic dynamic shapes: a second compile
    of every piece, 5.2 s of a warm worker's start-up on an H100, bench/README.md). Other sizes stay static, which
    keeps the generated kernels free of runtime index division (bench/README.md: compile)."""

    def __init__(self, fn, token_args: tuple[int, ...] = ()):
        import torch._dynamo

        self.eager = fn
        self.__name__ = fn.__name__
        self.fast = torch.compile(fn, dynamic=None, fullgraph=True)
        self.token_args = token_args
        self._mark = torch._dynamo.maybe_mark_dynamic
        self.ok = True

    def __call__(self, *args):
        if self.ok:
            for i in self.token_args:
                if isinstance(args[i], torch.Tensor):
                    self._mark(args[i], 0)
            try:
                return self.fast(*args)
            except Exception as e:  # noqa: BLE001 - compile problems must not stop the service
                self.ok = False
                log.warning("torch.compile of %s failed (%s: %s); using the eager form", self.__name__,
                            type(e).__name__, str(e)[:200])
        return self.eager(*args)
