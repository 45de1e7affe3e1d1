"""The cache budget: sizes of what the cache stores, the budget from a given free-memory figure, and eviction that
really lets go of the cache's tensors."""

import gc
import weakref

import numpy as np
import pytest
import torch

from statecache.cache import budget as B
from statecache.cache.config import CacheSettings
from statecache.dev.checkpoints import real_shape
from statecache.engine import Engine
from statecache.model.config import parse_config

GIB = 2**30


def cfg9b():
    return parse_config({"model_type": "qwen3_5_text", **real_shape("9B")})


def test_sizes_of_the_9b_shape():
    cfg = cfg9b()
    # DESIGN.md's figures: GDN states 24 x 32 x 128 x 128 x 4 B = 48 MiB, K/V of 4096 tokens 8 x 4096 x 2 x 4 x 256 x 2 B
    assert B.checkpoint_bytes(cfg, 2) == 24 * (32 * 128 * 128 * 4 + 3 * (2 * 2048 + 4096) * 2)
    assert B.kv_bytes(cfg, 4096, 2) == 128 * 2**20
    assert B.checkpoints_planted(4096) == 3  # 2048, 4032, 4096
    assert B.checkpoints_planted(4170) == 3  # p = 4170: 2048, 4096 (also 4170 - 16, aligned), 4170
    assert B.checkpoints_planted(6000) == 4  # p = 6000: 2048, 4096, 5952, 6000
    assert B.checkpoints_planted(100) == 2 and B.checkpoints_planted(0) == 0  # 64 (100 - 16, aligned), 100


def test_budget_from_a_free_memory_figure():
    cfg = cfg9b()
    one = B.state_bytes(cfg, 4096, 2)
    # an H200 after 17.9 GB of weights and buffers: ~120 GiB free
    work = B.forward_workspace_bytes(cfg, 32768, 2)
    assert 4 * GIB < work < 40 * GIB  # a real reserve for the largest forward, not most of the card
    b = B.cache_budget(cfg, 2, free_bytes=120 * GIB, workspace_bytes=work, fraction=0.9)
    assert b.source == "device"
    assert b.mb == int(0.9 * (120 * GIB - work)) // 2**20
    assert 200 < b.states_4k < 400  # hundreds of 4k-token states, not the 3 a fixed 1 GiB held
    assert abs(b.states_4k - b.mb * 2**20 / one) < 1e-6
    assert "MiB" in b.describe() and "4096 tokens" in b.describe()
    # nothing left after the workspace: an empty cache, never a negative one
    assert B.cache_budget(cfg, 2, free_bytes=GIB, workspace_bytes=2 * GIB).mb == 0
    # the setting wins; the CPU default without a device figure
    assert B.cache_budget(cfg, 2, setting_mb=500, free_bytes=120 * GIB).mb == 500
    cpu = B.cache_budget(cfg, 2)
    assert (cpu.mb, cpu.source) == (B.CPU_DEFAULT_MB, "cpu default")
    with pytest.raises(ValueError):
        B.cache_budget(cfg, 2, fraction=1.5)
    with pytest.raises(ValueError):
        B.cache_budget(cfg, 2, setting_mb=-1)


def test_engine_on_cpu_takes_the_default_or_the_setting():
    assert Engine(None, "cpu", "float32").cache.index.budget_bytes == B.CPU_DEFAULT_MB * 2**20
    eng = Engine(None, "cpu", "float32", settings=CacheSettings(mb=3))
    assert eng.budget.source == "setting" and eng.cache.index.budget_bytes == 3 * 2**20


@pytest.mark.parametrize("host_mb", [0, 4], ids=["one_tier", "host_tier"])
def test_eviction_drops_the_tensors(host_mb):
    """Evicted checkpoints (dropped, or moved to the host tier: their device tensors) are referenced by nobody."""
    eng = Engine(None, "cpu", "float32", cold_ok=lambda ctx: True,  # plant even what barely fits
                 settings=CacheSettings(mb=1, host_mb=host_mb))
    gen = torch.Generator().manual_seed(0)
    refs = []
    for k in range(12):
        ids = torch.randint(0, 500, (700,), generator=gen).tolist()
        eng.answer([{"ids": ids, "state_len": 680, "slots": [699], "nopts": [3]}])
        for c in eng.cache.index.lru_order():
            refs += [weakref.ref(t) for t in (*c.payload, *c.group.payload[:2])]
    assert eng.cache.stats["evicted"] + eng.cache.index.counts["demoted"] > 0
    assert (eng.cache.index.counts["demoted"] > 0) == (host_mb > 0)
    gc.collect()
    live = {id(t) for c in eng.cache.index.lru_order() for t in (*c.payload, *c.group.payload[:2])}
    dangling = [r for r in refs if r() is not None and id(r()) not in live]
    assert not dangling, f"{len(dangling)} tensors of evicted checkpoints are still referenced"
    assert eng.cache.index.bytes <= 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_sizes_the_cache_from_the_device():
    eng = Engine(None, "cuda", "bfloat16", settings=CacheSettings(fraction=0.5))
    b = eng.budget
    assert b.source == "device" and b.fraction == 0.5 and b.mb > 0
    free, _ = torch.cuda.mem_get_info()
    assert b.mb * 2**20 <= 0.5 * (free + 2**30)  # half of what was free then (the cache is still empty)
    assert eng.cache.index.budget_bytes == b.mb * 2**20
    mem = eng.stats()["device_memory_mb"]
    assert mem["total"] > mem["free"] > 0
    alloc = eng.details()["allocator"]  # the caching allocator's calls to the driver
    assert alloc["device_allocs"] > 0 and alloc["alloc_retries"] >= 0 and alloc["device_frees"] >= 0


def test_rebudget_follows_what_other_processes_take_and_give_back():
    cfg = cfg9b()
    work = 8 * GIB
    start = B.cache_budget(cfg, 2, free_bytes=100 * GIB, workspace_bytes=work, fraction=0.9)
    assert B.rebudget(start, 100 * GIB, 0) == start.mb  # nothing changed
    # this process filled 60 GiB of its own: the driver's free figure fell by that, the budget did not
    assert B.rebudget(start, 40 * GIB, 60 * GIB) == start.mb
    # another process took 30 GiB: the budget shrinks by 0.9 x 30 GiB
    assert B.rebudget(start, 10 * GIB, 60 * GIB) == int(0.9 * (70 * GIB - work)) // 2**20
    # it took everything: nothing for the cache, never negative
    assert B.rebudget(start, 0, 0) == 0
    # it went away, and more is free than at start-up: the budget grows
    assert B.rebudget(start, 110 * GIB, 0) > start.mb
    # a budget that was not sized from the device stays as it was
    assert B.rebudget(B.cache_budget(cfg, 2, setting_mb=500), 0, 0) == 500


def test_check_fits_names_what_is_needed_and_what_was_found():
    B.check_fits("x", GIB, 2 * GIB, "hint")
    B.check_fits("x", GIB, None, "hint")  # not measured: passes
    with pytest.raises(B.DeviceTooSmall, match=r"the largest forward needs 1024 MiB .* 512 MiB is free: lower it"):
        B.check_fits("the largest forward", GIB, GIB // 2, "lower it")


def test_engine_shrinks_its_budget_when_another_process_takes_device_memory(monkeypatch):
    """The engine's re-check as it runs on CUDA, on the CPU: the free-memory figure is the test's. The budget shrinks
    by what the other process took, the cache moves what no longer fits to the host tier, rows still answer as the
    uncached forward does, and the budget grows back when the memory given back has stayed free for GROW_AFTER_S."""
    import dataclasses

    import statecache.engine as E
    from tests.test_engine import check

    eng = Engine(None, "cpu", "float32", settings=CacheSettings(min_prefix=64, stride=192, mb=4, host_mb=64))
    free = [64 * 2**20]
    monkeypatch.setattr(E, "device_free_bytes", lambda device: free[0])
    eng.budget_at_start = eng.budget = dataclasses.replace(eng.budget, mb=4, source="device", free_mb=64.0,
                                                            workspace_mb=0.0, fraction=0.0625)
    eng._reserved0 = 0  # what the re-check counts this process's reservations from (torch.cuda: 0 on the CPU)
    rng = np.random.default_rng(5)
    rows = []
    for n in (700, 800, 900, 1000):
        ids = rng.integers(0, 500, size=n + 10).tolist()
        rows.append({"ids": ids, "state_len": n, "slots": [n + 9], "nopts": [3]})
    got = dict(eng.submit(rows, list(range(4))))
    while eng.pending():
        got.update(eng.step())
    before = eng.cache.index.bytes
    assert before > 2 * 2**20  # the four states fill more than half the budget
    free[0] = 32 * 2**20  # another process took half the device
    assert eng.recheck_memory() == 2 and eng.cache.index.budget_bytes == 2 * 2**20
    assert eng.cache.index.bytes <= 2 * 2**20 and eng.cache.index.host_bytes > 0  # moved to the host, not lost
    assert eng.stats()["budget"]["mb"] == 2 and eng.stats()["budget_rechecks"]["shrunk"] == 1
    again = [dict(r, ids=r["ids"][:-1] + [7], slots=[len(r["ids"]) - 1]) for r in rows]
    got2 = dict(eng.submit(again, list(range(4))))
    while eng.pending():
        got2.update(eng.step())
    res = [got2[i] for i in range(4)]
    assert all(r["path"] == "hit" for r in res), [r["path"] for r in res]
    check(eng, again, res)
    clock = [1000.0]
    monkeypatch.setattr(E, "_now", lambda: clock[0])
    free[0] = 64 * 2**20  # given back: not taken at once (a worker starting in a dead one's place may want it)
    assert eng.recheck_memory() == 2 and eng.stats()["budget_rechecks"]["grow_deferred"] == 1
    clock[0] += E.GROW_AFTER_S / 2
    free[0] = 32 * 2**20  # taken again (the new worker came up): the wait starts over
    assert eng.recheck_memory() == 2
    free[0] = 64 * 2**20
    clock[0] += E.GROW_AFTER_S / 2
    assert eng.recheck_memory() == 2 and eng.stats()["budget_rechecks"]["grow_deferred"] == 2
    clock[0] += E.GROW_AFTER_S - 1
    assert eng.recheck_memory() == 2 and eng.stats()["budget_rechecks"]["grown"] == 0
    clock[0] += 1  # free for GROW_AFTER_S: grown into
    assert eng.recheck_memory() == 4 and eng.stats()["budget_rechecks"]["grown"] == 1
    assert eng.recheck_memory() == 4 and eng.stats()["budget_rechecks"]["rechecks"] >= 3  # the steps re-check too
