"""The step loop's runner: rows in, one GPU step at a time, rows out when their last piece has run.

`Steps` holds the rows the engine handed it (`add`), asks the scheduler (statecache.sched.Scheduler) for each step's
pieces, runs them as packed forwards of the batched runner (statecache.run.batch.BatchRunner: each sequence continues
from its own state, so hits, grown states and the chunks of new pages ride in one forward), plants the checkpoints
the pieces passed and returns the rows it finished (`step`). What a row carries between its steps lives here
(`_Live`): its conv tails and GDN state at its next piece's start and its own K/V of [0, p) (the restored prefix,
then each piece's chunk), which becomes its group's K/V when it plants.

Planting is deferred to a state's last checkpoint: the group is made once, with all its checkpoints (a group's K/V
must not move to the host tier while a row still writes them). A row whose first piece restores a checkpoint on the
host tier gets it copied back first (StateCache.bring's promote), all the step's restores pinned meanwhile.

A question longer than the runner's longest piece, or with more slots than a piece holds, runs as several pieces
(the scheduler cuts it): each piece answers the slots inside it, the row keeps its K/V through the question, and it
is answered when its last piece has run.

Failure isolation: a forward that raises is halved until the failing piece stands alone; device memory running out
(torch.OutOfMemoryError) first frees cache (half the device budget's least recently used checkpoints, to the host
tier where there is one), empties the allocator's cache and runs the halves again; a row that fails alone is
dropped from the schedule and returned with its error (`out_of_memory` when memory ran out with nothing left to free).

Knows the batched runner, the cache's payload layout and the scheduler; nothing of Redis, the memo or the worker.
Rows of any length up to the runner's longest key span, image rows included (known to the cache by their key tokens;
a piece holding image tokens runs in an eager forward of its own). With specialists each row runs with a route: the
route of the checkpoint it restores, else the last answered row's (StateCache.guess); its pieces add up the router's
feature sum (from the restored checkpoint's), its checkpoints are planted under its route with the sum at their
position, and when its last piece has run the router picks the route over the whole row: a row it disagrees with
(a misprediction) is scheduled again with the router's route, from that route's deepest checkpoint (the first run's
checkpoints stay: they are that route's states), and answered from the second run. The runner keeps no state inside
a piece then (the sum is needed there too), so the scheduler ends each piece at its first checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from statecache.cache.index import DEVICE
from statecache.cache.store import Answer, StateCache
from statecache.cache.tiers import kv_rows
from statecache.run.batch import SNAPS_PER_PIECE, NotBatched, Piece
from statecache.run.graphs import n_options
from statecache.sched import Layout, OverIndex, Row, Scheduler, attn_pairs, slots_at_one_position

log = logging.getLogger("statecache.step")

BUDGET_TOKENS = 2048  # tokens a step holds (bench/step_sim.py's choice for the 9B shape on an H200: bench/README.md)
CHUNK_TOKENS = 1024  # the most a new page advances in one step (capped at the batched runner's longest piece)
# steps run the busy budget (Settings.step_tokens_busy) while the schedule holds this share of the rows a worker takes
# or more (18 of 24: 64 agents +5% rows/s in bench/step_sim.py, 16 agents, who never fill it, as they were)
BUSY_SHARE = 0.75
STEP_LOG = 1024  # the last steps `Steps.log` keeps
# a logged step: its pieces, their tokens, the tokens its forwards ran (token buckets), its longest piece, its attention
# query-key pairs in millions (each piece L * (start + L / 2)), its device milliseconds (CUDA events around its
# forwards; on the CPU their wall time): what bench/step_sim.py's cost model is read from (`fit_log`), and the
# milliseconds between the end of the step logged before it and its start (`gap_ms`: the device between them, idle
# for want of rows or of the host, or copying what a finished step planted; None for the first)
STEP_LOG_FIELDS = ("pieces", "tokens", "padded", "longest", "attn_pairs_m", "device_ms", "gap_ms")


class RowFailed(Exception):
    """A row that could not run: `code` and `message` make its error result."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message
        self.row: dict | None = None  # the checked row (set when it leaves the schedule)


@dataclass(eq=False)
class _Live:
    """A row in the schedule: what it is and what it carries between steps."""

    key: object  # the engine's handle (its memo key)
    row: dict  # the checked row: ids (int64 array), state_len, slots, options
    p: int  # where its state's deepest checkpoint goes (0: it plants nothing: the cache does not take it)
    cap: int  # its K/V buffer's length: p, or for a row the cache does not take its first slot rounded down; n for
    # a row whose question takes several pieces (they read the question's K/V before them)
    pinned: object = None  # the checkpoint found at `add`, pinned until the row ends (its follow-up is protected)
    conv: torch.Tensor | None = None  # state at the next piece's start (after its first piece)
    S: torch.Tensor | None = None
    K: torch.Tensor | None = None  # its own K/V of [0, cap) (rows of more than one piece, or that plant)
    V: torch.Tensor | None = None
    snaps: list = field(default_factory=list)  # (pos, conv, S, feature sum or None) computed, to plant
    probs: list | None = None  # per slot, filled by the pieces that hold them
    route: int = 0  # specialists: the route it runs with (a guess until its router has spoken)
    fsum: torch.Tensor | None = None  # specialists: the router's feature sum over [0, next piece's start)
    earlier: int = 0  # specialists: tokens computed by runs the router disagreed with (a misprediction's)
    fresh: bool = False  # run without the cache: no lookup, nothing planted (`add`)


def _slots_in(live: "_Live", s: int, e: int) -> list[int]:
    """Indices of the row's answer slots in [s, e) (the ones a piece over those tokens answers)."""
    return [j for j, x in enumerate(live.row["slots"]) if s <= x < e]


def _keys(row: dict):
    """The tokens the cache knows a row's state by: its ids, or an image row's key tokens (statecache.run.images)."""
    return row["mm"].keys if "mm" in row else row["ids"]


@dataclass(eq=False)
class _Flight:
    """A step launched and not yet finished: the scheduler's plan, per forward that answers slots its items and the
    wait for its answers, and the checkpoints its pieces restore (pinned until it is done)."""

    step: object
    reads: list
    pinned: list
    timing: tuple = ()  # (start, end: CUDA events or perf_counter seconds, the step's STEP_LOG_FIELDS but the time)


class CacheView(OverIndex):
    """statecache.sched's CacheView over the engine's StateCache: token-exact lookups on both tiers (a host checkpoint
    only when it fits the device budget: it is copied back when its row runs); `planted` hands the positions a row's
    pieces passed to `Steps`, which plants them."""

    def __init__(self, cache: StateCache, on_planted):
        self.cache, self.index = cache, cache.index
        self._on_planted = on_planted

    @property
    def host_budget_bytes(self) -> int:
        return self.index.host_budget_bytes

    def lookup(self, ids, limit: int, route: int | None = None):
        c = self.index.lookup(ids, limit, route)
        if c is not None and c.tier != DEVICE:
            need = c.nbytes + (c.group.nbytes if c.group.tier != DEVICE else 0)
            if need > self.index.budget_bytes:  # it could never come back: the deepest device checkpoint instead
                c = self.index.lookup(ids, limit, route, host=False)
        return c

    def planted(self, state, ids, p: int, positions, last: bool, route: int | None = None, forks=()) -> None:
        self._on_planted(state, positions, last, forks)

    def state_bytes(self, state_len: int) -> int:
        return self.cache.state_bytes(state_len)


class Steps:
    def __init__(self, cache: StateCache, runner, cold_ok=None, *, budget_tokens: int = BUDGET_TOKENS,
                 chunk_tokens: int = CHUNK_TOKENS, busy_tokens: int | None = None, rows_held: int | None = None):
        """budget_tokens: a step's tokens; busy_tokens: its tokens while the schedule holds BUSY_SHARE of rows_held
        rows or more (default: the runner's sequences); both at most the runner's tokens."""
        self.cache, self.runner = cache, runner
        self.spec = runner.spec  # specialists: each row runs with a route (see `add` and `_finish`)
        snapshots = runner.max_snaps > 0  # (none with specialists: their checkpoints need the feature sum there too)
        a = cache.s.align
        chunk = min(chunk_tokens, runner.max_piece)
        chunk -= chunk % a
        budget = min(budget_tokens, runner.max_tokens)
        busy = busy_rows = None
        if busy_tokens is not None and min(busy_tokens, runner.max_tokens) > budget:
            busy = min(busy_tokens, runner.max_tokens)
            busy_rows = max(1, int(BUSY_SHARE * (rows_held or runner.max_batch)))
        self.view = CacheView(cache, self._planted)
        self.sched = Scheduler(self.view, Layout.from_settings(cache.s), budget_tokens=budget,
                               chunk_tokens=chunk, max_seqs=runner.max_batch, cold_ok=cold_ok,
                               max_plants_piece=SNAPS_PER_PIECE if snapshots else 1, max_piece=runner.max_piece,
                               max_slots=runner.max_slots, snapshots=snapshots, busy_tokens=busy,
                               busy_rows=busy_rows)
        self.live: dict[int, _Live] = {}
        self._rid = 0
        st = runner.st
        self._zero_conv = torch.zeros_like(st.conv[:, 0])
        self._zero_S = torch.zeros_like(st.S[:, 0])
        self._zero_F = torch.zeros_like(st.F[0]) if st.F is not None else None
        self._planting: dict[int, list] = {}  # rid -> positions planted so far (deferred to the last one)
        self.stats = {"steps": 0, "forwards": 0, "pieces": 0, "tokens": 0, "oom_relieved": 0, "oom_failed": 0,
                      "failed": 0}
        # where a step's wall time went (seconds, cumulative): planning, bringing restores to the device, launching
        # the forwards (keeping states inside it: `keep`), waiting for and reading the answers, waiting for the rest
        # of the step (`wait`: a step whose forwards answer nothing, new pages' chunks alone, is waited for only
        # here), the scheduler's done (planting inside it: `plant`), evicting. All but `read` and `wait` is host time.
        self.seconds = dict.fromkeys(("plan", "restore", "forward", "keep", "read", "wait", "done", "plant", "evict"),
                                     0.0)
        self._flight: _Flight | None = None  # the step launched and not yet finished
        self.log: deque = deque(maxlen=STEP_LOG)  # the last steps, as STEP_LOG_FIELDS tuples
        self._last_end = None  # the logged step's end mark: the next one's gap is measured from it

    # ---- which rows ----------------------------------------------------------------------------------------------

    def takes(self, row: dict) -> bool:
        """Can this checked row run here? Text rows inside the runner's longest key span, with at most the slots a
        piece holds at any one position (a question is cut into as many pieces as its length and slots need)."""
        if len(row["slots"]) != len(row["options"]) or not len(row["slots"]):
            return False
        n = len(row["ids"])
        if n < 1 or n > self.runner.bk.max_keys:
            return False
        return slots_at_one_position(row["slots"]) <= self.runner.max_slots

    def _cacheable(self, row: dict) -> bool:
        return self.cache.s.mb > 0 and self.cache.eligible(row["state_len"], row["slots"])

    def add(self, key, row: dict, route: int | None = None, earlier: int = 0, fresh: bool = False) -> int:
        """Schedule a checked row (`takes` it); returns its id in this schedule. Specialists: it runs with `route`
        when given (its router has spoken), else with a guess: the route of its deepest checkpoint, else the last
        answered row's (StateCache.guess); earlier: tokens a run with another route computed for it. fresh: it runs
        from nothing and plants nothing (path "plain"), whatever the cache holds."""
        self._rid += 1
        rid = self._rid
        cacheable = not fresh and self._cacheable(row)
        p = self.cache.state_end(row["state_len"]) if cacheable else 0
        first = min(int(x) for x in row["slots"])
        keys = _keys(row)  # what the cache and the scheduler know its tokens by
        srow = Row(rid, keys, row["state_len"], tuple(int(s) for s in row["slots"]), cacheable)
        spec = self.spec is not None
        stop = p if cacheable else first - first % self.cache.s.align
        n = len(row["ids"])
        live = _Live(key, row, p, stop if self.sched.question_end(srow, stop) == n else n)
        live.probs = [None] * len(row["slots"])
        live.fresh = fresh
        forks: tuple = ()
        found = None
        if cacheable:
            found = self.view.lookup(keys, p)
            if spec:
                live.route = self.cache.guess(found) if route is None else route
                if found is not None and found.route != live.route:
                    found = self.view.lookup(keys, p, live.route)
            if found is not None:
                self.cache.index.pin(found)
                live.pinned = found
            x = self.cache.fork_point(keys, p, found.pos if found is not None else 0)
            forks = (x,) if x else ()
        if spec:
            if not cacheable:
                live.route = self.cache.last_route if route is None else route
            srow.route, live.earlier = live.route, earlier
        self.live[rid] = live
        srow.forks = forks
        self.sched.add(srow, found)
        return rid

    def pending(self) -> int:
        return len(self.live)

    def held_bytes(self) -> int:
        """Device bytes the rows in the schedule hold outside the cache: their K/V buffers, their states between
        pieces and the snapshots they have still to plant (a 5k-token page at the 9B shape: ~160 MiB of K/V and ~50
        MiB a state). The cache's budget covers them (CheckpointIndex.held_bytes): a budget sized for the cache alone
        ran an H100 out of memory at 16 agents."""
        seen: set[int] = set()
        total = 0
        for live in self.live.values():
            for t in (live.K, live.V, live.conv, live.S, *(x for snap in live.snaps for x in snap[1:3])):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    # ---- one step ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[tuple[object, Answer | RowFailed]]:
        """Launch the next step, then finish the one launched before it -> (key, Answer or RowFailed) for each row
        that finished or failed. The next step is planned and launched before the previous one's answers are read
        (the scheduler plans ahead of `done`), so the device runs one step while the host prepares the next and
        delivers the last; a call with nothing new to launch finishes what is in flight. Then the cache's budget is
        enforced, over what the rows in the schedule now hold beside it too (`held_bytes`)."""
        flight, out = self._launch()
        prev, self._flight = self._flight, flight
        if prev is not None:
            out += self._finish(prev)
        t0 = time.perf_counter()
        self.cache.index.held_bytes = self.held_bytes()
        self.cache.stats["evicted"] += len(self.cache.index.evict())
        self.seconds["evict"] += time.perf_counter() - t0
        return out

    def _launch(self) -> tuple["_Flight | None", list]:
        """Plan a step, bring its restores to the device (pinned until it is done), and launch its forwards (their
        states kept and answers copied to the host asynchronously) -> (the step in flight or None, rows failed)."""
        sec, t0 = self.seconds, time.perf_counter()
        step = self.sched.plan()
        t1 = time.perf_counter()
        sec["plan"] += t1 - t0
        if not step.pieces:
            return None, []
        out: list = []
        items, pinned = self._restore(step, out)
        t2 = time.perf_counter()
        sec["restore"] += t2 - t1
        self.stats["steps"] += 1
        self.stats["pieces"] += len(items)
        self.stats["tokens"] += step.tokens
        reads: list = []
        padded = self.runner.stats["padded_tokens"]
        start = self._mark()
        for failed, error in self._run(items, reads):
            out.append(self._fail(failed, error))
        end = self._mark()
        sec["forward"] += time.perf_counter() - t2
        shape = (len(step.pieces), step.tokens, self.runner.stats["padded_tokens"] - padded,
                 max(pc.tokens for pc in step.pieces),
                 round(sum(attn_pairs(pc.start, pc.tokens) for pc in step.pieces) / 1e6, 4))
        return _Flight(step, reads, pinned, (start, end, shape)), out

    def _finish(self, flight: "_Flight") -> list[tuple[object, Answer | RowFailed]]:
        """A launched step's end: its answers read (waiting for the device), the scheduler told, the rows it finished
        returned, its restores unpinned (`step` then enforces the cache's budget). A forward whose answers cannot be
        read gives its rows back (`retry`: the engine schedules them again) before the scheduler is told; the step's
        other forwards stand."""
        sec, t0 = self.seconds, time.perf_counter()
        out: list = []
        for items, wait in flight.reads:
            try:
                probs = wait().numpy()
            except Exception as e:  # noqa: BLE001 - the forward's rows are given back, the step's others stand
                log.warning("reading a step's answers failed: %s: %s", type(e).__name__, str(e)[:200])
                for rid in {it[1].rid for it in items} & set(self.live):  # nothing of them planted or answered
                    out.append(self._fail(rid, RowFailed("retry", f"reading its answers failed ({type(e).__name__}: "
                                                                   f"{e})")))
                continue
            for b, (bp, pc, live) in enumerate(items):
                if bp.slots and live.probs is not None:
                    for k, (j, opts) in enumerate(zip(_slots_in(live, pc.start, pc.end), bp.nopts)):
                        live.probs[j] = probs[b, k, : n_options(opts)].tolist()
        t1 = time.perf_counter()
        sec["read"] += t1 - t0
        self._log(flight)  # waits for the step's end
        t0, t1 = t1, time.perf_counter()
        sec["wait"] += t1 - t0
        for fin in self.sched.done(flight.step):
            live = self.live.pop(fin.row.rid)
            self._end(fin.row.rid, live)
            route = None
            if self.spec is not None:  # the router over the whole row; a run with another route is not answered
                route = self.spec.router.pick(live.fsum, len(live.row["ids"]))
                if route != live.route:
                    self.cache.stats["mispredict"] += 1
                    self.add(live.key, live.row, route, live.earlier + fin.computed, live.fresh)
                    continue
                self.cache.last_route = route
            if fin.path != "plain":  # the cache's rows (the engine counts plain ones)
                st = self.cache.stats
                st["rows"] += 1
                st["batched"] = st.get("batched", 0) + 1
                st["hits" if fin.path == "hit" else fin.path] += 1
                st["tokens_reused"] += fin.reused
                st["tokens_computed"] += fin.computed + live.earlier
            out.append((live.key, Answer(live.probs, fin.path, fin.reused, fin.computed + live.earlier, route)))
        self._unpin(flight)
        sec["done"] += time.perf_counter() - t1
        return out

    def _mark(self):
        """A point in the device's stream (a recorded CUDA event) or, on the CPU, where forwards run as they are
        called, the time now."""
        if self.runner.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _log(self, flight: "_Flight") -> None:
        """The finished step's shape and device time into `log`, once the step has ended on the device (waited for
        here: a step with answers has ended when they are read; one without, new pages' chunks alone, has not)."""
        if not flight.timing:
            return
        start, end, shape = flight.timing
        last, self._last_end = self._last_end, None
        if isinstance(start, float):
            ms = 1e3 * (end - start)
            gap = None if last is None else 1e3 * (start - last)
        else:
            try:
                end.synchronize()
                ms = start.elapsed_time(end)
                gap = None if last is None else last.elapsed_time(start)
            except RuntimeError as e:  # a step whose time cannot be read is left out of the log
                log.debug("a step's device time could not be read: %s", e)
                return
        self._last_end = end
        self.log.append((*shape, round(ms, 3), None if gap is None else round(gap, 3)))

    def _unpin(self, flight: "_Flight") -> None:
        for c in flight.pinned:
            self.cache.index.unpin(c)
        flight.pinned = []

    def _restore(self, step, out: list) -> tuple[list, list]:
        """The step's pieces as (runner Piece, scheduler piece, _Live), and the checkpoints they restore: brought to
        the device first and left pinned (the caller unpins them when the step is done: eviction in between, while
        the step runs, must not take them); a row whose restore cannot be brought fails with `retry` (the engine runs
        it again another way)."""
        index, st = self.cache.index, self.cache.stats
        restores = [pc.restore for pc in step.pieces if pc.restore is not None]
        for c in restores:
            index.pin(c)
        try:
            for c in restores:
                if c.tier != DEVICE and index.promote(c):
                    st["restored_host"] += 1
                elif c.tier == DEVICE:
                    st["restored_device"] += 1
        except BaseException:  # no step will unpin them
            for c in restores:
                index.unpin(c)
            raise
        items = []
        for pc in step.pieces:
            live = self.live.get(pc.rid)
            if live is None:
                continue
            if pc.restore is not None and (pc.restore.tier != DEVICE or pc.restore.payload is None):
                out.append(self._fail(pc.rid, RowFailed("retry", "its checkpoint could not be brought to the device")))
                continue
            try:
                items.append((self._piece(pc, live), pc, live))
            except Exception as e:  # noqa: BLE001 - this row only
                out.append(self._fail(pc.rid, RowFailed("retry", f"{type(e).__name__}: {e}")))
        return items, restores

    def _piece(self, pc, live: _Live) -> Piece:
        """The runner's piece for scheduler piece `pc` of row `live`; allocates the row's K/V buffer of [0, cap) at
        its first piece when it has more pieces to come or plants."""
        row, s, e = live.row, pc.start, pc.end
        if self.spec is not None and live.fsum is None:  # the router's feature sum from the restored position
            live.fsum = pc.restore.payload[2] if pc.restore is not None else self._zero_F
        if pc.restore is not None:
            conv, S = pc.restore.payload[:2]
            K, V = pc.restore.group.payload[:2]
        elif pc.continues:
            conv, S, K, V = live.conv, live.S, live.K, live.V
        else:
            conv, S, K, V = self._zero_conv, self._zero_S, None, None
        if live.K is None and (not pc.answer or pc.plants):  # more to come, or a group to make
            ref = self.runner.st.K
            live.K, live.V = kv_rows(ref, live.cap), kv_rows(ref, live.cap)
            if s:
                live.K[:, :s].copy_(K[:, :s])
                live.V[:, :s].copy_(V[:, :s])
        inside = tuple(x for x in pc.plants if x < e)
        if not s:
            K = V = None
        here = _slots_in(live, s, e)  # the row's slots this piece answers
        return Piece(row["ids"], s, e, conv, S, K, V, tuple(int(row["slots"][j]) for j in here),
                     tuple(row["options"][j] for j in here), live.route, inside, keep_state=not pc.answer,
                     images=row.get("mm"))

    def _run(self, items: list, reads: list) -> list[tuple[int, RowFailed]]:
        """Every piece through packed forwards (split at the runner's limits), isolating failures; returns the rows
        that failed. reads: gets (items, wait for their answers) for each forward that answers slots."""
        r = self.runner
        groups, cur, tokens, snaps = [], [], 0, 0
        # pieces holding image tokens run eagerly (statecache.run.batch): in forwards of their own, after the others
        items = [it for it in items if not it[0].has_image()] + [it for it in items if it[0].has_image()]
        for it in items:
            n, k = it[0].e - it[0].s, len(it[0].snaps)
            if cur and (len(cur) == r.max_batch or tokens + n > r.max_tokens or snaps + k > r.max_snaps
                        or it[0].has_image() != cur[-1][0].has_image()):
                groups.append(cur)
                cur, tokens, snaps = [], 0, 0
            cur.append(it)
            tokens += n
            snaps += k
        if cur:
            groups.append(cur)
        failed: list = []
        for g in groups:
            failed += self._forward(g, reads)
        return failed

    def _forward(self, items: list, reads: list) -> list[tuple[int, RowFailed]]:
        """One packed forward of `items` -> the rows that failed. Device memory running out frees cache and runs the
        same forward again while there is cache to free, then runs it in halves; any other failure runs it in halves
        until the failing piece stands alone."""
        pieces = [it[0] for it in items]
        r = self.runner
        try:
            r.ensure_pieces(pieces)
            r.load(pieces)
            out = r.forward(pieces)
            if self.cache.host is not None:  # the forward is launched: the host tier's slab is registered meanwhile
                self.cache.host.grow_while_device_runs()
            self._keep(items)
            if any(p.slots for p in pieces):  # copied to the host behind the forward, read when the step is done
                reads.append((items, r.read_later(out)))
            self.stats["forwards"] += 1
            return []
        except torch.OutOfMemoryError as e:
            if self._relieve():
                return self._forward(items, reads)
            if len(items) == 1:
                self.stats["oom_failed"] += 1
                return [(items[0][1].rid, RowFailed(
                    "out_of_memory", f"device memory ran out for this row alone with the cache emptied ({e}); give the "
                    "worker a device with more free memory, or lower STATECACHE_MAX_ROW_TOKENS"))]
            h = len(items) // 2
            return self._forward(items[:h], reads) + self._forward(items[h:], reads)
        except Exception as e:  # noqa: BLE001 - isolate the failing row by halving
            if len(items) == 1:
                log.warning("a step's piece failed: %s: %s", type(e).__name__, str(e)[:200])
                code = "internal" if not isinstance(e, NotBatched) else "retry"
                return [(items[0][1].rid, RowFailed(code, f"{type(e).__name__}: {e}"))]
            h = len(items) // 2
            return self._forward(items[:h], reads) + self._forward(items[h:], reads)

    def _relieve(self) -> bool:
        """Device memory ran out: move half the device tier's bytes out (least recently used first; to the host tier
        where there is one) and give the allocator's cached blocks back. False when the device tier had nothing left
        to give (the caller then runs smaller forwards)."""
        index = self.cache.index
        before = index.bytes
        if before:
            budget = index.budget_bytes
            index.budget_bytes = before // 2
            try:
                self.cache.stats["evicted"] += len(index.evict())
            finally:
                index.budget_bytes = budget
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        freed = index.bytes < before
        if freed:
            self.stats["oom_relieved"] += 1
            log.warning("device memory ran out in a step: moved %.1f MiB of the cache out of the device; running the "
                        "forward again", (before - index.bytes) / 2**20)
        return freed

    def _keep(self, items: list) -> None:
        """After a forward is launched, on the device behind it: each piece's chunk K/V into its row's buffer, its
        end state and snapshots kept (before the next forward overwrites the runner's buffers)."""
        r, t0 = self.runner, time.perf_counter()
        pieces = [it[0] for it in items]
        for b, (bp, pc, live) in enumerate(items):
            s, e = pc.start, pc.end
            if live.K is not None:
                upto = min(e, live.K.shape[1])
                if upto > s:
                    Kc, Vc = r.chunk_kv(pieces, b)
                    live.K[:, s:upto].copy_(Kc[:, : upto - s])
                    live.V[:, s:upto].copy_(Vc[:, : upto - s])
            for pos, (conv, S) in zip(bp.snaps, r.snapshot(pieces, b)) if bp.snaps else ():
                live.snaps.append((pos, conv.clone(), S.clone(), None))
            if self.spec is not None:  # a new tensor each piece: a planted checkpoint may keep the running sum itself
                live.fsum = live.fsum + r.st.F[b]
            if not pc.answer:
                live.conv, live.S = r.st.conv[:, b].clone(), r.st.S[:, b].clone()
                if e in pc.plants:
                    live.snaps.append((e, live.conv, live.S, live.fsum))
        self.seconds["keep"] += time.perf_counter() - t0

    # ---- planting and ends ---------------------------------------------------------------------------------------

    def _planted(self, rid, positions, last: bool, forks=()) -> None:
        """The scheduler's word that a row's pieces passed `positions`; on the last, its group is planted (`forks`:
        the row's fork points, planted as such)."""
        if not last:
            return
        live = self.live.get(rid)
        if live is None or live.K is None:
            return
        snaps = sorted((s for s in live.snaps if s[0] <= live.p), key=lambda s: s[0])  # (pos, conv, S, fsum)
        if not snaps or snaps[-1][0] != live.p:
            return
        t0 = time.perf_counter()
        K, V = live.K, live.V
        if K.shape[1] > live.p:  # the buffer also holds the question's K/V (a question of several pieces): not kept
            K, V = kv_rows(K, live.p).copy_(K[:, : live.p]), kv_rows(V, live.p).copy_(V[:, : live.p])
        try:
            self.cache.plant(_keys(live.row), live.p, snaps, live.route, (K, V), forks)
        except Exception:  # noqa: BLE001 - the answers stand; only the planting is lost
            log.exception("planting a step's checkpoints failed")
        live.snaps = []
        self.seconds["plant"] += time.perf_counter() - t0

    def _end(self, rid: int, live: _Live) -> None:
        if live.pinned is not None:
            self.cache.index.unpin(live.pinned)
            live.pinned = None
        live.K = live.V = live.conv = live.S = None

    def _fail(self, rid: int, error: RowFailed) -> tuple[object, RowFailed]:
        self.sched.drop(rid)
        live = self.live.pop(rid)
        self._end(rid, live)
        self.stats["failed"] += 1
        error.row = live.row
        return live.key, error

    def clear(self) -> list[tuple[object, RowFailed]]:
        """Give up every row in the schedule, the step in flight included (each comes back with a `retry` failure)."""
        if self._flight is not None:
            self._unpin(self._flight)
            self._flight = None
        out = [self._fail(rid, RowFailed("retry", "the schedule was cleared")) for rid in list(self.live)]
        self.sched.abandon()  # the step in flight, and one planned when the failure came, are never done
        return out
