"""The host tier's memory: host slabs, each allocated once and kept for reuse, and the copies of cache payloads into
and out of them.

`HostPool(nbytes, device)` is the `tiers` object of a statecache.cache.index.CheckpointIndex: `down(payload)` copies a
payload (a tuple of tensors and plain values, as statecache.cache.store makes them) into slices of the pool and returns a
`HostPayload` (None when the pool has no free run long enough yet: the index then drops something and asks again);
`up(host payload)` copies it back to the device and frees its slices; `free` frees them. The pool's memory is slabs
of up to `nbytes` in all, never given back and never allocated per eviction.

Where the slabs come from: on the CPU (the tests' form of the tier) `down` grows the pool by a `SLAB_BYTES` slab when
no free run fits (plain host memory is quick to get). On CUDA the slabs are pinned, and pinning is slow and holds the
driver: an H100 host took ~0.65 s a GiB, so 35 slabs pinned by the serving thread as the tier filled cost 23 s of a
30 s run, and a thread of its own pinning the whole pool (`cudaHostAlloc`) kept the serving thread's launches
waiting for the ~40 s it took. So the work is split (`start()`, which the engine calls once start-up is done): a
thread of the pool's own gets each slab's pages (anonymous memory, faulted in: the part that needs no driver), and
the serving thread registers one such slab with the driver (`cudaHostRegister`) each time it has launched a forward
and would otherwise wait for it (`grow_while_device_runs`), or when a copy down finds no room. `down` uses only
registered slabs.
The copies run on two streams of the pool's own, so that neither kind waits behind the other and a copy up runs
beside the step in flight (the step loop restores step N+1's states while step N runs):
- down (`down_stream`): waits for the work queued so far on the current stream (what wrote the payload) and for
  every copy up queued so far (a slice freed after its copy up was queued may be reused only once it has been
  read); the device tensors it reads are kept from reuse until it ends (`record_stream`); it records an event on
  the host payload.
- up (`up_stream`): waits only for its own payload's copy down (that event, long done as a rule), not for the
  current stream, so its device tensors are allocated on the up stream (a block the current stream freed with work
  still queued on it is never handed to it) and marked as used by the current stream, which waits for the copy
  before anything reads it. Nothing blocks the host.

Knows tensors, streams and one thread of its own; knows nothing of checkpoints, LRU or budgets (statecache.cache.index
decides what moves).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import queue
import threading
import time
import weakref

import torch

SLICE_ALIGN = 256  # every slice starts at a multiple of this (any dtype's view is aligned)
SLAB_BYTES = 1 << 28  # the pool grows by slabs of at least this size (a 9B-shaped 4k state is ~275 MB in a few
# tensors, none over 64 MiB; a larger tensor gets a slab of its own size)
REGISTER_SHARE = 0.1  # most of the serving thread's time that registering slabs may take
READY_AHEAD = 4  # slabs the faulting thread keeps ready for registering, ahead of the serving thread

log = logging.getLogger("statecache.cache.tiers")


def _aligned(n: int) -> int:
    return max(SLICE_ALIGN, -(-int(n) // SLICE_ALIGN) * SLICE_ALIGN)


def _touch(t: torch.Tensor) -> None:
    """Fault in every page of `t` on this thread alone (a memset: torch's zero_ would take the intra-op pool, which
    the serving thread's host work uses)."""
    ctypes.memset(t.data_ptr(), 0, t.numel())


def _unregister(addresses: list[int], maps: list) -> None:
    """A CUDA pool's finaliser: its slabs unregistered, then (on return) its mmaps free to go."""
    for addr in addresses:
        try:
            torch.cuda.cudart().cudaHostUnregister(addr)
        except Exception:  # noqa: BLE001 - nothing more to do for it
            pass
    addresses.clear()


KV_ROWS = 16  # a group's K/V holds its positions in a multiple of this many rows: each layer's keys start 16-element
# aligned whatever the state's length (the step loop's Triton kernels load them as 16-element vectors)


def kv_rows(ref: torch.Tensor, n: int) -> torch.Tensor:
    """An empty [layers, n, ...] tensor like `ref` (a group's K or V), its rows allocated in a multiple of KV_ROWS."""
    padded = -(-n // KV_ROWS) * KV_ROWS
    return ref.new_empty((ref.shape[0], padded, *ref.shape[2:]))[:, :n]


class HostPayload:
    """A payload on the host: its items (host tensors, viewing the pool, and plain values) and the slices they hold."""

    __slots__ = ("items", "slices", "written", "strides")

    def __init__(self, items: tuple, slices: list[tuple[int, int]], written, strides: tuple):
        self.items, self.slices = items, slices
        self.written = written  # CUDA: the event recorded after its copy down (None on the CPU)
        self.strides = strides  # each tensor's strides on the device (a group's K/V rows padded: `kv_rows`), restored up


class HostPool:
    def __init__(self, nbytes: int, device, slab_bytes: int = SLAB_BYTES, background: bool | None = None):
        """`background`: slabs prepared by a thread of their own and admitted by the serving thread (see the module's
        docstring); default on CUDA only (the CPU grows synchronously, which its tests rely on)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.background = self.cuda if background is None else bool(background)
        self.nbytes = int(nbytes)
        self.slab_bytes = _aligned(slab_bytes)
        # the slabs side by side in one address space: slab k covers [bases[k], bases[k] + len(slabs[k]))
        self.slabs: list[torch.Tensor] = []
        self.bases: list[int] = []
        self.allocated = 0  # bytes of slabs admitted so far (at most nbytes)
        self._free: list[tuple[int, int]] = []  # (offset, size), by offset, never across a slab's end
        self.down_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.up_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._timed: list = []  # CUDA: (start, end) events of copies up not yet read
        self._lock = threading.Lock()  # the slabs and free runs (the serving thread's; `free_bytes` may be read
        # from another)
        self._ready: queue.Queue = queue.Queue(READY_AHEAD)  # prepared slabs (mmap, tensor), in order
        self._prepared = 0  # bytes handed to `_ready` or admitted
        self._want = self.slab_bytes  # the size the next prepared slab must have at least (largest tensor asked for)
        self._preparer: threading.Thread | None = None
        self._next_admit = 0.0  # CUDA: no slab is registered before this (perf_counter; see grow_while_device_runs)
        self._maps: list = []  # the mmaps behind the slabs (kept alive with them)
        self._registered: list[int] = []  # CUDA: addresses registered with the driver, unregistered before the
        # mmaps go (memory unmapped while registered left the driver broken: a later cublasCreate failed on an H100)
        if self.cuda:
            fin = weakref.finalize(self, _unregister, self._registered, self._maps)
            fin.atexit = False  # at exit the process's teardown frees both
        self.stats = {"copies_down": 0, "bytes_down": 0, "copies_up": 0, "bytes_up": 0, "up_ms": 0.0,
                      "no_room": 0, "device_oom": 0, "slabs": 0, "slab_ms": 0.0, "prepare_ms": 0.0}

    # ---- growth ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin preparing slabs on a thread of the pool's own (background pools; no-op otherwise or when running)."""
        if not self.background or self._preparer is not None or self.nbytes < SLICE_ALIGN:
            return
        self._preparer = threading.Thread(target=self._prepare_all, name="statecache-host-pool", daemon=True)
        self._preparer.start()

    def _prepare_all(self) -> None:
        t0 = time.perf_counter()
        try:
            while self._prepared < self.nbytes:
                size = min(max(self.slab_bytes, self._want), self.nbytes - self._prepared)
                if size < SLICE_ALIGN:
                    break
                t1 = time.perf_counter()
                slab = self._new_slab(size, fault=True)
                self.stats["prepare_ms"] += 1e3 * (time.perf_counter() - t1)
                self._prepared += size
                self._ready.put(slab)  # waits while READY_AHEAD slabs wait for the serving thread
        except Exception as e:  # noqa: BLE001 - the tier keeps what it has
            log.warning("the host tier stopped growing at %.1f GiB: %s: %s", self._prepared / 2**30, type(e).__name__, e)
        finally:
            self._ready.put(None)  # the end: nothing more comes
        log.info("host tier: %.1f GiB of pages prepared in %.1f s", self._prepared / 2**30, time.perf_counter() - t0)

    def _new_slab(self, size: int, fault: bool) -> tuple:
        """(mmap or None, uint8 tensor of `size` bytes). Background slabs are anonymous mappings (page-aligned, huge
        pages asked for) whose pages are touched here, so that registering them later only pins what exists."""
        if not fault:
            return None, torch.empty(size, dtype=torch.uint8)
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: huge pages may back it
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        t = torch.frombuffer(m, dtype=torch.uint8)
        _touch(t)
        return m, t

    def grow_while_device_runs(self) -> bool:
        """Admit one prepared slab, if one is ready and the pool is not whole: the serving thread calls this after it
        has launched a forward and before it waits for it (the driver's time to register the slab is then time the
        thread would have waited anyway). True when a slab was admitted. Registering is paced: at most
        REGISTER_SHARE of the serving thread's time since the last one (should the driver take long, the tier fills
        slower rather than the serving thread waiting)."""
        if not self.background or self.allocated >= self.nbytes:
            return False
        if self.cuda and time.perf_counter() < self._next_admit:
            return False
        try:
            slab = self._ready.get_nowait()
        except queue.Empty:
            return False
        if slab is None:  # the preparer ended: the pool is as whole as it gets
            self.nbytes = self.allocated
            return False
        try:
            self._admit(*slab)
        except Exception as e:  # noqa: BLE001 - the tier keeps what it has; the forward it sits beside goes on
            log.warning("the host tier stopped growing at %.1f GiB: %s: %s", self.allocated / 2**30, type(e).__name__, e)
            self.nbytes = self.allocated
            return False
        return True

    def _admit(self, m, slab: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self._admit_timed(m, slab)
        finally:
            t1 = time.perf_counter()
            self._next_admit = t1 + (t1 - t0) * (1 / REGISTER_SHARE - 1)

    def _admit_timed(self, m, slab: torch.Tensor) -> None:
        t0 = time.perf_counter()
        size = slab.numel()
        if self.cuda and m is not None:
            err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {err}")
            self._registered.append(slab.data_ptr())
        elif self.cuda:
            slab = slab.pin_memory()
        with self._lock:
            self.stats["slab_ms"] += 1e3 * (time.perf_counter() - t0)
            self.stats["slabs"] += 1
            base = self.allocated
            self.slabs.append(slab)
            self._maps.append(m)
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
        """Room for at least `n` bytes more, within nbytes; False when the pool may not grow that far now. A
        background pool admits a slab its thread has prepared (never waiting for one); the others allocate one."""
        if self.background:
            self._want = max(self._want, n)
            while self.grow_while_device_runs():
                if self.slabs[-1].numel() >= n:
                    return True
            return False
        size = min(max(self.slab_bytes, n), self.nbytes - self.allocated)
        if size < n:
            return False
        self._admit(*self._new_slab(size, fault=False))
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

    def down(self, payload: tuple) -> HostPayload | None | bool:
        """The payload's host copy (its tensors copied into slices of the pool, asynchronously on CUDA); None when the
        pool has no run long enough for one of them (freeing host checkpoints may make room); False when the copy
        could not be made for want of device memory (freeing host memory does not help)."""
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
        items, k, written = [], 0, None
        strides = tuple(t.stride() for t in payload if isinstance(t, torch.Tensor))
        if self.cuda:
            self.down_stream.wait_stream(torch.cuda.current_stream(self.device))  # what wrote the payload
            self.down_stream.wait_stream(self.up_stream)  # copies up still reading slices freed since
        try:
            for t in payload:
                if not isinstance(t, torch.Tensor):
                    items.append(t)
                    continue
                off, n = slices[k]
                k += 1
                h = self._view(off, n).view(t.dtype).view(t.shape)
                self._copy_down(h, t)
                items.append(h)
        except torch.OutOfMemoryError:
            # a strided tensor's copy to the host goes through a contiguous copy on the device, which device memory
            # running out (when the cache gives memory back: statecache.step.Steps._relieve) cannot hold: no room
            # here; copies already issued write slices that are free again, each later writer ordered behind them
            with self._lock:
                for o, m in slices:
                    self._release(o, m)
            self.stats["device_oom"] += 1
            return False
        if self.cuda:
            written = torch.cuda.Event()
            written.record(self.down_stream)
        self.stats["copies_down"] += 1
        self.stats["bytes_down"] += sum(sizes)
        return HostPayload(tuple(items), slices, written, strides)

    def _copy_down(self, h: torch.Tensor, t: torch.Tensor) -> None:
        if self.cuda:
            with torch.cuda.stream(self.down_stream):
                h.copy_(t, non_blocking=True)
            t.record_stream(self.down_stream)  # its memory is not reused before this copy reads it
        else:
            h.copy_(t)

    def up(self, hp: HostPayload) -> tuple:
        t0 = time.perf_counter()
        out = []
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.up_stream):
                if hp.written is not None:
                    self.up_stream.wait_event(hp.written)
                dev = self._like(hp, self.device)  # the up stream's blocks (see the module's docstring)
                start.record()
                for d, h in zip(dev, hp.items):
                    if isinstance(h, torch.Tensor):
                        d.copy_(h, non_blocking=True)
                        d.record_stream(cur)  # read and freed by the current stream's work
                end.record()
            cur.wait_event(end)
            self._timed.append((start, end))
            out = dev
        else:
            out = self._like(hp, "cpu")
            for d, h in zip(out, hp.items):
                if isinstance(h, torch.Tensor):
                    d.copy_(h)
            self.stats["up_ms"] += 1e3 * (time.perf_counter() - t0)
        self.stats["copies_up"] += 1
        self.stats["bytes_up"] += sum(n for _, n in hp.slices)
        self.free(hp)
        return tuple(out)

    @staticmethod
    def _like(hp: HostPayload, device) -> list:
        """Empty tensors for a payload's items, laid out as they were before the copy down (strides kept)."""
        strides = iter(hp.strides)  # one per tensor item, in order
        return [torch.empty_strided(h.shape, next(strides), dtype=h.dtype, device=device)
                if isinstance(h, torch.Tensor) else h for h in hp.items]

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
                "slab_ms": round(self.stats["slab_ms"], 3), "prepare_ms": round(self.stats["prepare_ms"], 3),
                "pool_bytes": self.nbytes,
                "pool_allocated_bytes": self.allocated, "pool_free_bytes": self.free_bytes}
