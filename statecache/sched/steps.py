"""The step scheduler: which pieces of which rows one GPU step runs, under a token budget.

Rows come in (`add`) with their tokens, state length and answer slots. Each `plan()` fills one step, in order, and
stops at the first piece that does not fit (so nothing is served out of order):
1. **hits**: rows whose state is saved at its end p (`view.lookup`), first come first served; each one piece
   [p, n) from its own checkpoint, which gives its answer;
2. **short continuations** (a saved state with `short_tokens` or fewer left from its deepest checkpoint: a state
   grown by an action), first come first served, from that checkpoint to the question's end;
3. **long computations** (new pages, states changed in the middle, rows the cache cannot take), first come first
   served: each advances at most `chunk_tokens` a step, cut at multiples of `align` (so that the state's other
   checkpoints, on that grid, are never just past a cut), never past p (nor a plain row's first slot, aligned down):
   the question [stop, n) is its own part.
   A page so spreads over several steps and each step's hits ride along.
The question part runs as one piece [stop, n) unless the runner's limits cut it: at most `max_piece` tokens a piece
(cut at multiples of `align`) and at most `max_slots` answer slots a piece (cut at the first slot past them); a
piece answers the slots inside it, and the row's answer is complete when its last piece has run. A hit whose
question is one piece is a hit above; one whose question takes several pieces runs with the long computations.
A step holds at most `budget_tokens` tokens (`busy_tokens` while the scheduler holds `busy_rows` rows or more: where
rows queue, fuller steps answer more of them a second; `budget`) and `max_seqs` pieces (one piece per row: a sequence
continues its own state), with one stated exception: a question piece (cut only by the rule above) longer than the
whole budget runs alone in a step of its own.

A computation plants the checkpoints the engine's rule gives (`Layout.positions`: p, and p - tail and the multiples
of stride below p, aligned; at least MIN_ADVANCE past where it restored) in the piece whose range (start, end] holds
each one, never closer than MIN_ADVANCE to the start of a piece that keeps it inside itself (with
`snapshots` False, where a runner cannot keep states inside a piece, each piece ends at the first one it reaches).
A row may name a route (specialists): it restores only that route's checkpoints and waits only for a computation
of the same route. A new
state (nothing restored) asks the `cold_ok` policy (statecache.cache.policy, the one place that decides) once, when its
first piece is granted; declined, it plants nothing, and the rows waiting with the same state are not asked about
again (they run as it does). A row answers when its last piece has run (`done`).
A row never computes what another row is computing: a row whose tokens reach a checkpoint that a started
computation will plant (in this step or an earlier unfinished one) and that is deeper than what the cache holds
for it waits, and takes the checkpoint when it is planted (usually a hit). Steps may be planned ahead of `done`
(a pipelined caller); `done` must see them in the order they were planned.

The plan is plain data (`Step`, `Piece`); `done(step)` advances each piece, tells the view which checkpoints now
exist (and which of them are fork points) and which restored checkpoint a finished row continued past (`retire`: a
grown state's old end is the first to go), and returns the rows it finished (`Finished`: path, tokens reused and
computed). Knows nothing of tensors,
the model, Redis or the worker; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from statecache.cache.index import MIN_ADVANCE
from statecache.cache.policy import ColdContext, ColdPolicy, PlantWhenItFits
from statecache.sched.layout import Layout
from statecache.sched.view import CacheView

HIT, PARTIAL, COLD, PLAIN = "hit", "partial", "cold", "plain"
HITS, SHORT, LONG = 0, 1, 2  # the order a step is filled in


@dataclass(eq=False)
class Row:
    """One row: `ids` its tokens (what the cache knows it by: an image row's key tokens), the first `state_len` of
    them its state; `slots` its answer positions (default: the last token). `cacheable` False: the cache cannot take
    it (statecache.cache.store.StateCache.eligible says no): it is computed from 0, looks nothing up and plants nothing."""

    rid: Hashable
    ids: Sequence[int]
    state_len: int
    slots: Sequence[int] = ()
    cacheable: bool = True
    forks: tuple = ()  # positions below p where its tokens leave a cached state's (statecache.cache.store.fork_point): planted
    route: int | None = None  # specialists: the route it runs with (it restores and plants that route's checkpoints)

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def first_slot(self) -> int:
        return min(self.slots) if len(self.slots) else self.n - 1


def attn_pairs(start: int, length: int) -> float:
    """The attention query-key pairs of a piece of `length` tokens starting at `start` (each token attends to the
    positions before it and itself, about): what a step's attention costs grow with (statecache.step's log,
    bench/step_sim.py's cost model)."""
    return length * (start + length / 2)


@dataclass(frozen=True)
class Piece:
    """One sequence of a step: tokens [start, end) of row `rid`. `restore`: the checkpoint it starts from (the
    first piece of a row continuing a saved state), None otherwise; `continues`: it starts from the state its row's
    previous piece left (an earlier step); neither: it starts from nothing (position 0). `plants`: checkpoint
    positions in (start, end] whose state this piece keeps; `answer`: the row's last piece (the row is answered when
    it has run; each piece answers the row's slots in [start, end))."""

    rid: Hashable
    start: int
    end: int
    restore: object | None
    continues: bool
    plants: tuple[int, ...]
    answer: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class Step:
    serial: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(pc.tokens for pc in self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)


@dataclass(frozen=True)
class Finished:
    row: Row
    path: str  # hit | partial | cold | plain
    reused: int  # tokens restored from a checkpoint
    computed: int  # tokens run
    steps: int  # steps its pieces ran in


@dataclass(eq=False)
class _Job:
    row: Row
    p: int
    start: int  # position restored (0: nothing)
    restore: object | None
    path: str
    kind: int  # HITS | SHORT | LONG
    seq: int  # arrival order
    cursor: int  # where its next piece starts (planned)
    stop: int  # a non-final piece ends at or before this (p; a plain row's first slot, aligned)
    todo: list[int] = field(default_factory=list)  # positions to plant not yet planned into a piece
    unplanted: list[int] = field(default_factory=list)  # positions planned or to plan, not yet planted (`done`)
    pieces: int = 0


def slots_at_one_position(slots: Sequence[int]) -> int:
    """The most answer slots any one position holds (0 for none): a piece holding them all must take that many."""
    return int(np.unique(np.asarray(slots), return_counts=True)[1].max()) if len(slots) else 0


def _same(a, b, k: int) -> bool:
    """a[:k] == b[:k] for lists or int arrays."""
    if isinstance(a, list) and isinstance(b, list):
        return a[:k] == b[:k]
    return bool(np.array_equal(np.asarray(a[:k]), np.asarray(b[:k])))


class Scheduler:
    def __init__(self, view: CacheView, layout: Layout | None = None, *, budget_tokens: int = 2048,
                 chunk_tokens: int = 1024, max_seqs: int = 64, short_tokens: int | None = None,
                 cold_ok: ColdPolicy | None = None, max_plants_piece: int | None = None,
                 max_piece: int | None = None, max_slots: int | None = None, snapshots: bool = True,
                 busy_tokens: int | None = None, busy_rows: int | None = None):
        self.view = view
        self.layout = layout or Layout.from_settings()
        a = self.layout.align
        if budget_tokens < a or chunk_tokens < a or max_seqs < 1:
            raise ValueError(f"budget_tokens and chunk_tokens must be >= align ({a}), max_seqs >= 1")
        if max_plants_piece is not None and max_plants_piece < 1:
            raise ValueError("max_plants_piece must be >= 1 (or None)")
        if max_piece is not None and max_piece < a or max_slots is not None and max_slots < 1:
            raise ValueError(f"max_piece must be >= align ({a}) and max_slots >= 1 (or None)")
        self.max_piece, self.max_slots = max_piece, max_slots
        self.snapshots = snapshots  # False: a piece plants only at its end (it is cut at its first checkpoint)
        self.budget_tokens, self.chunk_tokens, self.max_seqs = int(budget_tokens), int(chunk_tokens), int(max_seqs)
        if (busy_tokens is None) != (busy_rows is None) or busy_tokens is not None and (
                busy_tokens < self.budget_tokens or busy_rows < 1):
            raise ValueError(f"busy_tokens ({busy_tokens}) and busy_rows ({busy_rows}) go together, busy_tokens >= "
                             f"budget_tokens ({budget_tokens}) and busy_rows >= 1")
        self.busy_tokens, self.busy_rows = busy_tokens, busy_rows
        self.short_tokens = self.chunk_tokens if short_tokens is None else int(short_tokens)
        self.cold_ok: ColdPolicy = cold_ok if cold_ok is not None else PlantWhenItFits()
        self.max_plants_piece = max_plants_piece
        self._waiting: list[tuple[int, Row]] = []  # (arrival order, row), not started
        self._jobs: dict[Hashable, _Job] = {}  # started (planned into a step), not finished
        self._planting: dict[Hashable, _Job] = {}  # started jobs with checkpoints still to plant
        self._seq = 0
        self._serial = 0  # steps planned
        self._done = 0  # steps done
        self._lookups: dict[Hashable, tuple[int, object]] = {}  # rid -> (view version, found)
        self._declined: set = set()  # waiting rows whose state cold_ok declined for a row before them
        self.backlog = 0  # rows waiting beyond the schedule (the caller's view of its queue): cold_ok's waiting_rows
        self.stats = {"steps": 0, "pieces": 0, "tokens": 0, "declined": 0, "waited": 0}

    # ---- rows in -------------------------------------------------------------------------------------------------

    def add(self, row: Row, found=None) -> None:
        """A row joins the waiting rows. found: the caller's own `view.lookup(row.ids, p)`, made while the view's
        version is what it is now (kept instead of looking again)."""
        if row.rid in self._jobs or any(r.rid == row.rid for _, r in self._waiting):
            raise ValueError(f"row {row.rid!r} is already scheduled")
        if row.state_len < 0 or row.state_len > row.n or row.n < 1:
            raise ValueError(f"row {row.rid!r}: state_len {row.state_len} outside its {row.n} tokens")
        if self.max_slots is not None and slots_at_one_position(row.slots) > self.max_slots:
            raise ValueError(f"row {row.rid!r}: more than max_slots ({self.max_slots}) answer slots at one position")
        self._waiting.append((self._seq, row))
        self._seq += 1
        if found is not None:
            self._lookups[row.rid] = (self.view.version, found)

    def pending(self) -> int:
        """Rows not finished (waiting or started)."""
        return len(self._waiting) + len(self._jobs)

    def waiting(self) -> int:
        return len(self._waiting)

    def budget(self) -> int:
        """The next step's token budget: `busy_tokens` while `busy_rows` rows or more are in the schedule (rows
        queue: fuller steps, fewer of a step's fixed costs a row), else `budget_tokens` (a light load: hits answered
        sooner)."""
        if self.busy_rows is not None and self.pending() >= self.busy_rows:
            return self.busy_tokens
        return self.budget_tokens

    # ---- one step ------------------------------------------------------------------------------------------------

    def plan(self) -> Step:
        """The next step (possibly empty: nothing runnable now; an empty step takes no place in the order `done`
        keeps, and `done` of it does nothing)."""
        step = Step(self._serial + 1)
        left = self.budget()
        started: set = set()
        cands = self._candidates()
        for kind, seq, item in cands:
            if len(step.pieces) >= self.max_seqs:
                break
            if isinstance(item, _Job):
                job = item
            else:
                row = item
                found, c, p = self._lookup(row)
                if self._will_plant(row, c, p):  # a started computation will plant deeper along its tokens: wait
                    self.stats["waited"] += 1
                    continue
                job = self._new_job(row, seq, found, c, p, kind)
            piece = self._cut(job, left, empty=not step.pieces)
            if piece is None:
                break  # first come first served: nothing later jumps a piece that does not fit
            if job.row.rid not in self._jobs:
                self._start(job, step, self.pending() - len(started))  # started rows are in both lists
                started.add(job.row.rid)
                piece = self._cut(job, left, empty=not step.pieces)  # with its planting decided
            self._take(job, piece)
            step.pieces.append(piece)
            left -= piece.tokens
        if started:
            self._waiting = [(s, r) for s, r in self._waiting if r.rid not in started]
        if step.pieces:
            self._serial = step.serial
        self.stats["steps"] += bool(step.pieces)
        self.stats["pieces"] += len(step.pieces)
        self.stats["tokens"] += step.tokens
        return step

    def done(self, step: Step) -> list[Finished]:
        """The step ran: advance its pieces, record their checkpoints in the view, return the rows it finished."""
        if not step.pieces:
            return []
        if step.serial != self._done + 1:
            raise ValueError(f"step {step.serial} done out of order (expected {self._done + 1})")
        self._done = step.serial
        out = []
        for pc in step.pieces:
            job = self._jobs.get(pc.rid)
            if job is None:  # dropped since it was planned
                continue
            if pc.restore is not None:
                self.view.touch(pc.restore)
            if pc.plants:
                for pos in pc.plants:
                    job.unplanted.remove(pos)
                self.view.planted(pc.rid, job.row.ids, job.p, pc.plants, last=not job.unplanted, route=job.row.route,
                                  forks=job.row.forks)
                if not job.unplanted:
                    self._planting.pop(pc.rid, None)
            if pc.answer:
                if job.path == PARTIAL:  # it grew the restored state (or continued a prefix): the view decides
                    self.view.retire(job.restore)
                del self._jobs[pc.rid]
                self._planting.pop(pc.rid, None)
                self._declined.discard(pc.rid)
                self._lookups.pop(pc.rid, None)
                out.append(Finished(job.row, job.path, job.start, job.row.n - job.start, job.pieces))
        return out

    def abandon(self) -> None:
        """The steps planned and not yet done will never be done (a step raised past its own isolation and the caller
        gives up every row in the schedule, with `drop`): the next step planned is the next one `done` expects."""
        self._done = self._serial

    def drop(self, rid: Hashable) -> Row | None:
        """Forget a row, waiting or started (its computation failed, or its caller gave it up): nothing of it runs
        again, the checkpoints it had still to plant are not waited for. Returns the row (None: not scheduled).
        Steps already planned that hold its pieces may still be `done` (those pieces are skipped)."""
        self._lookups.pop(rid, None)
        self._planting.pop(rid, None)
        self._declined.discard(rid)
        job = self._jobs.pop(rid, None)
        if job is not None:
            return job.row
        for k, (_, row) in enumerate(self._waiting):
            if row.rid == rid:
                del self._waiting[k]
                return row
        return None

    # ---- internals -----------------------------------------------------------------------------------------------

    def _candidates(self) -> list:
        """(kind, arrival, job or row) in the order a step is filled: hits, short, long; each first come first
        served. A waiting row's kind is its lookup's; started jobs keep theirs."""
        out = []
        for job in self._jobs.values():
            if job.kind != HITS and job.cursor < job.row.n:
                out.append((job.kind, job.seq, job))
        for seq, row in self._waiting:
            _, c, p = self._lookup(row)
            if row.cacheable and p > 0 and c == p and self.question_end(row, p) == row.n:
                kind = HITS
            else:
                kind = SHORT if 0 < c and row.n - c <= self.short_tokens else LONG  # new states: pages
            out.append((kind, seq, row))
        out.sort(key=lambda t: (t[0], t[1]))
        return out

    def _lookup(self, row: Row) -> tuple[object, int, int]:
        """(checkpoint found or None, its position or 0, p) for a waiting row; kept while the view's version holds."""
        p = self.layout.end(row.state_len)
        if not row.cacheable or p == 0:
            return None, 0, p
        v = self.view.version
        got = self._lookups.get(row.rid)
        if got is None or got[0] != v:
            got = (v, self.view.lookup(row.ids, p) if row.route is None else self.view.lookup(row.ids, p, row.route))
            self._lookups[row.rid] = got
        found = got[1]
        return found, (found.pos if found is not None else 0), p

    def _will_plant(self, row: Row, c: int, p: int) -> bool:
        """Does a started computation plant, later, a checkpoint in (c, p] of this row's tokens?"""
        if not row.cacheable or p == 0:
            return False
        for job in self._planting.values():
            if job.row.route != row.route:  # another route's checkpoints would not serve it
                continue
            for pos in reversed(job.unplanted):
                if c < pos <= p and _same(row.ids, job.row.ids, pos):
                    return True
        return False

    def _new_job(self, row: Row, seq: int, found, c: int, p: int, kind: int) -> _Job:
        cacheable = row.cacheable and p > 0
        a = self.layout.align
        stop = p if cacheable else row.first_slot - row.first_slot % a
        path = HIT if cacheable and c == p else (PARTIAL if c > 0 else COLD if cacheable else PLAIN)
        return _Job(row, p, c, found, path, kind, seq, cursor=p if kind == HITS else c, stop=stop)

    def _start(self, job: _Job, step: Step, batch_rows: int) -> None:
        """A job's first piece is granted: decide its planting (cold_ok, once, for a new state) and register it."""
        row = job.row
        plant = job.path != HIT and row.cacheable and job.p > 0
        if plant and job.start == 0:
            if row.rid in self._declined:  # its state was declined for a row before it: not asked again
                self._declined.discard(row.rid)
                plant = False
            else:
                same = [r for _, r in self._waiting if r.cacheable and self.layout.end(r.state_len) == job.p
                        and _same(r.ids, row.ids, job.p)]
                ctx = ColdContext(state_tokens=job.p, state_bytes=self.view.state_bytes(row.state_len),
                                  budget_bytes=self.view.budget_bytes, used_bytes=self.view.used_bytes,
                                  sharing_rows=max(1, len(same)), batch_rows=batch_rows, waiting_rows=self.backlog,
                                  host_budget_bytes=getattr(self.view, "host_budget_bytes", 0))
                plant = bool(self.cold_ok(ctx))
                if not plant:
                    self.stats["declined"] += 1
                    self._declined.update(r.rid for r in same if r.rid != row.rid)
            if not plant:
                job.path = PLAIN
        if plant:
            job.todo = self.layout.positions(job.start, row.state_len, row.forks)
            job.unplanted = list(job.todo)
            if job.todo:
                self._planting[row.rid] = job
        self._jobs[row.rid] = job

    def _cut(self, job: _Job, left: int, empty: bool) -> Piece | None:
        """The job's next piece within `left` tokens (None: it does not fit this step)."""
        a, n, s = self.layout.align, job.row.n, job.cursor
        cap = min(left, self.chunk_tokens, self.max_piece or left)
        if s >= job.stop:  # the question: pieces as the runner's limits cut it, not split further
            e = self.question_end(job.row, s)
            if e - s > left and not empty:
                return None  # (longer than the whole budget: alone in a step of its own)
        elif n - s <= cap and self.question_end(job.row, job.stop) == n and (
                job.stop - s >= MIN_ADVANCE or job.stop not in job.todo):  # p inside it far enough to be kept there
            e = n
        else:
            e = min((s + cap) - (s + cap) % a, job.stop)  # on the grid of the aligned checkpoints
            if e <= s:
                return None
        plants = [pos for pos in job.todo if s < pos <= e]
        if not self.snapshots and plants and plants[0] < e:
            e, plants = plants[0], plants[:1]
        k = self.max_plants_piece
        if k is not None and len(plants) > k:
            plants = plants[:k]
            e = plants[-1]
        started = job.row.rid in self._jobs
        return Piece(job.row.rid, s, e, job.restore if job.pieces == 0 else None, started and job.pieces > 0,
                     tuple(plants), e == n)

    def question_end(self, row: Row, s: int) -> int:
        """Where the question piece starting at s ends: n, or earlier where it holds more than `max_piece` tokens
        (cut at a multiple of align) or more than `max_slots` slots (cut at the first slot past them)."""
        e, a = row.n, self.layout.align
        if self.max_piece is not None and e - s > self.max_piece:
            e = s + self.max_piece - self.max_piece % a
        if self.max_slots is not None and row.slots:
            pos, counts = np.unique(np.asarray(row.slots), return_counts=True)
            k = int(np.searchsorted(pos, s))
            within = np.cumsum(counts[k:])
            over = int(np.searchsorted(within, self.max_slots, side="right"))  # first position that would exceed
            if over < len(within):
                e = min(e, int(pos[k + over]))
        return e

    def _take(self, job: _Job, piece: Piece) -> None:
        job.cursor = piece.end
        job.pieces += 1
        if piece.plants:
            job.todo = [pos for pos in job.todo if pos not in piece.plants]
