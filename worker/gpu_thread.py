"""The one thread that drives the engine (and so the GPU); the event loop never waits on it.

Jobs `submit(row)` and await the returned `Ticket`: `reached` resolves when the thread takes the row into a
batch (the row has reached the model), `result` with the row's result. The thread builds the engine itself (so
every CUDA call, graph capture included, happens on this one thread) and only then reports itself started;
then it loops: take everything that is ready (up to `max_batch_rows`), call
`engine.answer(rows, waiting_rows=N)` once, N being the rows waiting beyond this batch (`waiting(pending)`:
the ready jobs in Redis nobody took plus the rows queued here), and resolve each ticket from the thread with
`loop.call_soon_threadsafe`. Grouping by shared state, the memo and the paths are the engine's business;
handing it the whole drained batch at once is this thread's. After each batch, `on_batch` gets the rows'
results and timings and a snapshot of `engine.stats()` (for the metrics). While a batch runs a long forward,
an engine that takes a `between` callback calls it between its chunks; rows that arrived meanwhile and can be
answered at once (`engine.answer_ready`: memo answers, continuations of saved states) are answered then (they
reach the model and resolve there), the rest stay queued for the next batch (chunked prefill) and are not offered
again while this batch runs.

The worker never dies of a row: if the engine raises on a batch, the rows are retried one at a time and a
row that still raises gets an `internal` error result. Rows whose job was cancelled or withdrawn meanwhile
are skipped.

Knows the engine contract (`answer`, `stats`) and asyncio futures; does not know Redis or arq.
"""

from __future__ import annotations

import asyncio
import inspect
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
    `reached_at` (time.time()) and `engine_s` (the batch's engine time) are set by the thread."""

    __slots__ = ("kind", "payload", "loop", "reached", "result", "reached_at", "engine_s", "early")

    def __init__(self, kind: str, payload: Any, loop: asyncio.AbstractEventLoop):
        self.kind, self.payload, self.loop = kind, payload, loop
        self.reached: asyncio.Future = loop.create_future()
        self.result: asyncio.Future = loop.create_future()
        self.reached_at = 0.0
        self.engine_s = 0.0
        self.early = False  # answered before its batch ended (engine_s: when)

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
        self._step_at = time.monotonic()  # when the engine last finished a step (a batch, a piece of one: stalled_s)
        self._early: tuple | None = None  # (the running batch's tickets, its start) for answers handed back early
        self._declined: set[Ticket] = set()  # see _run_batch_inner and _between
        self.counters = {"batches": 0, "rows": 0, "largest_batch": 0, "engine_errors": 0, "busy_s": 0.0, "between_rows": 0}

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
        """Rows waiting for the thread, not counting the batch it is running."""
        return len(self._items)

    def stalled_s(self) -> float:
        """Seconds the engine has been inside one step (since the batch began, or it last called `between` or
        handed back an answer early); 0 while the thread is idle. The worker's liveness reads it."""
        return time.monotonic() - self._step_at if self.busy else 0.0

    def making_progress(self, bound_s: float) -> bool:
        """Idle, or inside a step younger than `bound_s` (0: always): what the worker's health key and readiness
        stand for (worker.jobs, worker.routing)."""
        return bound_s <= 0 or self.stalled_s() < bound_s

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, wait_s: float) -> bool:
        """Let the running batch finish (up to `wait_s`), cancel what still waits; True if the thread ended."""
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
                batch = self._take()
                if batch is None:
                    break
                self._run_batch(batch)
        finally:
            with self._cv:
                left, self._items = list(self._items), deque()
            for t in left:
                _settle(t.loop, t.result, cancel=True)  # the job is re-queued by arq, not answered with an error

    def _take(self) -> list[Ticket] | None:
        with self._cv:
            while not self._items and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            batch = []
            while self._items and len(batch) < self._max_batch_rows:
                batch.append(self._items.popleft())
            self._step_at = time.monotonic()
            self.busy = True
            return batch

    def _snapshot(self) -> None:
        try:
            self.engine_stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics are not worth a failed batch
            log.exception("engine.stats() failed")

    def _run_batch(self, batch: list[Ticket]) -> None:
        try:
            self._run_batch_inner(batch)
        finally:
            self.busy = False

    def _run_batch_inner(self, batch: list[Ticket]) -> None:
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
        if not rows:
            return
        now = time.time()
        for t in rows:
            t.reached_at = now
            _settle(t.loop, t.reached, True)
        waiting = max(0, int(self._waiting(self.pending())))
        t0 = time.perf_counter()
        self._declined = set()  # queued tickets `between` found needing a long forward, during this batch
        self._early = (rows, t0)
        try:
            results = self._answer([t.payload for t in rows], waiting)
        finally:
            self._early = None
        engine_s = time.perf_counter() - t0
        c = self.counters
        c["busy_s"] += engine_s
        c["batches"] += 1
        c["rows"] += len(rows)
        c["largest_batch"] = max(c["largest_batch"], len(rows))
        log.debug("batch of %d rows (%d waiting) in %.1f ms", len(rows), waiting, 1e3 * engine_s)
        self._snapshot()
        for t in rows:
            if not t.early:  # those answered early keep the time they were answered at
                t.engine_s = engine_s
        if self._on_batch is not None:
            try:
                self._on_batch(rows, results, engine_s, self.engine_stats)
            except Exception:  # noqa: BLE001
                log.exception("the batch hook failed")
        for t, result in zip(rows, results):
            _settle(t.loop, t.result, result)

    def _call(self, rows: list, waiting: int) -> list[dict]:
        if self._chunked():  # chunked prefill: rows of saved states that arrive meanwhile go between chunks
            results = list(self.engine.answer(rows, waiting_rows=waiting, between=self._between,
                                              **({"on_result": self._on_result} if self._early_ok else {})))
        else:
            results = list(self.engine.answer(rows, waiting_rows=waiting))
        if len(results) != len(rows):
            raise RuntimeError(f"engine returned {len(results)} results for {len(rows)} rows")
        return results

    def _chunked(self) -> bool:
        """Does the engine take a `between` callback and answer rows between chunks (`answer_ready`)?"""
        if not hasattr(self, "_chunked_ok"):
            try:
                params = inspect.signature(self.engine.answer).parameters
            except (TypeError, ValueError):
                params = {}
            self._chunked_ok = "between" in params and callable(getattr(self.engine, "answer_ready", None))
            self._early_ok = "on_result" in params
        return self._chunked_ok

    def _on_result(self, i: int, result: dict) -> None:
        """The engine knows row i of the running batch's result before the batch ends (a hit, before a new page's
        long forward): its job gets it now."""
        self._step_at = time.monotonic()
        early = self._early
        if early is None or not 0 <= i < len(early[0]):
            return
        t = early[0][i]
        t.engine_s, t.early = time.perf_counter() - early[1], True
        _settle(t.loop, t.result, result)

    def _between(self) -> None:
        """Called by the engine between the chunks of a long forward: the rows that arrived meanwhile and can be
        answered at once (`engine.answer_ready`: memo, batched continuations of saved states) reach the model and
        are resolved now; the others go back to the front of the queue, in order, for the next batch (still
        withdrawable by the intake)."""
        self._step_at = time.monotonic()  # the engine finished a piece of the running batch
        with self._cv:
            if not self._items or self._stopping:
                return
            taken = [t for t in self._items if t.kind == "row" and not t.dead() and t not in self._declined]
            taken = taken[: self._max_batch_rows]
            if not taken:
                return
            ids = {id(t) for t in taken}
            self._items = deque(t for t in self._items if id(t) not in ids)
        t0 = time.perf_counter()
        try:
            results = list(self.engine.answer_ready([t.payload for t in taken]))
            if len(results) != len(taken):
                raise RuntimeError(f"answer_ready returned {len(results)} results for {len(taken)} rows")
        except Exception:  # noqa: BLE001 - they wait for the next batch instead
            log.exception("answering rows between chunks failed")
            results = [None] * len(taken)
        engine_s = time.perf_counter() - t0
        self._step_at = time.monotonic()
        done = [(t, r) for t, r in zip(taken, results) if r is not None]
        back = [t for t, r in zip(taken, results) if r is None]
        if back:
            # they need a long forward of their own: not offered again until this batch ends (each offer re-checks
            # the row on this thread, which a long forward's host time can least afford)
            self._declined.update(back)
            with self._cv:
                self._items.extendleft(reversed(back))
        self.counters["between_rows"] += len(done)
        if not done:
            return
        now = time.time()
        for t, _ in done:
            t.reached_at, t.engine_s = now, engine_s
            _settle(t.loop, t.reached, True)
        if self._on_batch is not None:
            try:
                self._on_batch([t for t, _ in done], [r for _, r in done], engine_s, self.engine_stats)
            except Exception:  # noqa: BLE001
                log.exception("the batch hook failed")
        for t, result in done:
            _settle(t.loop, t.result, result)

    def _answer(self, rows: list, waiting: int) -> list[dict]:
        try:
            return self._call(rows, waiting)
        except Exception as e:
            self.counters["engine_errors"] += 1
            log.exception("engine failed on a batch of %d rows; answering them one at a time", len(rows))
            if len(rows) == 1:
                return [_internal_error(e)]
        self._early = None  # one at a time now: indices no longer match the batch's tickets
        results = []
        for row in rows:
            try:
                results += self._call([row], waiting)
            except Exception as e:
                log.exception("engine failed on a row")
                results.append(_internal_error(e))
        return results


def _internal_error(e: Exception) -> dict:
    return error_result("internal", f"the engine failed on this row ({type(e).__name__}: {e}); see the worker log")
