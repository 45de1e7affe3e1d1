"""The arq job functions (`answer`, `stats`, the stand-in for undecodable jobs) and the worker's start-up,
shutdown and per-job hooks.

`answer` hands its row to the GPU thread and awaits the result; it never raises for a bad row or a failed
engine call (arq would store the exception, and a job is worth an answer): it returns an error result. A job
is never failed for waiting: if its row has not reached the model within half the job timeout (arq's timer
started when the job was taken), the row is withdrawn and the job goes back to Redis (`Retry`), where any
worker may take it; the intake (`max_jobs`) is sized so that this is rare. Only a cancellation (shutdown)
propagates otherwise, so arq re-queues the job; answers are deterministic, so a job that runs twice
(at-least-once delivery) answers the same.

`startup` builds everything once: the metrics, the backlog reader, the GPU thread and, on it, the engine (the
`engine` setting, called with the Settings; by default `statecache.engine:Engine.from_settings`, which
captures every graph before it returns). Only then does arq's poll loop start, so the health key (and
`statecache:worker_ready`) appear after precapture. In-process callers (tests) may put `settings` and/or
`make_engine` (a callable of no arguments) in arq's ctx.

Knows arq, the GPU thread and the metrics; the row format is the engine's business.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
import threading
import time
from typing import Any

from arq.worker import Retry, Worker

from statecache.protocol import done_channel, error_result
from statecache.settings import Settings
from worker.backlog import Backlog
from worker.gpu_thread import GpuThread, Stopping
from worker.metrics import WorkerMetrics
from worker.serial import JobRefused

log = logging.getLogger("statecache.worker")

GPU_STOP_WAIT_S = 2.0  # after the drain, wait this long for the GPU thread's running batch, then exit anyway


async def answer(ctx: dict, *args: Any, **kwargs: Any) -> dict:
    if len(args) == 1 and not kwargs:
        row = args[0]
    elif not args and set(kwargs) == {"row"}:
        row = kwargs["row"]
    else:
        return error_result("bad_job", f"answer takes exactly one row, got {len(args)} args and kwargs {sorted(kwargs)}")
    gpu: GpuThread = ctx["gpu"]
    settings: Settings = ctx["settings"]
    try:
        ticket = gpu.submit(row)
    except Stopping:
        raise Retry(defer=1)  # back to the queue for the next worker
    try:
        try:
            await asyncio.wait_for(asyncio.shield(ticket.reached), settings.job_timeout_s / 2)
        except asyncio.TimeoutError:
            if gpu.withdraw(ticket):
                log.info("job %s waited %.0f s without reaching the model; back to the queue", ctx.get("job_id"),
                         settings.job_timeout_s / 2)
                raise Retry(defer=0)
        result = await ticket.result
    except (asyncio.CancelledError, Retry):
        ticket.result.cancel()  # the GPU thread skips it
        raise
    except Exception as e:
        log.exception("job %s failed outside the engine", ctx.get("job_id"))
        result = error_result("internal", f"{type(e).__name__}: {e}")
        ticket = None
    metrics: WorkerMetrics | None = ctx.get("metrics")
    if metrics is not None:
        enqueued = ctx.get("enqueue_time")
        metrics.row(result, enqueued.timestamp() if enqueued else None, ticket.reached_at if ticket else 0.0,
                    ticket.engine_s if ticket else 0.0, time.time())
    return result


async def undecodable(ctx: dict, code: str = "undecodable", message: str = "", pickled: bool = False) -> Any:
    """What runs in place of a job worker.serial could not (or would not) decode."""
    metrics: WorkerMetrics | None = ctx.get("metrics")
    if metrics is not None:
        metrics.row(error_result(code, message), None, 0.0, 0.0, time.time())
    if code == "job_too_large":
        return error_result(code, message)
    log.warning("job %s refused: %s", ctx.get("job_id"), message)
    raise JobRefused(message, pickled)


async def stats(ctx: dict) -> dict:
    gpu: GpuThread = ctx["gpu"]
    backlog: Backlog = ctx["backlog"]
    engine_stats = await gpu.call(lambda engine: dict(engine.stats()))
    return {
        "engine": engine_stats,
        "worker": {**gpu.counters, "pending": gpu.pending(), "queued": backlog.queued, "in_flight": backlog.in_flight,
                   **({"timing": ctx["metrics"].timing()} if ctx.get("metrics") is not None else {})},
    }


PROFILE_MAX_S = 60.0  # the longest profile a `profile` job may ask for


async def profile(ctx: dict, seconds: float = 5.0, rows: int = 40) -> dict:
    """torch.profiler over the engine's thread for `seconds` while the worker goes on serving (the profiler slows
    it while it runs): the top `rows` ops by host time and by device time, as text tables, and the engine's phases
    over the same stretch. Where the worker's time goes, asked of a running worker (`Client.profile`)."""
    gpu: GpuThread = ctx["gpu"]
    try:
        seconds = float(seconds)
        rows = int(rows)
    except (TypeError, ValueError):
        return error_result("bad_job", f"profile takes seconds (a number) and rows (an int), got {seconds!r}, {rows!r}")
    if not 0 < seconds <= PROFILE_MAX_S or not 0 < rows <= 500:
        return error_result("bad_job", f"profile: seconds in (0, {PROFILE_MAX_S:g}], rows in (0, 500]; got {seconds}, {rows}")
    held: dict = {}

    def start(engine) -> None:
        import torch
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        held["prof"] = torch_profile(activities=acts)
        held["prof"].__enter__()
        held["phases"] = dict(getattr(engine, "phases", {}) or {})

    def stop(engine):
        held["prof"].__exit__(None, None, None)  # quick: the trace is parsed later, by key_averages
        return {k: round(v - held["phases"].get(k, 0), 3) for k, v in (getattr(engine, "phases", {}) or {}).items()}

    def tables(prof) -> dict:
        ka = prof.key_averages()
        by_device = "cuda_time_total" if any(getattr(e, "device_time_total", 0) for e in ka) else "cpu_time_total"
        return {"host_table": ka.table(sort_by="cpu_time_total", row_limit=rows),
                "device_table": ka.table(sort_by=by_device, row_limit=rows)}

    await gpu.call(start)
    try:
        await asyncio.sleep(seconds)
    finally:
        phases = await gpu.call(stop)
    # parsing the trace takes seconds of host time: off the engine's thread, so the engine goes on serving
    # (slowed by the shared interpreter, not stopped)
    return {"seconds": seconds, "phases": phases, **await asyncio.to_thread(tables, held["prof"])}


def import_callable(path: str) -> Any:
    """'package.module:attr.attr' -> the object."""
    module_name, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def _takes_an_argument(fn: Any) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def engine_factory(settings: Settings, make_engine: Any = None):
    """A callable of no arguments that builds the engine: `make_engine`, else the `engine` setting's callable
    (given the Settings when it takes an argument); the `max_row_tokens` setting applies to either."""
    if make_engine is None:
        make = import_callable(settings.engine)
        make_engine = (lambda: make(settings)) if _takes_an_argument(make) else make

    def build():
        engine = make_engine()
        if settings.max_row_tokens is not None:  # an engine from elsewhere (a test, a bench) honours it too
            engine.max_row_tokens = settings.max_row_tokens
        return engine

    return build


def _ensure_logging() -> None:
    root, ours = logging.getLogger(), logging.getLogger("statecache")
    if not root.handlers and not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s: %(message)s", "%H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


async def startup(ctx: dict) -> None:
    _ensure_logging()
    settings: Settings = ctx.get("settings") or Settings.from_env()
    redis = ctx["redis"]
    backlog = Backlog(redis, settings.queue)
    gpu: GpuThread | None = None
    metrics = WorkerMetrics(lambda: gpu.engine_stats if gpu is not None else {})
    gpu = GpuThread(
        engine_factory(settings, ctx.get("make_engine")),
        waiting=backlog.waiting,
        on_batch=lambda rows, results, engine_s, st: metrics.batch(results, st),
        between_min_rows=settings.between_min_rows,
        between_wait_s=settings.between_wait_s,
    )
    arq_worker = _arq_worker()
    if arq_worker is not None:
        arq_worker.on_stop = _on_stop(redis, arq_worker)
        if hasattr(redis, "running_here"):  # arq's poll skips the jobs running here without asking Redis each time
            redis.running_here = lambda: {job_id for job_id, task in arq_worker.tasks.items() if not task.done()}
    if hasattr(redis, "on_change"):
        redis.on_change = lambda up: metrics.redis_up.set(1 if up else 0)
    port = metrics.serve(settings.metrics_port)
    if settings.gil_switch_s > 0:
        # The GPU thread launches a long forward's next piece right after a stop; while the event loop holds the
        # interpreter (decoding rows, Redis replies) it waits up to this interval, and the GPU may run dry meanwhile
        # (README, "The interpreter")
        sys.setswitchinterval(settings.gil_switch_s)
    t0 = time.perf_counter()
    log.info("statecache worker starting: building the engine (graphs are captured before any job is taken)")
    await asyncio.to_thread(gpu.start)  # the engine (model, cache, graphs) is built once, on the GPU thread
    ctx.update(settings=settings, backlog=backlog, gpu=gpu, metrics=metrics,
               backlog_task=asyncio.create_task(backlog.run(metrics, gpu.pending)))
    metrics.ready.set(1)
    log.info(
        "statecache worker ready in %.1f s: queue %s, engine %s, metrics %s",
        time.perf_counter() - t0, settings.queue, type(gpu.engine).__name__,
        f"on port {port}" if port else "off",
    )


def _arq_worker() -> Any:
    """The arq Worker running this start-up hook (its main task's `self`), or None."""
    task = asyncio.current_task()
    frame = getattr(task.get_coro(), "cr_frame", None) if task is not None else None
    worker = frame.f_locals.get("self") if frame is not None else None
    return worker if isinstance(worker, Worker) else None


def _on_stop(redis: Any, arq_worker: Any):
    """arq's on_stop hook (called once arq has cancelled its main task): Redis calls stop waiting out an outage,
    and the main task is cancelled again every second while it still runs (a cancellation that lands inside a
    Redis call can be absorbed there; seen about once in ten stops under pytest)."""

    def stop(signum: Any) -> None:
        if hasattr(redis, "give_up"):
            redis.give_up()
        loop = asyncio.get_event_loop()

        def again() -> None:
            task = getattr(arq_worker, "main_task", None)
            if task is not None and not task.done():
                log.warning("the worker's main loop outlived its cancellation; cancelling it again")
                task.cancel()
                loop.call_later(1.0, again)

        loop.call_later(1.0, again)

    return stop


async def shutdown(ctx: dict) -> None:
    task = ctx.get("backlog_task")
    if task is not None:
        task.cancel()
    metrics: WorkerMetrics | None = ctx.get("metrics")
    if metrics is not None:
        metrics.ready.set(0)
        metrics.close()
    gpu: GpuThread | None = ctx.get("gpu")
    if gpu is None:
        return
    stopped = await asyncio.to_thread(gpu.stop, GPU_STOP_WAIT_S)
    if stopped:
        log.info("GPU thread stopped")
        return
    # The running batch outlived the drain and this wait: its jobs are already back in the queue (arq cancelled
    # them). Interpreter exit with the thread inside torch would abort the process, so end it here, cleanly.
    log.warning("GPU thread still running a batch %.0f s after the drain; its rows are back in the queue; exiting now",
                GPU_STOP_WAIT_S)
    if threading.current_thread() is threading.main_thread():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


async def job_started(ctx: dict) -> None:
    ctx["backlog"].in_flight += 1


async def job_ended(ctx: dict) -> None:
    """After arq stored the result: the job no longer counts, and its producer is told to fetch it."""
    ctx["backlog"].in_flight -= 1
    try:
        await ctx["redis"].publish(done_channel(ctx["settings"].queue), ctx["job_id"])
    except Exception as e:  # the producer falls back to polling
        log.warning("publishing job %s done failed: %s", ctx.get("job_id"), e)
