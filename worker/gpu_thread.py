"""The one thread that drives the engine (and so the GPU); the event loop never waits on it.

Jobs `submit(row)` and await the returned `Ticket`: `reached` resolves when the thread hands the row to the engine
(the row has reached the model), `result` with the row's result. The thread builds the engine itself (so every CUDA
call, graph capture included, happens on this one thread) and only then reports itself started; then it loops, a
step at a time (nano-vllm's `step()`): take what is ready here (up to `max_batch_rows`, without waiting while the
engine has rows in its schedule), hand it to the engine (`engine.submit(rows, tickets, waiting_rows=N)`, N being the
rows waiting beyond it: `waiting(pending)`, the ready jobs in Redis nobody took plus the rows queued here), resolve
what it answered at once (bad rows, memo answers, rows of its other paths), run one step (`engine.step()`) and
resolve the rows it finished, each from the thread with `loop.call_soon_threadsafe`. Scheduling (which pieces of
which rows a step runs, grouping by shared state, new pages in chunks beside the hits) is the engine's business;
nothing re-enters the engine from inside a forward. After each turn, `on_batch` gets the rows it answered with their
results and a snapshot of `engine.stats()` (for the metrics).

The worker never dies of a row: if the engine raises on a submission, its rows are submitted again one at a time and
a row that still raises gets an `internal` error result; if a step raises, the rows in the schedule get an `internal`
error (the engine's schedule is cleared). Rows whose job was cancelled or withdrawn before they reached the engine
are skipped. On stop, nothing new is taken; the rows in the schedule are run to their end (within the stop's wait).

Knows the engine contract (`submit`, `step`, `pending`, `stats`) and asyncio futures; does not know Redis or arq.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from statecache.protocol import error_result

log = logging.getLogger("statecache.worker")

MAX_BATCH_ROWS = 1024  # at most this many rows in one engine call


class Stopping(RuntimeError):
    """The thread is shutting down and takes no more rows."""


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any = None, exc: BaseException | None = None,
            cancel: bool = False) -> None:
    def done() -> None:
        if fut.done():
            return
        if cancel:
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


class Ticket:
    """One row (or one call) handed to the thread. `reached`/`result` are futures of the submitting loop;
    `reached_at` (time.time()) and `engine_s` (seconds from reaching the engine to its answer) are set by the thread."""

    __slots__ = ("kind", "payload", "loop", "reached", "result", "reached_at", "engine_s", "started")

    def __init__(self, kind: str, payload: Any, loop: asyncio.AbstractEventLoop):
        self.kind, self.payload, self.loop = kind, payload, loop
        self.reached: asyncio.Future = loop.create_future()
        self.result: asyncio.Future = loop.create_future()
        self.reached_at = 0.0
        self.engine_s = 0.0
        self.started = 0.0  # perf_counter when it reached the engine

    def dead(self) -> bool:
        return self.result.cancelled()


class GpuThread:
    def __init__(
        self,
        make_engine: Callable[[], Any],
        waiting: Callable[[int], int] = lambda pending_rows: pending_rows,
        on_batch: Callable[[list, list, float, dict], None] | None = None,
        max_batch_rows: int = MAX_BATCH_ROWS,
    ):
        self._make_engine = make_engine
        self._waiting = waiting
        self._on_batch = on_batch
        self._max_batch_rows = max_batch_rows
        self._items: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.engine: Any = None
        self.engine_stats: dict = {}  # the last engine.stats() snapshot (taken on this thread after each batch)
        self.busy = False  # a batch is running
        self._step_at = time.monotonic()  # when the engine last finished a turn (stalled_s)
        self._scheduled: dict[int, Ticket] = {}  # id(ticket) -> ticket: rows handed to the engine, not answered yet
        self.counters = {"batches": 0, "rows": 0, "largest_batch": 0, "engine_errors": 0, "busy_s": 0.0}

    # --- event-loop side ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread and wait until it has built the engine (precapture included); raises what building
        it raised."""
        self._thread = threading.Thread(target=self._run, name="statecache-gpu", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def submit(self, row: Any, kind: str = "row") -> Ticket:
        """Queue a row (or, kind "call", a function of the engine); must be called on the awaiting loop."""
        ticket = Ticket(kind, row, asyncio.get_running_loop())
        with self._cv:
            if self._stopping:
                raise Stopping("the GPU thread is stopping")
            self._items.append(ticket)
            self._cv.notify()
        return ticket

    def withdraw(self, ticket: Ticket) -> bool:
        """Take a ticket back if the thread has not taken it yet (True), so its job can go back to the queue."""
        with self._cv:
            try:
                self._items.remove(ticket)
            except ValueError:
                return False
        ticket.result.cancel()
        return True

    async def answer(self, row: Any) -> dict:
        ticket = self.submit(row)
        return await ticket.result

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the thread between batches (engine state is only touched there)."""
        return await self.submit(fn, "call").result

    def pending(self) -> int:
        """Rows not answered yet: queued here, or handed to the engine and in its schedule."""
        return len(self._items) + len(self._scheduled)

    def stalled_s(self) -> float:
        """Seconds the engine has been inside one turn (a submission and a step); 0 while the thread is idle. The
        worker's liveness reads it."""
        return time.monotonic() - self._step_at if self.busy else 0.0

    def making_progress(self, bound_s: float) -> bool:
        """Idle, or inside a step younger than `bound_s` (0: always): what the worker's health key and readiness
        stand for (worker.jobs, worker.routing)."""
        return bound_s <= 0 or self.stalled_s() < bound_s

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, wait_s: float) -> bool:
        """Take nothing new; let the rows in the engine's schedule finish (up to `wait_s`), cancel what still waits
        here; True if the thread ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is None:
            return True
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    # --- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
            self._snapshot()
        except BaseException as e:  # reported to start()'s caller
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                got = self._take()
                if got is None:
                    break
                try:
                    self._turn(got)
                finally:
                    self.busy = bool(self._scheduled)
        finally:
            with self._cv:
                left, self._items = list(self._items), deque()
            for t in left + list(self._scheduled.values()):
                _settle(t.loop, t.result, cancel=True)  # the job is re-queued by arq, not answered with an error

    def _take(self) -> list[Ticket] | None:
        """What is ready here (nothing waited for while the engine has rows in its schedule); None: stop now."""
        with self._cv:
            while not self._items and not self._scheduled and not self._stopping:
                self._cv.wait()
            if self._stopping and not self._scheduled:
                return None
            batch = []
            while self._items and len(batch) < self._max_batch_rows and not self._stopping:
                batch.append(self._items.popleft())
            self._step_at = time.monotonic()
            self.busy = True
            return batch

    def _snapshot(self) -> None:
        try:
            self.engine_stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics are not worth a failed batch
            log.exception("engine.stats() failed")

    def _turn(self, batch: list[Ticket]) -> None:
        """One turn: the new rows handed to the engine, then one step."""
        t0 = time.perf_counter()
        rows = []
        for t in batch:
            if t.dead():
                continue
            if t.kind == "call":
                try:
                    _settle(t.loop, t.result, t.payload(self.engine))
                except Exception as e:
                    _settle(t.loop, t.result, exc=e)
            else:
                rows.append(t)
        done: list = []
        if rows:
            with self._cv:  # the rows queued behind these (not those the engine already holds)
                waiting = max(0, int(self._waiting(len(self._items))))
            now = time.time()
            for t in rows:
                t.reached_at, t.started = now, t0
                _settle(t.loop, t.reached, True)
                self._scheduled[id(t)] = t
            done += self._submit(rows, waiting)
            c = self.counters
            c["batches"] += 1
            c["rows"] += len(rows)
            c["largest_batch"] = max(c["largest_batch"], len(rows))
        if self._scheduled and self.engine.pending():
            try:
                done += self.engine.step()
            except Exception as e:  # noqa: BLE001 - the rows in the schedule fail, the worker goes on
                self.counters["engine_errors"] += 1
                log.exception("a step failed; failing the %d rows in the schedule", len(self._scheduled))
                clear = getattr(self.engine, "clear_schedule", None)
                if clear is not None:
                    clear()
                done += [(k, _internal_error(e)) for k in list(self._scheduled)]
        elif self._scheduled:  # the engine holds none of them (it lost them): they fail rather than wait forever
            log.error("%d rows were handed to the engine and never answered", len(self._scheduled))
            done += [(k, error_result("internal", "the engine lost this row; see the worker log"))
                     for k in list(self._scheduled)]
        engine_s = time.perf_counter() - t0
        self.counters["busy_s"] += engine_s
        self._step_at = time.monotonic()
        if not done:
            return
        end = time.perf_counter()
        tickets, results = [], []
        for key, result in done:
            t = self._scheduled.pop(key, None)
            if t is None:
                continue
            t.engine_s = end - t.started
            tickets.append(t)
            results.append(result)
        self._snapshot()
        if self._on_batch is not None:
            try:
                self._on_batch(tickets, results, engine_s, self.engine_stats)
            except Exception:  # noqa: BLE001
                log.exception("the batch hook failed")
        for t, result in zip(tickets, results):
            _settle(t.loop, t.result, result)

    def _submit(self, rows: list[Ticket], waiting: int) -> list[tuple]:
        """engine.submit, each row tagged by its ticket; a submission that raises is made again one row at a time, and
        a row that still raises gets an `internal` error."""
        try:
            return list(self.engine.submit([t.payload for t in rows], [id(t) for t in rows], waiting_rows=waiting))
        except Exception as e:
            self.counters["engine_errors"] += 1
            log.exception("engine failed on a submission of %d rows; submitting them one at a time", len(rows))
            if len(rows) == 1:
                return [(id(rows[0]), _internal_error(e))]
        out = []
        for t in rows:
            try:
                out += self.engine.submit([t.payload], [id(t)], waiting_rows=waiting)
            except Exception as e:
                log.exception("engine failed on a row")
                out.append((id(t), _internal_error(e)))
        return out


def _internal_error(e: Exception) -> dict:
    return error_result("internal", f"the engine failed on this row ({type(e).__name__}: {e}); see the worker log")
