"""The host tier's memory: host slabs, each allocated once and kept for reuse, and the copies of cache payloads into
and out of them.

`HostPool(nbytes, device)` is the `tiers` object of a statecache.index.CheckpointIndex: `down(payload)` copies a
payload (a tuple of tensors and plain values, as statecache.cache makes them) into slices of the pool and returns a
`HostPayload` (None when the pool has no free run long enough yet: the index then drops something and asks again);
`up(host payload)` copies it back to the device and frees its slices; `free` frees them. The pool's memory is slabs
of up to `nbytes` in all, never given back and never allocated per eviction.

Where the slabs come from: on the CPU (the tests' form of the tier) `down` grows the pool by a `SLAB_BYTES` slab when
no free run fits (plain host memory is quick to get). On CUDA the slabs are pinned, and pinning is slow (an H100
host took ~0.65 s a GiB: 35 slabs cost 23 s of a 30 s run when the serving thread pinned them as the tier filled);
so `grow_in_background()` (the engine calls it once its start-up captures are done; else the first `down` that
needs room does) pins `GROW_BYTES` slabs on a thread of its own until the pool is whole, and `down` only uses what
has been pinned so far. Every copy runs on the
pool's own stream: a copy down waits for the work that wrote the payload, and the device tensors it reads are kept
from reuse until it ends (`record_stream`); a copy up is waited for by the current stream before anything reads it,
so nothing blocks the host. Slices are reused only by later copies on that same stream, so a slice freed while its
copy up is queued is safe.

Knows tensors, streams and one thread of its own; knows nothing of checkpoints, LRU or budgets (statecache.index
decides what moves).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import torch

SLICE_ALIGN = 256  # every slice starts at a multiple of this (any dtype's view is aligned)
SLAB_BYTES = 1 << 30  # the pool grows by slabs of this size (a 9B-shaped 4k state is ~275 MB in a few tensors)
GROW_BYTES = 1 << 28  # the background grower's slabs: short enough that a pin holds the driver ~0.2 s at a time

log = logging.getLogger("statecache.tiers")


class HostPayload:
    """A payload on the host: its items (host tensors, viewing the pool, and plain values) and the slices they hold."""

    __slots__ = ("items", "slices")

    def __init__(self, items: tuple, slices: list[tuple[int, int]]):
        self.items, self.slices = items, slices


class HostPool:
    def __init__(self, nbytes: int, device, slab_bytes: int = SLAB_BYTES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.nbytes = int(nbytes)
        self.slab_bytes = max(SLICE_ALIGN, -(-int(slab_bytes) // SLICE_ALIGN) * SLICE_ALIGN)
        # the slabs side by side in one address space: slab k covers [bases[k], bases[k] + len(slabs[k]))
        self.slabs: list[torch.Tensor] = []
        self.bases: list[int] = []
        self.allocated = 0  # bytes of slabs allocated so far (at most nbytes)
        self._free: list[tuple[int, int]] = []  # (offset, size), by offset, never across a slab's end
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._timed: list = []  # CUDA: (start, end) events of copies up not yet read
        self._lock = threading.Lock()  # the slabs and free runs: the grower adds while the serving thread allocates
        self._grower: threading.Thread | None = None
        self.stats = {"copies_down": 0, "bytes_down": 0, "copies_up": 0, "bytes_up": 0, "up_ms": 0.0,
                      "no_room": 0, "slabs": 0, "slab_ms": 0.0}

    def grow_in_background(self) -> None:
        """Allocate (pin, on CUDA) the rest of the pool on a thread of its own, GROW_BYTES at a time; from now on
        `down` takes only what the thread has added (no-op when already growing or whole)."""
        if self._grower is not None or self.allocated >= self.nbytes:
            return
        self._grower = threading.Thread(target=self._grow_all, name="statecache-host-pool", daemon=True)
        self._grower.start()

    def _grow_all(self) -> None:
        t0 = time.perf_counter()
        try:
            while self.allocated < self.nbytes:
                size = min(GROW_BYTES, self.nbytes - self.allocated)
                if size < SLICE_ALIGN:
                    break
                self._add_slab(size)
        except Exception as e:  # noqa: BLE001 - the tier keeps what it has
            log.warning("pinning the host tier stopped at %.1f GiB: %s: %s", self.allocated / 2**30, type(e).__name__, e)
            self.nbytes = self.allocated
        log.info("host tier: %.1f GiB pinned in %.1f s", self.allocated / 2**30, time.perf_counter() - t0)

    def _add_slab(self, size: int) -> None:
        t0 = time.perf_counter()
        slab = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)  # the slow part, outside the lock
        with self._lock:
            self.stats["slab_ms"] += 1e3 * (time.perf_counter() - t0)
            self.stats["slabs"] += 1
            base = self.allocated
            self.slabs.append(slab)
            self.bases.append(base)
            self.allocated += size
            self._free.append((base, size))  # after every other run: bases only grow

    # ---- slices ---------------------------------------------------------------------------------------------------

    def _fit(self, n: int) -> int | None:
        for i, (off, size) in enumerate(self._free):  # first fit
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, size - n)
                return off
        return None

    def _grow(self, n: int) -> bool:
        """A new slab that holds at least `n` bytes, within nbytes; False when the pool may not grow that far here.
        On CUDA only the background grower pins (a slab pinned here would stall the serving thread): the first call
        starts it where nobody has."""
        size = min(max(self.slab_bytes, n), self.nbytes - self.allocated)
        if size < n or self._grower is not None:
            return False
        if self.cuda:
            self.grow_in_background()
            return False
        self._add_slab(size)
        return True

    def _alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // SLICE_ALIGN) * SLICE_ALIGN
        with self._lock:
            off = self._fit(n)
        if off is None and self._grow(n):
            with self._lock:
                off = self._fit(n)
        return off

    def _view(self, off: int, n: int) -> torch.Tensor:
        k = bisect.bisect_right(self.bases, off) - 1
        local = off - self.bases[k]
        return self.slabs[k][local : local + n]

    def _slab_end(self, off: int) -> int:
        k = bisect.bisect_right(self.bases, off) - 1
        return self.bases[k] + self.slabs[k].numel()

    def _release(self, off: int, n: int) -> None:
        n = -(-max(n, 1) // SLICE_ALIGN) * SLICE_ALIGN
        i = bisect.bisect_left(self._free, (off, 0))
        end = self._slab_end(off)
        if i < len(self._free) and off + n == self._free[i][0] and off + n < end:  # merge with the next run
            n += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off and self._slab_end(self._free[i - 1][0]) == end:
            off, n = self._free[i - 1][0], self._free[i - 1][1] + n
            i -= 1
            del self._free[i]
        self._free.insert(i, (off, n))

    @property
    def free_bytes(self) -> int:
        """Free runs in the slabs, and the room the pool may still grow by."""
        with self._lock:
            return sum(size for _, size in self._free) + self.nbytes - self.allocated

    # ---- the copies -----------------------------------------------------------------------------------------------

    def down(self, payload: tuple) -> HostPayload | None:
        sizes = [t.numel() * t.element_size() for t in payload if isinstance(t, torch.Tensor)]
        slices: list[tuple[int, int]] = []
        for n in sizes:
            off = self._alloc(n)
            if off is None:
                with self._lock:
                    for o, m in slices:
                        self._release(o, m)
                self.stats["no_room"] += 1
                return None
            slices.append((off, n))
        items, k = [], 0
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in payload:
            if not isinstance(t, torch.Tensor):
                items.append(t)
                continue
            off, n = slices[k]
            k += 1
            h = self._view(off, n).view(t.dtype).view(t.shape)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    h.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # its memory is not reused before this copy reads it
            else:
                h.copy_(t)
            items.append(h)
        self.stats["copies_down"] += 1
        self.stats["bytes_down"] += sum(sizes)
        return HostPayload(tuple(items), slices)

    def up(self, hp: HostPayload) -> tuple:
        t0 = time.perf_counter()
        out = []
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            dev = [torch.empty(h.shape, dtype=h.dtype, device=self.device) if isinstance(h, torch.Tensor) else h
                   for h in hp.items]  # allocated for the current stream, which reads them
            self.stream.wait_stream(cur)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record()
                for d, h in zip(dev, hp.items):
                    if isinstance(h, torch.Tensor):
                        d.copy_(h, non_blocking=True)
                end.record()
            cur.wait_stream(self.stream)
            self._timed.append((start, end))
            out = dev
        else:
            out = [h.clone() if isinstance(h, torch.Tensor) else h for h in hp.items]
            self.stats["up_ms"] += 1e3 * (time.perf_counter() - t0)
        self.stats["copies_up"] += 1
        self.stats["bytes_up"] += sum(n for _, n in hp.slices)
        self.free(hp)
        return tuple(out)

    def free(self, hp: HostPayload) -> None:
        with self._lock:
            for off, n in hp.slices:
                self._release(off, n)
        hp.slices = []

    def info(self) -> dict:
        """The counters, with the milliseconds of the CUDA copies up that have ended."""
        if self._timed:
            left = []
            for start, end in self._timed:
                if end.query():
                    self.stats["up_ms"] += start.elapsed_time(end)
                else:
                    left.append((start, end))
            self._timed = left
        return {**self.stats, "up_ms": round(self.stats["up_ms"], 3),
                "slab_ms": round(self.stats["slab_ms"], 3), "pool_bytes": self.nbytes,
                "pool_allocated_bytes": self.allocated, "pool_free_bytes": self.free_bytes}
