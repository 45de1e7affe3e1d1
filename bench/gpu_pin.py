"""How the host tier should get its pinned memory (statecache.cache.tiers): seconds a GiB for each way of pinning, the
copy speed each gives, and how much a thread pinning beside it slows a thread that launches and waits for GPU work.

    python bench/gpu_pin.py --out DIR   (on a CUDA machine; writes DIR/results.json)

Ways: `alloc` (torch.empty(pin_memory=True): cudaHostAlloc), `register` (an anonymous mapping whose pages were
touched first, then cudaHostRegister; the touching timed apart), `register_huge` (the same with MADV_HUGEPAGE).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import threading
import time

import torch

MIB = 1 << 20


def mapped(size: int, huge: bool):
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t0 = time.perf_counter()
    ctypes.memset(t.data_ptr(), 0, size)
    return m, t, time.perf_counter() - t0


def register(t: torch.Tensor) -> float:
    t0 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    assert int(err) == 0, err
    return time.perf_counter() - t0


def copy_gbps(h: torch.Tensor) -> float:
    d = torch.empty(h.numel(), dtype=torch.uint8, device="cuda")
    d.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        d.copy_(h, non_blocking=True)
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    return 6 * h.numel() / (time.perf_counter() - t0) / 1e9


def ways(size: int, n: int) -> dict:
    out = {}
    keep = []
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        ts.append(time.perf_counter() - t0)
    out["alloc"] = {"s_per_gib": sum(ts) / (n * size) * 2**30, "each_ms": [round(1e3 * x, 1) for x in ts],
                    "copy_gbps": copy_gbps(keep[-1])}
    for huge in (False, True):
        touch, reg = [], []
        for _ in range(n):
            m, t, dt = mapped(size, huge)
            touch.append(dt)
            reg.append(register(t))
            keep.append((m, t))
        out["register_huge" if huge else "register"] = {
            "touch_s_per_gib": sum(touch) / (n * size) * 2**30, "register_s_per_gib": sum(reg) / (n * size) * 2**30,
            "register_each_ms": [round(1e3 * x, 1) for x in reg], "copy_gbps": copy_gbps(keep[-1][1])}
    for item in keep:  # registered memory is unregistered before it is unmapped (else the driver breaks)
        if isinstance(item, tuple):
            torch.cuda.cudart().cudaHostUnregister(item[1].data_ptr())
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.zero_()
    out["pageable_copy_gbps"] = copy_gbps(pageable)
    return out


def serving(seconds: float, beside=None) -> dict:
    """A thread like the serving one: launch ~5 ms of GPU work in 60 launches, wait for it; steps/s and their
    durations, with `beside` (a function run in a loop on another thread until the end) or alone."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    stop = threading.Event()
    done = [0]

    def other():
        while not stop.is_set():
            beside()
            done[0] += 1

    th = threading.Thread(target=other, daemon=True) if beside else None
    torch.cuda.synchronize()
    if th:
        th.start()
    steps, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        y = x
        for _ in range(20):
            y = torch.relu(a @ y.T).T[:, :4096] * 0.5 + x
        for _ in range(40):
            y = y + 1
        y.sum().item()
        steps.append(time.perf_counter() - t0)
    stop.set()
    if th:
        th.join()
    return {"steps_per_s": len(steps) / seconds, "p50_ms": 1e3 * statistics.median(steps),
            "max_ms": 1e3 * max(steps), "beside_done": done[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--slab-mib", type=int, default=256)
    ap.add_argument("--slabs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    size = a.slab_mib * MIB
    res = {"device": torch.cuda.get_device_name(), "slab_mib": a.slab_mib, "ways": ways(size, a.slabs)}
    print(json.dumps(res["ways"], indent=1), flush=True)
    keep = []

    def pin_alloc():
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        if len(keep) > 8:
            keep.pop(0)

    touched = []

    def pin_register():  # register a slab touched beforehand (touching it is not what is measured here)
        if not touched:
            return time.sleep(0.001)
        m, t = touched.pop()
        register(t)
        keep.append((m, t))

    res["serving"] = {"alone": serving(a.seconds)}
    res["serving"]["beside_alloc"] = serving(a.seconds, pin_alloc)
    keep.clear()
    torch.cuda.synchronize()
    for _ in range(int(a.seconds * 8)):
        m, t, _ = mapped(size, True)
        touched.append((m, t))
    res["serving"]["beside_register"] = serving(a.seconds, pin_register)
    res["serving"]["beside_touch"] = serving(a.seconds, lambda: mapped(size, True))
    print(json.dumps(res["serving"], indent=1), flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
