"""The host tier (statecache.cache.index's two tiers, statecache.cache.tiers.HostPool), follow-ups protected, fork points.

On the CPU the host tier is the same code with plain host tensors: a checkpoint evicted from the device budget is
copied into the pool, and copied back (promoted) when a row needs it. Rows run through the step loop
(statecache.step.Steps over the small model: tests/cache_util.make_steps; the engine's tests on the built-in tiny
model); answers are checked against the uncached forward (tests/cache_util.reference, Engine.uncached) and the same
row from a device-tier checkpoint, float32, 1e-4.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statecache.cache.budget import HOST_DEFAULT_MAX_MB, MIB, host_budget
from statecache.cache.config import CacheSettings
from statecache.cache.index import DEVICE, HOST, CheckpointIndex
from statecache.cache.store import Answer
from statecache.cache.tiers import HostPool
from statecache.engine import Engine
from tests.cache_util import assert_close, make_steps, one_thread, reference, run_rows, toks

import torch


def etoks(n: int, seed: int) -> list[int]:
    """Tokens below the built-in tiny model's vocabulary (the engine's tests)."""
    return np.random.default_rng(seed).integers(0, 500, size=n).tolist()


def question(n: int, seed: int) -> list[int]:
    return toks(n, 5000 + seed)


def plant_all(ctx) -> bool:
    """A cold_ok policy that plants every new state (the default declines one over half the budget, so with a 1 MiB
    device budget and no host tier these 300-token states would never be planted)."""
    return True


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


def ask(steps, ids, state_len, slots, nopts):
    """One row through the step loop to its end, equal to the uncached forward."""
    ans = run_rows(steps, [(ids, state_len, slots, nopts)])[0]
    assert isinstance(ans, Answer), f"the row failed: {ans!r}"
    assert_close(ans.probs, reference(ids, slots, nopts))
    return ans


def budgets_hold(ix: CheckpointIndex) -> None:
    assert ix.bytes <= ix.budget_bytes and ix.host_bytes <= ix.host_budget_bytes
    dev = sum(c.nbytes for c in ix.lru_order()) + sum(g.nbytes for g in ix._groups if g.tier == DEVICE)
    host = sum(c.nbytes for c in ix.host_order()) + sum(g.nbytes for g in ix._groups if g.tier == HOST)
    assert (dev, host) == (ix.bytes, ix.host_bytes)
    for g in ix._groups:  # a group's K/V is on the device exactly while one of its checkpoints is
        assert g.ckpts and (g.tier == DEVICE) == any(c.tier == DEVICE for c in g.ckpts)


# ---- the index's two tiers (bookkeeping alone) -----------------------------------------------------------------------


def test_index_demotes_to_the_host_then_drops_by_the_hosts_lru():
    ix = CheckpointIndex(250, align=1, host_budget_bytes=250)
    groups = []
    for k in range(4):  # each: a group of 50 bytes and two checkpoints of 50
        g = ix.add_group([k] * 4, f"kv{k}", 50)
        ix.add_checkpoint(g, 2, f"c{k}a", 50)
        ix.add_checkpoint(g, 4, f"c{k}b", 50)
        groups.append(g)
        assert ix.evict() == [] or k == 3
        budgets_hold(ix)
    # 4 x 150 bytes over 250 + 250: group 0 was demoted first, then dropped from the host for group 2's
    assert groups[0] not in ix._groups and ix.counts["dropped_host"] == 2 and ix.counts["demoted"] >= 4
    assert ix.lookup([0] * 4, 4) is None
    c = ix.lookup([1] * 4, 4)
    assert c is not None and c.tier == HOST and c.group.tier == HOST  # found on the host, token-exact
    assert ix.promote(c) and c.tier == DEVICE and c.group.tier == DEVICE
    budgets_hold(ix)
    assert ix.lookup([1] * 4, 4) is c and ix.lookup([9] * 4, 4) is None


def test_payloads_of_none_move_too_without_a_tiers_object():
    """Without a tiers object (simulations: bench/headroom.py) a payload moves as it is, None included."""
    ix = CheckpointIndex(100, align=1, host_budget_bytes=1000)
    for k in range(3):
        g = ix.add_group([k] * 2, None, 40)
        ix.add_checkpoint(g, 2, None, 10)
        ix.evict()
    assert ix.counts["demoted"] >= 1 and ix.counts["dropped_device"] == 0 and len(ix) == 3
    c = ix.lookup([0] * 2, 2)
    assert c.tier == HOST and ix.promote(c)
    budgets_hold(ix)


def test_pins_pass_over_a_checkpoint_while_others_can_go():
    ix = CheckpointIndex(200, align=1)  # one tier
    g1 = ix.add_group([1] * 2, None, 50)
    a = ix.add_checkpoint(g1, 2, None, 50)
    ix.pin(a)
    g2 = ix.add_group([2] * 2, None, 50)
    b = ix.add_checkpoint(g2, 2, None, 50)
    g3 = ix.add_group([3] * 2, None, 50)
    ix.add_checkpoint(g3, 2, None, 50)
    assert ix.evict() == [b]  # the least recent is pinned: the next one goes
    ix.budget_bytes = 50  # only the pinned one left to go: the budget wins
    ix.evict()
    assert len(ix) == 0 and ix.bytes == 0
    ix.unpin(a)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3), st.booleans()), min_size=1, max_size=40),
       st.integers(0, 400), st.integers(0, 400))
def test_index_budgets_hold_under_any_access_pattern(ops, dev, host):
    ix = CheckpointIndex(dev, align=1, host_budget_bytes=host)
    for agent, depth, promote in ops:
        ids = [agent] * 3 + [depth]
        c = ix.lookup(ids, 4)
        if c is not None:
            assert c.group.tokens[: c.pos] == ids[: c.pos]  # token-exact, either tier
            if promote and c.tier == HOST:
                ix.promote(c)
            ix.touch(c)
        else:
            g = ix.add_group(ids, None, 40)
            for pos in range(1, 5):
                ix.add_checkpoint(g, pos, None, 10 * depth)
        ix.evict()
        budgets_hold(ix)


def test_host_pool_copies_and_reuses_its_slices():
    pool = HostPool(4096, "cpu")
    a = (torch.arange(100, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16), 7)
    hp = pool.down(a)
    assert hp is not None and pool.free_bytes == 4096 - 512 - 256
    assert pool.down((torch.zeros(1000, dtype=torch.float32),)) is None  # 4000 bytes: no run that long
    back = pool.up(hp)
    assert torch.equal(back[0], a[0]) and torch.equal(back[1], a[1]) and back[2] == 7
    assert pool.free_bytes == 4096 and pool.info()["copies_up"] == 1
    big = pool.down((torch.zeros(1000, dtype=torch.float32),))  # the slices merged back into one run
    assert big is not None
    pool.free(big)
    assert pool.free_bytes == 4096


def test_a_copy_the_device_has_no_memory_for_moves_nothing_and_drops_no_host_checkpoint(monkeypatch):
    """Device memory running out while a payload is copied to the host (on CUDA a strided tensor goes through a
    contiguous device copy; an H100 ran out there while the cache gave memory back, and the error failed the step):
    the pool says False and frees the slices it took; the index drops that checkpoint instead of moving it, keeps the
    host's checkpoints (freeing host memory does not help) and stays within its budgets."""
    pool = HostPool(4096, "cpu")
    real, calls = pool._copy_down, [0]

    def second_fails(h, t):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (fault hook)")
        real(h, t)

    monkeypatch.setattr(pool, "_copy_down", second_fails)
    assert pool.down((torch.ones(16), torch.ones(16))) is False
    assert pool.free_bytes == 4096 and pool.info()["device_oom"] == 1
    monkeypatch.setattr(pool, "_copy_down", real)

    ix = CheckpointIndex(300, align=1, host_budget_bytes=4096)
    ix.tiers = pool
    payload = lambda k: (torch.full((16,), float(k)),)  # noqa: E731 - 64 bytes each
    g0 = ix.add_group([0] * 4, (), 0)
    ix.add_checkpoint(g0, 4, payload(0), 200)
    g1 = ix.add_group([1] * 4, (), 0)
    ix.add_checkpoint(g1, 4, payload(1), 200)
    ix.evict()  # the first moves to the host
    assert ix.lookup([0] * 4, 4).tier == HOST and ix.counts["demoted"] == 1
    monkeypatch.setattr(pool, "_copy_down", lambda h, t: (_ for _ in ()).throw(torch.OutOfMemoryError("fault hook")))
    g2 = ix.add_group([2] * 4, (), 0)
    ix.add_checkpoint(g2, 4, payload(2), 200)
    dropped = ix.evict()  # the second cannot be copied: dropped, the host's first kept
    assert [c.pos for c in dropped] == [4] and ix.lookup([1] * 4, 4) is None
    assert ix.lookup([0] * 4, 4).tier == HOST and ix.counts["unmovable"] == 1
    budgets_hold(ix)


def test_host_pool_grows_by_slabs_within_its_bound_and_keeps_runs_inside_a_slab():
    pool = HostPool(3 * 1024, "cpu", slab_bytes=1024)
    assert pool.allocated == 0 and pool.free_bytes == 3 * 1024  # nothing allocated before the first copy down
    a = pool.down((torch.arange(192, dtype=torch.float32),))  # 768 bytes: the first slab
    b = pool.down((torch.arange(192, dtype=torch.float32),))  # no run of 768 left there: a second slab
    assert a is not None and b is not None and pool.allocated == 2048 and pool.info()["slabs"] == 2
    big = pool.down((torch.zeros(600, dtype=torch.float32),))  # 2400 bytes: more than the pool may still grow by
    assert big is None and pool.allocated == 2048
    assert torch.equal(pool.up(a)[0], torch.arange(192, dtype=torch.float32))
    assert torch.equal(pool.up(b)[0], torch.arange(192, dtype=torch.float32))
    assert pool._free == [(0, 1024), (1024, 1024)]  # freed runs merged within each slab, never across its end
    two = pool.down((torch.zeros(256, dtype=torch.float32), torch.ones(256, dtype=torch.float32)))
    assert two is not None and pool.allocated == 2048  # the kept slabs are reused
    back = pool.up(two)
    assert torch.equal(back[0], torch.zeros(256)) and torch.equal(back[1], torch.ones(256))
    assert pool.free_bytes == 3 * 1024


def test_host_pool_grown_in_the_background_serves_only_what_the_serving_thread_admitted(monkeypatch):
    gate = threading.Event()
    real = HostPool._new_slab
    prepared = []

    def slow_slab(self, size, fault):  # the preparing thread's slab waits for the gate (faulting pages is slow)
        assert threading.current_thread().name == "statecache-host-pool" and fault
        gate.wait(10)
        prepared.append(size)
        return real(self, size, fault)

    monkeypatch.setattr(HostPool, "_new_slab", slow_slab)
    pool = HostPool(4 * 1024, "cpu", slab_bytes=1024, background=True)
    x = (torch.arange(64, dtype=torch.float32),)
    assert pool.down(x) is None and pool.allocated == 0  # nothing prepared: the serving thread never waits for it
    pool.start()
    assert pool.down(x) is None and pool.allocated == 0
    gate.set()
    for _ in range(1000):  # the preparer fills its queue of ready slabs
        if len(prepared) == 4:
            break
        time.sleep(0.01)
    assert prepared == [1024] * 4 and pool.allocated == 0  # prepared is not admitted
    assert pool.grow_while_device_runs() and pool.allocated == 1024  # one slab per launched forward
    hp = pool.down(x)
    assert hp is not None and torch.equal(pool.up(hp)[0], x[0])
    big = pool.down((torch.zeros(512, dtype=torch.float32),))  # 2048 bytes: no prepared slab is that long
    assert big is None and pool._want == 2048
    while pool.grow_while_device_runs():
        pass
    assert pool.allocated == 4 * 1024 and pool.info()["slabs"] == 4 and pool.free_bytes == 4 * 1024
    assert not pool.grow_while_device_runs()  # whole
    pool._preparer.join(10)
    assert not pool._preparer.is_alive()
    pool.start()  # it ran: no second thread
    assert not pool._preparer.is_alive()


def test_host_pool_prepares_slabs_at_the_size_a_tensor_asked_for():
    pool = HostPool(8 * 1024, "cpu", slab_bytes=1024, background=True)
    assert pool.down((torch.zeros(768, dtype=torch.float32),)) is None and pool._want == 3072  # before any slab
    pool.start()
    pool._preparer.join(10)  # 3072 + 3072 + 2048: each slab at least the largest tensor asked for, within nbytes
    sizes = []
    while pool.grow_while_device_runs():
        sizes.append(pool.slabs[-1].numel())
    assert sizes == [3072, 3072, 2048]
    hp = pool.down((torch.ones(768, dtype=torch.float32),))
    assert hp is not None and torch.equal(pool.up(hp)[0], torch.ones(768))


def test_host_budget_from_the_setting_or_host_memory():
    assert host_budget(0, 10 * 2**30).mb == 0 and host_budget(64, None).mb == 64
    assert host_budget(None, 10 * 2**30).mb == 5 * 1024
    assert host_budget(None, 10**15).mb == HOST_DEFAULT_MAX_MB
    assert host_budget(None, None).mb == 0
    with pytest.raises(ValueError):
        host_budget(-1, None)


# ---- the cache: a row restored from the host ----------------------------------------------------------------------


def test_a_row_restored_from_the_host_answers_as_from_the_device():
    steps = make_steps(mb=1, host_mb=8)
    roomy = make_steps(mb=64, host_mb=0)
    cache = steps.cache
    A, B, C = (toks(300, s) for s in (31, 32, 33))  # p = 300: checkpoints at 128, 284 -> 256, 300
    for s, seed in ((A, 1), (B, 2), (C, 3)):
        ask(steps, s + question(8, seed), 300, [307], [4])
        ask(roomy, s + question(8, seed), 300, [307], [4])
    assert cache.index.bytes <= cache.index.budget_bytes and cache.index.counts["demoted"] > 0
    deepest = cache.index.lookup(A + question(9, 4), 300)
    assert deepest is not None and deepest.pos == 300 and deepest.tier == HOST  # A went to the host
    ids = A + question(9, 4)
    got = ask(steps, ids, 300, [308], [4])
    dev = ask(roomy, ids, 300, [308], [4])
    assert got.path == dev.path == "hit" and got.reused == dev.reused == 300
    assert_close(got.probs, dev.probs)
    info = cache.info()
    assert info["restored_host"] == 1 and info["host"]["copies_up"] >= 2  # the checkpoint and its group's K/V
    assert info["tiers"]["promoted"] == 1 and deepest.tier == DEVICE
    assert cache.index.bytes <= cache.index.budget_bytes and cache.index.host_bytes <= cache.index.host_budget_bytes


def test_without_the_host_tier_the_same_row_is_cold():
    steps = make_steps(plant_all, mb=1, host_mb=0)
    A, B, C = (toks(300, s) for s in (31, 32, 33))
    for s, seed in ((A, 1), (B, 2), (C, 3)):
        assert ask(steps, s + question(8, seed), 300, [307], [4]).path == "cold"
    assert steps.cache.stats["evicted"] > 0
    assert ask(steps, A + question(9, 4), 300, [308], [4]).path == "cold" and steps.cache.host is None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 12)), min_size=2, max_size=7),
       st.integers(0, 2), st.sampled_from([0, 1, 2]))
def test_random_rows_and_tiny_budgets_never_answer_wrong(visits, dev_mb, host_mb):
    """Agents whose states grow or change in the middle, under tiny budgets on both tiers (every new state planted):
    every answer equals the uncached forward and neither tier is ever over its budget."""
    steps = make_steps(plant_all, mb=dev_mb or 1, host_mb=host_mb)
    base = {a: toks(260, 100 + a) for a in range(5)}
    for k, (agent, change, q) in enumerate(visits):
        state = base[agent]
        if change == 1:  # grows at its end
            state = state + toks(70, 200 + k)
        elif change == 2:  # a new page after the same goal
            state = state[:150] + toks(120, 300 + k)
        base[agent] = state
        ids = state + question(q, k)
        assert ask(steps, ids, len(state), [len(ids) - 1], [4]).path != "plain"
        budgets_hold(steps.cache.index)


# ---- fork points ------------------------------------------------------------------------------------------------------


def test_a_fork_point_is_planted_where_a_new_page_leaves_a_cached_state():
    steps = make_steps(stride=0, tail=0, host_mb=0)  # checkpoints only at the state's end
    cache = steps.cache
    goal = toks(200, 41)
    A = goal + toks(120, 42)  # p = 320
    ask(steps, A + question(5, 1), 320, [324], [4])
    B = goal + toks(120, 43)  # shares [0, 200) with A: aligned, [0, 192); no checkpoint there
    b = ask(steps, B + question(5, 2), 320, [324], [4])
    assert b.path == "cold" and cache.stats["tokens_lost"] == 192 and cache.stats["forks"] == 1
    assert sorted(c.pos for c in cache.index.lru_order()) == [192, 320, 320]
    C = goal + toks(120, 44)  # the next page change reuses the goal
    c = ask(steps, C + question(5, 3), 320, [324], [4])
    assert c.path == "partial" and c.reused == 192 and cache.stats["tokens_lost"] == 192


def test_the_engine_plants_a_fork_point_in_a_new_states_run():
    eng = Engine(device="cpu", dtype="float32", settings=CacheSettings(min_prefix=64, stride=0, tail=0, host_mb=0))
    goal = etoks(200, 51)
    rows = [{"ids": goal + etoks(120, k) + etoks(6, 60 + k), "state_len": 320, "slots": [325], "nopts": [4]}
            for k in (52, 53, 54)]
    res = [eng.answer([r])[0] for r in rows]
    assert [r["path"] for r in res] == ["cold", "cold", "partial"] and res[2]["reused"] == 192
    assert eng.cache.stats["forks"] == 1 and eng.stats()["cache"]["tokens_lost"] == 192
    third = eng.answer([dict(rows[2], slots=[324])])[0]
    assert third["path"] == "hit"
    for r, want in zip(res + [third], eng.uncached(rows + [dict(rows[2], slots=[324])])):
        assert_close(r["probs"], want)


# ---- follow-ups protected ---------------------------------------------------------------------------------------------


def _burst_engine(host_mb: int) -> Engine:
    """Steps of 192 tokens, pieces of at most 64: three new pages fill a step."""
    return Engine(device="cpu", dtype="float32", step_tokens=192, step_chunk=64,
                  settings=CacheSettings(min_prefix=64, stride=192, mb=1, host_mb=host_mb))


def test_a_row_taken_with_a_burst_of_new_pages_keeps_its_state():
    """A's grown state (100 tokens past its checkpoint: a long computation) comes after three new pages, which fill
    each step until they have planted enough to evict A's state; the row was taken with them, so the checkpoint it
    found is pinned and it still continues from it (with the host tier off)."""
    eng = _burst_engine(0)
    A = etoks(260, 61)
    first = eng.answer([{"ids": A + etoks(8, 1), "state_len": 260, "slots": [267], "nopts": [4]}])[0]
    assert first["path"] == "cold"
    pages = [etoks(260, 70 + k) for k in range(3)]
    one = eng.cache.state_bytes(260)
    assert 2 * one <= eng.cache.index.budget_bytes < 4 * one, "the test's sizes no longer force evictions"
    batch = [{"ids": P + etoks(8, 2), "state_len": 260, "slots": [267], "nopts": [4]} for P in pages]
    grown = A + etoks(100, 3)
    batch.append({"ids": grown + etoks(9, 4), "state_len": 360, "slots": [368], "nopts": [4]})
    res = eng.answer(batch)
    assert [r["path"] for r in res] == ["cold", "cold", "cold", "partial"] and res[3]["reused"] == 260
    assert eng.cache.stats["evicted"] > 0  # (unpinned, A's state goes: the row would be new and too large to plant)
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes
    for r, want in zip(res, eng.uncached(batch)):
        assert_close(r["probs"], want)


def test_engine_stats_carry_the_tiers():
    eng = _burst_engine(4)
    stats = eng.stats()["cache"]
    assert stats["host_mb"] == 4 and stats["host"]["pool_bytes"] == 4 * MIB
    for k in ("host_bytes", "device_checkpoints", "host_checkpoints", "restored_host", "tokens_lost"):
        assert k in stats
