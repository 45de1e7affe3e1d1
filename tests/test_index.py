"""CheckpointIndex and plan_chunks: pure bookkeeping, checked on the CPU against hand-made cases and a brute-force model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from statecache.cache.index import MIN_ADVANCE, Checkpoint, CheckpointIndex, Group, plan_chunks


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int64)


def changed(a: np.ndarray, i: int) -> np.ndarray:
    b = a.copy()
    b[i] += 1
    return b


def recount(ix: CheckpointIndex, groups: list[Group]) -> int:
    """Bytes from scratch: every live checkpoint, plus each group that still has one, once."""
    live = ix.lru_order()
    return sum(c.nbytes for c in live) + sum(g.nbytes for g in groups if any(c.group is g for c in live))


# ---- lookup ----------------------------------------------------------------------------------------------------------


def test_deepest_match_wins() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(256)
    g = ix.add_group(a, "kv", 100)
    c64, c128, c256 = (ix.add_checkpoint(g, p, p, 1) for p in (64, 128, 256))
    assert ix.lookup(a, 10**6) is c256
    assert ix.lookup(np.concatenate([a, toks(40, 1)]), 10**6) is c256
    assert ix.lookup(changed(a, 200), 10**6) is c128  # diverges inside [128, 256)
    assert ix.lookup(changed(a, 127), 10**6) is c64  # the last token of [0, 128) differs
    assert ix.lookup(changed(a, 0), 10**6) is None
    assert ix.lookup(a.tolist(), 10**6) is c256  # a list works as well as an array
    assert ix.lookup(a.astype(np.int32), 10**6) is c256  # and another integer dtype


def test_other_tokens_at_same_position_never_match() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(128)
    b = changed(a, 100)  # one token apart
    ga, gb = ix.add_group(a, None, 0), ix.add_group(b, None, 0)
    a64 = ix.add_checkpoint(ga, 64, None, 1)
    a128 = ix.add_checkpoint(ga, 128, None, 1)
    b128 = ix.add_checkpoint(gb, 128, None, 1)
    assert ix.lookup(a, 128) is a128
    assert ix.lookup(b, 128) is b128
    assert ix.lookup(changed(b, 100), 128) is a64  # a third token there: neither 128 matches, the shared 64 does


def test_digest_collisions_are_decided_by_tokens() -> None:
    # A 1-byte digest has at most 256 values: 300 prefixes that differ in one token must collide somewhere.
    ix = CheckpointIndex(10**9, align=4, digest_size=1)
    base = toks(8)
    rows = []
    for v in range(300):
        r = base.copy()
        r[5] = v
        rows.append((r, ix.add_checkpoint(ix.add_group(r, None, 0), 8, None, 1)))
    shallow = ix.add_checkpoint(ix.add_group(base, None, 0), 4, None, 1)
    for r, c in rows:
        assert ix.lookup(r, 8) is c
    r = base.copy()
    r[5] = 10_000  # none has this token: only the shallow checkpoint before it is usable
    assert ix.lookup(r, 8) is shallow


def test_limit_and_row_length_are_respected() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(256)
    g = ix.add_group(a, None, 0)
    c64, c128, c256 = (ix.add_checkpoint(g, p, None, 1) for p in (64, 128, 256))
    assert ix.lookup(a, 255) is c128
    assert ix.lookup(a, 128) is c128
    assert ix.lookup(a, 127) is c64
    assert ix.lookup(a, 63) is None
    assert ix.lookup(a, 0) is None
    assert ix.lookup(a, -5) is None
    assert ix.lookup(a[:200], 10**6) is c128  # a shorter row cannot use a deeper checkpoint
    assert ix.lookup(a[:0], 10**6) is None


def test_route_filter() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(256)
    g = ix.add_group(a, None, 0)
    r0_128 = ix.add_checkpoint(g, 128, None, 1, route=0)
    r1_64 = ix.add_checkpoint(g, 64, None, 1, route=1)
    r2_128 = ix.add_checkpoint(g, 128, None, 1, route=2)  # same tokens and pos, another route: both kept
    assert len(ix) == 3
    assert ix.lookup(a, 256, route=1) is r1_64
    assert ix.lookup(a, 256, route=0) is r0_128
    assert ix.lookup(a, 256, route=2) is r2_128
    assert ix.lookup(a, 256, route=3) is None
    assert ix.lookup(a, 256) is r2_128  # any route: the deepest, the most recently used at a tie
    ix.touch(r0_128)
    assert ix.lookup(a, 256) is r0_128
    b = toks(128, 1)
    h = ix.add_group(b, None, 0)
    e0, e1 = (ix.add_checkpoint(h, 128, None, 1, route=r) for r in (0, 1))  # the group's end, on two routes
    assert ix.lookup(b, 128) is e1
    v = ix.version
    ix.retire(e1)  # grown past: the least recent, at a tie between routes too (found by the state machine below)
    assert ix.version != v and ix.lookup(b, 128) is e0


# ---- LRU, bytes, eviction --------------------------------------------------------------------------------------------


def test_lru_order_follows_add_and_touch_not_lookup() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(192)
    g = ix.add_group(a, None, 0)
    c1, c2, c3 = (ix.add_checkpoint(g, p, None, 1) for p in (64, 128, 192))
    assert ix.lru_order() == [c1, c2, c3]
    ix.touch(c1)
    assert ix.lru_order() == [c2, c3, c1]
    assert ix.lookup(a, 128) is c2
    assert ix.lru_order() == [c2, c3, c1]  # lookup leaves the order alone
    ix.touch(c3)
    assert ix.lru_order() == [c2, c1, c3]


def test_retire_sends_a_grown_past_end_first_and_fork_points_get_a_lap() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(192)
    g = ix.add_group(a, None, 0)
    c64 = ix.add_checkpoint(g, 64, None, 1, fork=True)  # a fork point: the prefix the next new page reads
    c128, c192 = (ix.add_checkpoint(g, p, None, 1) for p in (128, 192))
    ix.retire(c128)  # not the group's end: left where it is
    assert ix.lru_order() == [c64, c128, c192] and ix.counts["retired"] == 0
    ix.retire(c192)  # the state's end, grown past: least recent now, still found
    assert ix.lru_order() == [c192, c64, c128] and ix.counts["retired"] == 1
    assert ix.lookup(a, 192) is c192
    ix.budget_bytes = 2
    assert ix.evict() == [c192]
    ix.budget_bytes = 1
    assert ix.evict() == [c128]  # c64, least recent, was passed over once (to the most recent end)
    assert ix.counts["spared"] == 1 and ix.lru_order() == [c64]
    g2 = ix.add_group(toks(64, 1), None, 0)
    d = ix.add_checkpoint(g2, 64, None, 1)
    assert ix.lru_order() == [c64, d]
    assert ix.evict() == [c64]  # its lap is spent
    ix.retire(c64)  # evicted: ignored
    assert ix.lru_order() == [d]


def test_evict_to_tiny_budget_frees_group_bytes_once() -> None:
    ix = CheckpointIndex(10**9, align=64)
    ga = ix.add_group(toks(128, 1), "kvA", 1000)
    gb = ix.add_group(toks(128, 2), "kvB", 500)
    a1 = ix.add_checkpoint(ga, 64, None, 10)
    b1 = ix.add_checkpoint(gb, 64, None, 20)
    a2 = ix.add_checkpoint(ga, 128, None, 30)
    b2 = ix.add_checkpoint(gb, 128, None, 40)
    assert ix.bytes == 1000 + 500 + 10 + 20 + 30 + 40
    assert ix.n_groups == 2
    ix.touch(a1)  # order: b1, a2, b2, a1
    ix.budget_bytes = 1100
    assert ix.evict() == [b1, a2, b2]  # b2 was gb's last: its 500 go with it
    assert ix.bytes == 1000 + 10 <= ix.budget_bytes
    assert ix.n_groups == 1 and ga.ckpts == [a1] and gb.ckpts == []
    ix.budget_bytes = 1
    assert ix.evict() == [a1]
    assert ix.bytes == 0 and len(ix) == 0 and ix.n_groups == 0
    assert ix.evict() == []
    with pytest.raises(ValueError):
        ix.add_checkpoint(ga, 64, None, 1)  # a dropped group takes no more checkpoints
    ix.touch(a1)  # an evicted checkpoint: ignored
    assert ix.lru_order() == []


def test_evict_within_budget_only_drops_empty_groups() -> None:
    ix = CheckpointIndex(10**9, align=64)
    g = ix.add_group(toks(64), None, 7)
    c = ix.add_checkpoint(ix.add_group(toks(64, 3), None, 5), 64, None, 1)
    assert ix.bytes == 7 + 5 + 1 and ix.n_groups == 2
    assert ix.evict() == []
    assert ix.bytes == 5 + 1 and ix.n_groups == 1 and ix.lru_order() == [c]
    with pytest.raises(ValueError):
        ix.add_checkpoint(g, 64, None, 1)


def test_readd_replaces_and_never_double_counts() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(128)
    g1 = ix.add_group(a, None, 100)
    old = ix.add_checkpoint(g1, 128, "s1", 10)
    keep = ix.add_checkpoint(g1, 64, None, 1)
    new = ix.add_checkpoint(g1, 128, "s2", 12)  # the same row delivered again, into its own group
    assert len(ix) == 2 and ix.bytes == 100 + 1 + 12
    assert ix.lookup(a, 128) is new and old not in ix.lru_order() and g1.ckpts == [keep, new]
    # the same tokens again from another row's group: the old checkpoint goes; g1 keeps `keep`
    g2 = ix.add_group(np.concatenate([a, toks(64, 9)]), None, 200)
    newer = ix.add_checkpoint(g2, 128, "s3", 13)
    assert len(ix) == 2 and ix.n_groups == 2 and ix.bytes == 100 + 1 + 200 + 13
    assert ix.lookup(a, 128) is newer
    # ... and replacing `keep` empties g1, whose bytes go with it
    newest = ix.add_checkpoint(g2, 64, None, 2)
    assert ix.lru_order() == [newer, newest]
    assert ix.n_groups == 1 and ix.bytes == 200 + 13 + 2
    assert recount(ix, [g1, g2]) == ix.bytes


def test_add_checkpoint_validates_position() -> None:
    ix = CheckpointIndex(10**9, align=64)
    g = ix.add_group(toks(130), None, 0)
    for bad in (0, -64, 131, 192):
        with pytest.raises(ValueError):
            ix.add_checkpoint(g, bad, None, 1)
    assert ix.add_checkpoint(g, 128, None, 1).pos == 128
    assert ix.add_checkpoint(g, 100, None, 1).pos == 100  # a state's end: any position of its group
    with pytest.raises(ValueError):
        ix.add_group(np.zeros((2, 2), dtype=np.int64), None, 0)
    with pytest.raises(TypeError):
        ix.add_group(np.zeros(4, dtype=np.float32), None, 0)


def test_group_ids_are_a_frozen_copy() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(64)
    c = ix.add_checkpoint(ix.add_group(a, None, 0), 64, None, 1)
    a[3] += 1  # the caller reuses its buffer: the index keeps its own tokens
    assert ix.lookup(a, 64) is None
    with pytest.raises(ValueError):
        c.group.ids[0] = 1


def test_version_changes_with_anything_a_lookup_depends_on() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(256)
    g = ix.add_group(a, None, 10)
    v = ix.version
    c = ix.add_checkpoint(g, 128, None, 5)
    assert ix.version > v
    v = ix.version
    ix.lookup(a, 256)
    ix.evict()  # within budget: nothing dropped
    assert ix.version == v
    for change in (lambda: ix.touch(c), lambda: ix.add_checkpoint(g, 128, None, 5),  # a touch, a replacement
                   lambda: ix.add_checkpoint(g, 192, None, 5), lambda: setattr(ix, "budget_bytes", 0) or ix.evict(),
                   ix.clear):
        v = ix.version
        change()
        assert ix.version > v


def test_clear() -> None:
    ix = CheckpointIndex(10**9, align=64)
    a = toks(128)
    g = ix.add_group(a, None, 50)
    c = ix.add_checkpoint(g, 64, None, 5)
    ix.clear()
    assert len(ix) == 0 and ix.n_groups == 0 and ix.bytes == 0 and ix.lru_order() == []
    assert ix.lookup(a, 128) is None
    ix.touch(c)
    assert ix.lru_order() == []
    with pytest.raises(ValueError):
        ix.add_checkpoint(g, 128, None, 5)
    c2 = ix.add_checkpoint(ix.add_group(a, None, 50), 64, None, 5)
    assert ix.lookup(a, 128) is c2 and ix.bytes == 55


# ---- the index against a brute-force model ---------------------------------------------------------------------------

ALIGN = 2
small_ids = st.lists(st.integers(0, 1), min_size=1, max_size=10).map(lambda v: np.array(v, dtype=np.int64))
routes = st.integers(0, 1)


class IndexVsModel(RuleBasedStateMachine):
    """Random add/lookup/touch/evict on tiny binary token arrays; with a digest of 0 or 1 byte candidates collide.

    The model: `order` (live checkpoints, least recent first), `live_groups`; lookup is a linear scan comparing
    tokens; bytes are summed from scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.ix = CheckpointIndex(10**9, align=ALIGN)
        self.groups: list[Group] = []  # every group ever made
        self.ckpts: list[Checkpoint] = []  # every checkpoint ever made
        self.live_groups: list[Group] = []
        self.order: list[Checkpoint] = []
        self.spare: set[Checkpoint] = set()  # fork points' checkpoints not yet passed over by an eviction

    @initialize(digest_size=st.sampled_from([0, 1, 8]))
    def make_index(self, digest_size: int) -> None:
        self.ix = CheckpointIndex(10**9, align=ALIGN, digest_size=digest_size)

    def _drop(self, c: Checkpoint) -> None:
        self.order.remove(c)
        if not any(o.group is c.group for o in self.order):
            self.live_groups.remove(c.group)

    def _bytes(self) -> int:
        return sum(c.nbytes for c in self.order) + sum(g.nbytes for g in self.live_groups)

    @rule(ids=small_ids, nbytes=st.integers(0, 20))
    def add_group(self, ids: np.ndarray, nbytes: int) -> None:
        g = self.ix.add_group(ids, None, nbytes)
        self.groups.append(g)
        self.live_groups.append(g)

    @precondition(lambda self: self.live_groups)
    @rule(data=st.data(), nbytes=st.integers(0, 20), route=routes, fork=st.booleans())
    def add_checkpoint(self, data: st.DataObject, nbytes: int, route: int, fork: bool) -> None:
        g = data.draw(st.sampled_from(self.live_groups))
        if len(g.ids) < 1:
            return
        aligned = [st.integers(1, len(g.ids) // ALIGN).map(lambda k: k * ALIGN)] if len(g.ids) >= ALIGN else []
        pos = data.draw(st.one_of(*aligned, st.integers(1, len(g.ids))))  # a state's end: anywhere in its group
        old = [o for o in self.order if o.pos == pos and o.route == route and np.array_equal(o.group.ids[:pos], g.ids[:pos])]
        assert len(old) <= 1
        c = self.ix.add_checkpoint(g, pos, None, nbytes, route, fork=fork)
        assert (c.group, c.pos, c.nbytes, c.route) == (g, pos, nbytes, route)
        self.ckpts.append(c)
        self.order.append(c)
        if fork:
            self.spare.add(c)
        for o in old:
            self._drop(o)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def add_checkpoint_badly(self, data: st.DataObject) -> None:
        """A bad position in any group, or any position in a group no longer live: refused, nothing changes."""
        g = data.draw(st.sampled_from(self.groups))
        bad = [0, -ALIGN, len(g.ids) + 1, (len(g.ids) // ALIGN + 1) * ALIGN]
        pos = data.draw(st.sampled_from(bad + ([ALIGN] if g not in self.live_groups and len(g.ids) >= ALIGN else [])))
        with pytest.raises(ValueError):
            self.ix.add_checkpoint(g, pos, None, 1)

    def _check_lookup(self, ids: np.ndarray, limit: int, route: int | None) -> None:
        best: Checkpoint | None = None
        for c in self.order:  # least recent first: `>=` keeps the most recent at a tie
            if c.pos <= min(limit, len(ids)) and (route is None or c.route == route) and np.array_equal(c.group.ids[: c.pos], ids[: c.pos]):
                if best is None or c.pos >= best.pos:
                    best = c
        before = self.ix.lru_order()
        assert self.ix.lookup(ids, limit, route) is best
        assert self.ix.lookup(ids.tolist(), limit, route) is best  # a list: the same answer (its own code path)
        assert self.ix.lru_order() == before

    @rule(ids=small_ids, limit=st.integers(-1, 11), route=st.none() | routes)
    def lookup_random(self, ids: np.ndarray, limit: int, route: int | None) -> None:
        self._check_lookup(ids, limit, route)

    @precondition(lambda self: self.order)
    @rule(data=st.data(), limit=st.integers(-1, 11), route=st.none() | routes, tail=small_ids)
    def lookup_near_a_group(self, data: st.DataObject, limit: int, route: int | None, tail: np.ndarray) -> None:
        """A live checkpoint's group tokens, cut or extended, maybe with one token flipped: rows sharing prefixes."""
        ids = data.draw(st.sampled_from(self.order)).group.ids.copy()
        ids = data.draw(st.sampled_from([ids, ids[: len(ids) // 2], np.concatenate([ids, tail])]))
        flip = data.draw(st.none() | st.integers(0, len(ids) - 1)) if len(ids) else None
        if flip is not None:
            ids[flip] ^= 1
        self._check_lookup(ids, limit, route)

    @precondition(lambda self: self.ckpts)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(self.ckpts))
        self.ix.touch(c)
        if c in self.order:
            self.order.remove(c)
            self.order.append(c)

    @precondition(lambda self: self.ckpts)
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        """A group's end goes first (and loses its spare lap); any other checkpoint, or one not live, stays put."""
        c = data.draw(st.sampled_from(self.ckpts))
        self.ix.retire(c)
        if c in self.order and c.pos == len(c.group.ids):
            self.order.remove(c)
            self.order.insert(0, c)
            self.spare.discard(c)

    @rule(budget=st.integers(0, 300))
    def evict(self, budget: int) -> None:
        self.ix.budget_bytes = budget
        self.live_groups = [g for g in self.live_groups if any(c.group is g for c in self.order)]
        expect = []
        while self.order and self._bytes() > budget:
            c = self.order[0]
            if c in self.spare:  # a fork point's: one more lap
                self.spare.discard(c)
                self.order.append(self.order.pop(0))
                continue
            self._drop(c)
            expect.append(c)
        assert self.ix.evict() == expect
        assert self.ix.bytes <= budget or not self.order
        self.ix.budget_bytes = 10**9

    @invariant()
    def agrees(self) -> None:
        assert self.ix.lru_order() == self.order
        assert len(self.ix) == len(self.order)
        assert self.ix.n_groups == len(self.live_groups)
        assert self.ix.bytes == self._bytes()
        for g in self.groups:  # a group lists its live checkpoints in the order they were added
            assert g.ckpts == [c for c in self.ckpts if c.group is g and c in self.order]


TestIndexVsModel = IndexVsModel.TestCase
TestIndexVsModel.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- plan_chunks -----------------------------------------------------------------------------------------------------

P = dict(align=64, max_chunk=2048)


def test_plan_chunks_example() -> None:
    assert plan_chunks(0, 1000, stride=512, tail=16, **P) == [512, 960, 1000]  # p - tail = 984 -> 960, p exact


def test_plan_chunks_tail_and_stride_off() -> None:
    assert plan_chunks(0, 1000, stride=512, tail=0, **P) == [512, 1000]
    assert plan_chunks(0, 1000, stride=0, tail=16, **P) == [960, 1000]
    assert plan_chunks(0, 1000, stride=0, tail=0, **P) == [1000]


def test_plan_chunks_max_chunk_splits() -> None:
    assert plan_chunks(0, 5000, stride=0, tail=0, **P) == [2048, 4096, 5000]
    assert plan_chunks(128, 5000, stride=0, tail=0, **P) == [2176, 4224, 5000]  # split from the chunk's own start
    assert plan_chunks(0, 5000, stride=0, tail=0, align=64, max_chunk=1024) == [1024, 2048, 3072, 4096, 5000]
    assert plan_chunks(0, 5000, stride=2048, tail=16, align=64, max_chunk=1024) == [1024, 2048, 3072, 4096, 4928, 5000]


def test_plan_chunks_start_at_or_past_p() -> None:
    assert plan_chunks(960, 1000, stride=512, tail=16, **P) == [1000]
    assert plan_chunks(990, 1000, stride=512, tail=16, **P) == []  # p within MIN_ADVANCE of the restored position
    assert plan_chunks(1024, 1000, stride=512, tail=16, **P) == []
    assert plan_chunks(512, 1000, stride=512, tail=16, **P) == [960, 1000]  # only positions past the restored one
    assert plan_chunks(900, 1000, stride=512, tail=16, **P) == [960, 1000]
    assert plan_chunks(950, 1000, stride=512, tail=16, **P) == [1000]  # 960: closer than MIN_ADVANCE past 950


def test_plan_chunks_state_len_not_aligned() -> None:
    assert plan_chunks(0, 970, stride=0, tail=16, **P) == [896, 970]  # p = 970 exact, p - tail = 954 -> 896
    assert plan_chunks(0, 1023, stride=0, tail=16, **P) == [960, 1023]
    assert plan_chunks(0, 1024, stride=0, tail=16, **P) == [960, 1024]
    assert plan_chunks(0, 70, stride=0, tail=16, **P) == [70]  # p - tail rounds to 0: not planted
    assert plan_chunks(0, 2050, stride=2048, tail=16, **P) == [1984, 2050]  # 2048: closer than MIN_ADVANCE below p


def test_plan_chunks_rejects_bad_inputs_and_takes_any_start() -> None:
    with pytest.raises(ValueError):
        plan_chunks(0, 1000, stride=512, tail=16, align=64, max_chunk=1000)
    with pytest.raises(ValueError):
        plan_chunks(-1, 1000, stride=512, tail=16, **P)
    assert plan_chunks(10, 1000, stride=512, tail=16, **P) == [512, 960, 1000]  # a state's exact end restored


@settings(max_examples=300, deadline=None)
@given(
    align=st.sampled_from([1, 4, 64]),
    start=st.integers(0, 2600),
    state_len=st.integers(0, 3000),
    stride=st.integers(0, 700),
    tail=st.integers(0, 100),
    chunk_k=st.integers(1, 20),
)
def test_plan_chunks_properties(align: int, start: int, state_len: int, stride: int, tail: int, chunk_k: int) -> None:
    max_chunk = chunk_k * align
    out = plan_chunks(start, state_len, stride=stride, tail=tail, align=align, max_chunk=max_chunk)
    p, first = state_len, start + MIN_ADVANCE
    if p < first:
        assert out == []
        return
    assert out[-1] == p and out == sorted(set(out)) and all(start < e <= p for e in out)
    below = {k - k % align for k in range(stride, p, stride)} if stride else set()
    if tail:
        below.add((p - tail) - (p - tail) % align)
    wanted = {p} | {x for x in below if first <= x <= p - MIN_ADVANCE}
    assert wanted <= set(out)
    prev = start
    for e in out:  # each a wanted position or a split of a longer chunk
        assert e in wanted or e - prev == max_chunk
        assert e - prev <= max_chunk
        prev = e


def test_lookup_past_many_other_states_ends() -> None:
    """States' ends are checkpoints at any position: a lookup that meets more than SCAN_BEFORE_BOUND positions of
    other states before its own match bounds the rest by the row's shared depth, and still finds the deepest match
    (checked against every checkpoint by hand), for rows matching shallow, deep, at an end and nowhere."""
    from statecache.cache.index import SCAN_BEFORE_BOUND

    rng = np.random.default_rng(3)
    ix = CheckpointIndex(10**12, align=64)
    base = rng.integers(0, 1000, 3000)
    cks = []
    for k in range(3 * SCAN_BEFORE_BOUND):  # other states, each with its own end between 1000 and 3000
        ids = rng.integers(0, 1000, 3000)
        n = int(rng.integers(1000, 3000))
        g = ix.add_group(ids[:n], None, 0)
        cks.append(ix.add_checkpoint(g, n, None, 1))
    mine = ix.add_group(base[:1500], None, 0)
    cks += [ix.add_checkpoint(mine, 700, None, 1), ix.add_checkpoint(mine, 1437, None, 1)]

    def brute(row, limit):
        ok = [c for c in cks if c.pos <= min(limit, len(row)) and np.array_equal(c.group.ids[: c.pos], row[: c.pos])]
        return max(ok, key=lambda c: c.pos) if ok else None

    grown = np.concatenate([base[:1437], rng.integers(0, 1000, 1500)])
    changed = base.copy()
    changed[900] += 1  # shares [0, 900): its deepest is 700, below every other state's end
    for row in (grown, changed, base[:1437].copy(), rng.integers(0, 1000, 3000)):
        for limit in (3000, 1437, 1436, 700, 699):
            assert ix.lookup(row, limit) is brute(row, limit), (len(row), limit)
            assert ix.lookup(row.tolist(), limit) is brute(row, limit)
