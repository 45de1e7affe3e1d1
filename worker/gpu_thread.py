"""The one thread that drives the engine (and so the GPU); the event loop never waits on it.

Jobs put `(row, future)` on a thread-safe queue and await the future. The thread builds the engine itself
(so every CUDA call, graph capture included, happens on this one thread), then loops: take everything that
is ready (up to `max_batch_rows`), ask `backed_up(rows waiting)` once for the batch, call
`engine.answer(rows, backed_up=...)` once, and resolve each future with `loop.call_soon_threadsafe`.
Grouping by shared state, the memo and the paths are the engine's business; handing it the whole drained
batch at once is this thread's. While a batch runs a long forward, the engine calls back between its chunks
(`between`); rows that arrived meanwhile and can be answered at once (`engine.answer_ready`: memo answers,
continuations of saved states) are answered then, the rest wait for the next batch (chunked prefill).

The worker never dies of a row: if the engine raises on a batch, the rows are retried one at a time and a
row that still raises gets an `internal` error result (the engine's own code for a failed computation).
Rows whose job was cancelled meanwhile are skipped.

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

from statecache.rows import error_result
from worker import constants as C

log = logging.getLogger("statecache.worker")


class Stopping(RuntimeError):
    """The thread is shutting down and takes no more rows."""


class _Item:
    __slots__ = ("kind", "payload", "fut", "loop")

    def __init__(self, kind: str, payload: Any, fut: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.kind, self.payload, self.fut, self.loop = kind, payload, fut, loop

    def resolve(self, value: Any = None, exc: BaseException | None = None, cancel: bool = False) -> None:
        def done(fut: asyncio.Future = self.fut) -> None:
            if fut.done():
                return
            if cancel:
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class GpuThread:
    def __init__(
        self,
        make_engine: Callable[[], Any],
        backed_up: Callable[[int], bool] = lambda waiting_rows: False,
        max_batch_rows: int = C.MAX_BATCH_ROWS,
    ):
        self._make_engine = make_engine
        self._backed_up = backed_up
        self._max_batch_rows = max_batch_rows
        self._items: deque[_Item] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.engine: Any = None
        self.counters = {"batches": 0, "rows": 0, "largest_batch": 0, "backed_up_batches": 0, "engine_errors": 0, "busy_s": 0.0}

    # --- event-loop side ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread and wait until it has built the engine; raises what building it raised."""
        self._thread = threading.Thread(target=self._run, name="statecache-gpu", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    async def answer(self, row: Any) -> dict:
        return await self._submit("row", row)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the thread between batches (engine state is only touched there)."""
        return await self._submit("call", fn)

    def pending(self) -> int:
        """Rows waiting for the thread, not counting the batch it is running."""
        return len(self._items)

    def stop(self, wait_s: float = C.GPU_STOP_WAIT_S) -> bool:
        """Let the running batch finish (up to `wait_s`), cancel what still waits; True if the thread ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is None:
            return True
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    async def _submit(self, kind: str, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._stopping:
                raise Stopping("the GPU thread is stopping")
            self._items.append(_Item(kind, payload, fut, loop))
            self._cv.notify()
        return await fut

    # --- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
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
            for item in left:
                item.resolve(cancel=True)  # the job is re-queued by arq, not answered with an error

    def _take(self) -> list[_Item] | None:
        with self._cv:
            while not self._items and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            batch = []
            while self._items and len(batch) < self._max_batch_rows:
                batch.append(self._items.popleft())
            return batch

    def _run_batch(self, batch: list[_Item]) -> None:
        rows = []
        for item in batch:
            if item.fut.cancelled():
                continue
            if item.kind == "call":
                try:
                    item.resolve(item.payload(self.engine))
                except Exception as e:
                    item.resolve(exc=e)
            else:
                rows.append(item)
        if not rows:
            return
        backed_up = bool(self._backed_up(len(rows) + self.pending()))
        t0 = time.perf_counter()
        results = self._answer([item.payload for item in rows], backed_up)
        busy_s = time.perf_counter() - t0
        c = self.counters
        c["busy_s"] += busy_s
        c["batches"] += 1
        c["rows"] += len(rows)
        c["largest_batch"] = max(c["largest_batch"], len(rows))
        c["backed_up_batches"] += backed_up
        log.debug("batch of %d rows (backed_up=%s) in %.1f ms", len(rows), backed_up, 1e3 * busy_s)
        for item, result in zip(rows, results):
            item.resolve(result)

    def _call(self, rows: list, backed_up: bool) -> list[dict]:
        if self._chunked():  # chunked prefill: rows of saved states that arrive meanwhile go between chunks
            results = list(self.engine.answer(rows, backed_up=backed_up, between=self._between))
        else:
            results = list(self.engine.answer(rows, backed_up=backed_up))
        if len(results) != len(rows):
            raise RuntimeError(f"engine returned {len(results)} results for {len(rows)} rows")
        return results

    def _chunked(self) -> bool:
        """Does the engine take a `between` callback and answer rows between chunks (`answer_ready`)?"""
        if not hasattr(self, "_chunked_ok"):
            try:
                takes = "between" in inspect.signature(self.engine.answer).parameters
            except (TypeError, ValueError):
                takes = False
            self._chunked_ok = takes and callable(getattr(self.engine, "answer_ready", None))
        return self._chunked_ok

    def _between(self) -> None:
        """Called by the engine between the chunks of a long forward: the rows that arrived meanwhile and can be
        answered at once (`engine.answer_ready`: memo, batched continuations of saved states) are answered and
        resolved now; the others go back to the front of the queue, in order, for the next batch."""
        with self._cv:
            if not self._items or self._stopping:
                return
            taken = [it for it in self._items if it.kind == "row" and not it.fut.cancelled()][: self._max_batch_rows]
            if not taken:
                return
            ids = {id(it) for it in taken}
            self._items = deque(it for it in self._items if id(it) not in ids)
        try:
            results = list(self.engine.answer_ready([it.payload for it in taken]))
            if len(results) != len(taken):
                raise RuntimeError(f"answer_ready returned {len(results)} results for {len(taken)} rows")
        except Exception:  # noqa: BLE001 - they wait for the next batch instead
            log.exception("answering rows between chunks failed")
            results = [None] * len(taken)
        back = []
        for item, result in zip(taken, results):
            if result is None:
                back.append(item)
            else:
                item.resolve(result)
        self.counters["between_rows"] = self.counters.get("between_rows", 0) + len(taken) - len(back)
        if back:
            with self._cv:
                self._items.extendleft(reversed(back))

    def _answer(self, rows: list, backed_up: bool) -> list[dict]:
        try:
            return self._call(rows, backed_up)
        except Exception as e:
            self.counters["engine_errors"] += 1
            log.exception("engine failed on a batch of %d rows; answering them one at a time", len(rows))
            if len(rows) == 1:
                return [_internal_error(e)]
        results = []
        for row in rows:
            try:
                results += self._call([row], backed_up)
            except Exception as e:
                log.exception("engine failed on a row")
                results.append(_internal_error(e))
        return results


def _internal_error(e: Exception) -> dict:
    return error_result("internal", f"the engine failed on this row ({type(e).__name__}: {e}); see the worker log")
