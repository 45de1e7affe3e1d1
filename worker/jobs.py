"""The arq job functions (`answer`, `stats`, the stand-in for undecodable jobs) and the worker's start-up,
shutdown and per-job hooks.

`answer` has its row checked (a text row tokenised) off the loop, once (worker.prepare: the router's tokens when it
routed the row here), hands it to the GPU thread and awaits the result; it never raises for a bad row or a failed
engine call (arq would store the exception, and a job is worth an answer): it returns an error result. A job
is never failed for waiting: if its row has not reached the model within half the job timeout (arq's timer
started when the job was taken), the row is withdrawn and the job goes back to Redis (`Retry`), where any
worker may take it; the intake (`max_jobs`) is sized so that this is rare. Only a cancellation (shutdown)
propagates otherwise, so arq re-queues the job; answers are deterministic, so a job that runs twice
(at-least-once delivery) answers the same. A job sent back for waiting gets its try back (arq counts a try in
`arq:retry:<id>` each time a worker takes the job; `MAX_TRIES` is for jobs that fail, not for jobs that wait).

Liveness (`_watch`): the health key and `statecache:worker_ready` are written only while the GPU thread makes
progress (idle, or its engine step younger than `engine_stuck_s`). An engine stuck longer withdraws them, sends
the rows still waiting for it back to the queue with their tries given back (the rows inside the stuck step keep
theirs spent: one of them may be what hangs the engine), lets arq put the rest back, and exits with status
`EXIT_STUCK` for a supervisor to restart the worker.

`startup` builds everything once: the metrics, the backlog reader, the GPU thread and, on it, the engine (the
`engine` setting, called with the Settings; by default `statecache.engine:Engine.from_settings`, which
captures every graph before it returns). Only then does arq's poll loop start, so the health key (and
`statecache:worker_ready`) appear after precapture. In-process callers (tests) may put `settings` and/or
`make_engine` (a callable of no arguments) in arq's ctx.

Told to stop (SIGTERM, SIGINT, the stuck-engine watch), the worker's router stops routing to it at once
(`_stop_routing_when_told`, worker.routing's Router.stop) before arq's drain. A job whose arq keys are of another
Redis type (a hash at arq:retry:<id>) fails alone instead of ending the worker (`_a_bad_key_fails_its_job`). Log
lines naming job ids (a producer's choice) have their control characters escaped (`EscapeControl`).

Knows arq, the GPU thread and the metrics; the row format is the engine's business.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from arq.worker import Retry, Worker

from statecache.cache.routing import FingerprintLedger
from statecache.protocol import RETRY_KEY_PREFIX, done_channel, error_result, health_key, private_queue, redact
from statecache.settings import Settings
from worker.backlog import Backlog
from worker.gpu_thread import GpuThread, Stopping
from worker.metrics import WorkerMetrics
from worker.prepare import RowPrep
from worker.routing import Router
from worker.serial import JobRefused

log = logging.getLogger("statecache.worker")

GPU_STOP_WAIT_S = 2.0  # after the drain, wait this long for the GPU thread's running batch, then exit anyway
EXIT_STUCK = 70  # sysexits' EX_SOFTWARE: the worker exits with this when its engine is stuck (supervisor: restart it)


async def answer(ctx: dict, *args: Any, **kwargs: Any) -> dict:
    if len(args) == 1 and not kwargs:
        row = args[0]
    elif not args and set(kwargs) == {"row"}:
        row = kwargs["row"]
    else:
        return error_result("bad_job", f"answer takes exactly one row, got {len(args)} args and {len(kwargs)} kwargs")
    gpu: GpuThread = ctx["gpu"]
    settings: Settings = ctx["settings"]
    if ctx.get("rows") is not None:  # checked and tokenised off the loop, once (worker.prepare)
        row = await ctx["rows"].take(row)
    try:
        ticket = gpu.submit(row)
    except Stopping:
        raise Retry(defer=1)  # back to the queue for the next worker
    waiting: dict = ctx.get("waiting_jobs", {})  # job id -> ticket until the row reaches the model (_watch)
    waiting[ctx.get("job_id")] = ticket
    try:
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop a cancellation (worker.resilient)
            async with asyncio.timeout(settings.job_timeout_s / 2):
                await asyncio.shield(ticket.reached)
        except asyncio.TimeoutError:
            if gpu.withdraw(ticket):
                log.info("job %s waited %.0f s without reaching the model; back to the queue", ctx.get("job_id"),
                         settings.job_timeout_s / 2)
                await give_tries_back(ctx.get("redis"), [ctx.get("job_id")])
                raise Retry(defer=0)
        finally:
            waiting.pop(ctx.get("job_id"), None)
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


async def give_tries_back(redis: Any, job_ids: list) -> None:
    """Undo the try arq counted when it took these jobs (they go back to the queue for waiting, not for failing)."""
    if redis is not None and job_ids:
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.decr(RETRY_KEY_PREFIX + job_id)
            await pipe.execute()


async def _watch(ctx: dict, arq_worker: Any) -> None:
    """Liveness: exit when the GPU thread's engine is stuck (module docstring)."""
    gpu: GpuThread = ctx["gpu"]
    settings: Settings = ctx["settings"]
    if settings.engine_stuck_s <= 0:
        return  # not watched
    while gpu.making_progress(settings.engine_stuck_s):
        await asyncio.sleep(min(1.0, settings.engine_stuck_s / 4))
    ctx["metrics"].ready.set(0)
    ctx["stuck"] = True
    withdrawn = [job_id for job_id, ticket in list(ctx["waiting_jobs"].items()) if gpu.withdraw(ticket)]
    log.error("the engine is stuck: one step has run %.0f s (STATECACHE_ENGINE_STUCK_S=%g); not healthy any more; "
              "%d waiting rows go back to the queue with their tries, the rest when arq stops; the worker exits with "
              "status %d for its supervisor to restart it", gpu.stalled_s(), settings.engine_stuck_s, len(withdrawn),
              EXIT_STUCK)
    redis = ctx["redis"]
    if ctx.get("router") is None:  # else the router, stopping, deletes the queue's key if no other worker serves it
        await redis.delete(health_key(settings.queue))  # arq's health_check_key too (worker.settings)
    await give_tries_back(redis, withdrawn)
    if arq_worker is not None:
        arq_worker.handle_sig(signal.SIGTERM)  # cancels every job (arq puts them back on the queue), then stops


def _healthy_only_while_stepping(arq_worker: Any, ctx: dict) -> None:
    """arq writes its health key from its poll loop, which goes on while the GPU thread hangs: write it only while
    the engine makes progress."""
    record = arq_worker.record_health

    async def record_health() -> None:
        if not ctx.get("stuck") and ctx["gpu"].making_progress(ctx["settings"].engine_stuck_s):
            await record()

    arq_worker.record_health = record_health


def _stop_goes_on_past_cancelled_jobs(arq_worker: Any) -> None:
    """arq's stop cancels every job task, then its close() gathers them: one whose cancellation landed outside the
    job function (arq's start transaction, finish, or our after_job_end hook, e.g. publishing the job done) ends
    cancelled, the gather raises, and on_shutdown (the router handing its queue back, the GPU thread's stop) never
    runs. Such a task ends quietly here once arq is stopping (its main task cancelled): its result is stored or it
    is still in Redis to run again (Router.close puts this worker's queue back; arq's in-progress mark expires)."""
    run_job = arq_worker.run_job

    async def run_job_through_a_stop(job_id: str, score: int) -> None:
        try:
            await run_job(job_id, score)
        except asyncio.CancelledError:
            main = getattr(arq_worker, "main_task", None)
            if main is None or not (main.done() or main.cancelling()):
                raise
            log.info("job %s: the stop cancelled it outside its function (starting or ending); arq's stop goes on",
                     job_id)

    arq_worker.run_job = run_job_through_a_stop


def _stop_routing_when_told(arq_worker: Any, router: Router) -> None:
    """A worker told to stop takes nothing new from that moment (worker.routing, Router.stop): arq's signal handlers
    (SIGTERM, SIGINT: stop picking jobs, drain, stop) and its handle_sig (the stuck-engine watch, an in-process
    stop) first tell the router. arq registered its handlers as bound methods when it was built, so they are
    registered again here."""
    handle_sig = arq_worker.handle_sig

    def told(signum: Any) -> None:
        router.stop_soon()
        handle_sig(signum)

    arq_worker.handle_sig = told
    if getattr(arq_worker, "_handle_signals", False):
        handler = arq_worker.handle_sig_wait_for_completion if arq_worker._job_completion_wait else handle_sig

        def on_signal(signum: Any) -> None:
            router.stop_soon()
            handler(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            arq_worker._add_signal_handler(sig, on_signal)


def _start_routed_jobs_at_once(arq_worker: Any, router: Router) -> None:
    """A job the router moved to this worker's own queue starts now, not at arq's next poll of that queue (up to
    `poll_delay_s` later; half of it on average, for every row, beside the router's own wait for QUEUE's poll). arq's
    start transaction still decides (a job running or ended is skipped), in a task of its own (arq's start waits for
    a free slot; the router's loop does not); only as many as arq has slots free, and none once arq stops picking
    jobs (a drain)."""
    starting: set = set()

    def start(job_ids: list) -> None:
        free = arq_worker.max_jobs - arq_worker.job_counter
        if free <= 0 or not arq_worker.allow_pick_jobs:
            return  # arq's poll takes them as slots free
        task = asyncio.create_task(arq_worker.start_jobs([j.encode() for j in job_ids[:free]]))
        starting.add(task)
        task.add_done_callback(_started)

    def _started(task: asyncio.Task) -> None:
        starting.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the jobs stay queued: arq's poll starts them
            log.warning("starting routed jobs failed: %r", task.exception())

    router.on_routed_here = start


def _a_bad_key_fails_its_job(arq_worker: Any, ctx: dict) -> None:
    """arq's run_job reads and counts a job in one transaction (GET arq:job:<id>, INCR arq:retry:<id>) and stores its
    end in another, outside any try block: a key of another Redis type there (a hash at arq:retry:<id>, written by
    hand) raised out of the job's task, and the poll loop ended the worker, on every restart. Such a job fails here
    instead: its keys are cleaned up the way arq cleans up a failed job (DEL works on any type), a failed result is
    stored unless one is there already (SET replaces any type), it leaves both queues, and the worker goes on."""
    from arq.constants import abort_jobs_ss
    from arq.jobs import serialize_result
    from arq.worker import JobExecutionFailed
    from redis.exceptions import ResponseError

    from statecache.protocol import IN_PROGRESS_KEY_PREFIX, JOB_KEY_PREFIX, RESULT_KEY_PREFIX

    run_job = arq_worker.run_job

    async def run_job_or_fail_it(job_id: str, score: int) -> None:
        try:
            await run_job(job_id, score)
        except ResponseError as e:
            start_ms = int(time.time() * 1000)
            message = f"a Redis key of this job could not be used ({str(e)[:200]}); the job failed"
            log.error("job %s: %s", job_id, message)
            pool = arq_worker.pool
            result = serialize_result("<unknown>", (), {}, 1, 0, False, JobExecutionFailed(message), start_ms,
                                      start_ms, f"{job_id}:<unknown>", arq_worker.queue_name, job_id=job_id,
                                      serializer=arq_worker.job_serializer)
            stored = await pool.type(RESULT_KEY_PREFIX + job_id)
            async with pool.pipeline(transaction=False) as pipe:
                pipe.delete(RETRY_KEY_PREFIX + job_id, IN_PROGRESS_KEY_PREFIX + job_id, JOB_KEY_PREFIX + job_id)
                pipe.zrem(arq_worker.queue_name, job_id)
                pipe.zrem(abort_jobs_ss, job_id)
                if stored not in (b"string", "string") and result is not None:
                    pipe.set(RESULT_KEY_PREFIX + job_id, result, px=int(arq_worker.keep_result_s * 1000))
                await pipe.execute(raise_on_error=False)
            arq_worker.jobs_failed += 1
            if ctx.get("router") is not None:
                await ctx["router"].finished(job_id)
            try:
                await ctx["redis"].publish(done_channel(ctx["settings"].queue), job_id)
            except Exception as e2:  # noqa: BLE001 - the producer falls back to polling
                log.warning("publishing job %s done failed: %s", job_id, e2)

    arq_worker.run_job = run_job_or_fail_it


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
    engine_stats = await gpu.call(lambda engine: {**engine.stats(), **(
        engine.details() if hasattr(engine, "details") else {})})  # the last steps and more (an engine's option)
    return {
        "engine": engine_stats,
        "worker": {**gpu.counters, "pending": gpu.pending(), "queued": backlog.queued, "in_flight": backlog.in_flight,
                   **({"rows": dict(ctx["rows"].counts)} if ctx.get("rows") is not None else {}),
                   **({"routing": {"id": ctx["router"].id, "live": ctx["router"].live, **ctx["router"].counts}}
                      if ctx.get("router") is not None else {}),
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
        return error_result("bad_job", "profile takes seconds (a number) and rows (an int)")
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


CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
ESCAPED_LOGGERS = ("arq.worker", "arq.jobs", "arq.connections", "statecache.worker")  # the loggers that name job ids


class EscapeControl(logging.Filter):
    """Job ids are the producer's (a bare enqueue_job may name any): a log line naming one with a newline could
    forge log lines. Every record of ESCAPED_LOGGERS is formatted once here with its control characters escaped
    (\\n, \\x1b, ...); tracebacks (exc_info) are the formatter's, untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format: the handler reports it as usual
            return True
        if CONTROL.search(text):
            record.msg = CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
            record.args = ()
        return True


def _escape_control_characters() -> None:
    for name in ESCAPED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, EscapeControl) for f in logger.filters):
            logger.addFilter(EscapeControl())


def _ensure_logging() -> None:
    _escape_control_characters()
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
    arq_worker = _arq_worker()
    # routing (worker.routing): this worker's arq serves a queue of its own, named after its worker id
    own = private_queue(settings.queue, "")
    worker_id = (arq_worker.queue_name[len(own):] if arq_worker is not None and arq_worker.queue_name.startswith(own)
                 else None)
    backlog = (Backlog(redis, arq_worker.queue_name, also=settings.queue) if worker_id else Backlog(redis, settings.queue))
    gpu: GpuThread | None = None
    metrics = WorkerMetrics(lambda: gpu.engine_stats if gpu is not None else {})
    gpu = GpuThread(
        engine_factory(settings, ctx.get("make_engine")),
        waiting=backlog.waiting,
        on_batch=lambda rows, results, engine_s, st: metrics.batch(results, st),
    )
    if arq_worker is not None:
        arq_worker.on_stop = _on_stop(redis, arq_worker)
        if hasattr(redis, "running_here"):  # arq's poll skips the jobs running here without asking Redis each time
            redis.running_here = lambda: {job_id for job_id, task in arq_worker.tasks.items() if not task.done()}
    if hasattr(redis, "on_change"):
        redis.on_change = lambda up: metrics.redis_up.set(1 if up else 0)
    port = metrics.serve(settings.metrics_port, settings.metrics_addr)
    t0 = time.perf_counter()
    log.info("statecache worker starting on %s: building the engine (graphs are captured before any job is taken)",
             redact(settings.redis_url))
    await asyncio.to_thread(gpu.start)  # the engine (model, cache, graphs) is built once, on the GPU thread
    ctx.update(settings=settings, backlog=backlog, gpu=gpu, metrics=metrics, rows=RowPrep(gpu),
               backlog_task=asyncio.create_task(backlog.run(metrics, gpu.pending)))
    # ready before the router's first beat writes the queue's health key: both say the same thing to operators (a
    # scrape that found the key and a 0 here raced the router's start)
    metrics.ready.set(1)
    if worker_id:
        ledger = FingerprintLedger(settings.cache_settings().align)
        await gpu.call(lambda engine: _observe(engine, ledger))
        ctx["router"] = Router(redis, settings, worker_id, gpu, ledger, metrics, prep=ctx["rows"])
        await ctx["router"].start()
    ctx["waiting_jobs"] = {}
    ctx["watch_task"] = asyncio.create_task(_watch(ctx, arq_worker))
    if arq_worker is not None:
        _healthy_only_while_stepping(arq_worker, ctx)
        _stop_goes_on_past_cancelled_jobs(arq_worker)
        _a_bad_key_fails_its_job(arq_worker, ctx)
        if ctx.get("router") is not None:
            _stop_routing_when_told(arq_worker, ctx["router"])
            _start_routed_jobs_at_once(arq_worker, ctx["router"])
    log.info(
        "statecache worker ready in %.1f s: queue %s, engine %s, metrics %s",
        time.perf_counter() - t0, settings.queue, type(gpu.engine).__name__,
        f"on {settings.metrics_addr}:{port}" if port else "off",
    )


def _observe(engine: Any, ledger: FingerprintLedger) -> None:
    """The engine's checkpoint index tells `ledger` what it plants, hits and evicts (run on the GPU thread)."""
    index = getattr(getattr(engine, "cache", None), "index", None)
    if index is not None:
        ledger.align = index.align
        index.observer = ledger.observe


def _arq_worker() -> Any:
    """The arq Worker running this start-up hook (its main task's `self`), or None."""
    task = asyncio.current_task()
    frame = getattr(task.get_coro(), "cr_frame", None) if task is not None else None
    worker = frame.f_locals.get("self") if frame is not None else None
    return worker if isinstance(worker, Worker) else None


def _on_stop(redis: Any, arq_worker: Any):
    """arq's on_stop hook (called once arq has cancelled its main task): Redis calls stop waiting out an outage,
    and the main task is cancelled again every second while it still runs. A guard: Python 3.11's `wait_for`, which
    redis-py sends commands through when its socket timeout is set, dropped a cancellation about once in ten stops
    under pytest; worker.resilient no longer takes that path, and a warning here says something else did."""

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
    if ctx.get("watch_task") is not None:
        ctx["watch_task"].cancel()
    task = ctx.get("backlog_task")
    if task is not None:
        task.cancel()
    if ctx.get("router") is not None:  # arq's jobs are done or cancelled: what is left in its queue goes back
        await ctx["router"].close()
    if ctx.get("rows") is not None:
        ctx["rows"].close()
    metrics: WorkerMetrics | None = ctx.get("metrics")
    if metrics is not None:
        metrics.ready.set(0)
        metrics.close()
    gpu: GpuThread | None = ctx.get("gpu")
    if gpu is None:
        return
    stopped = await asyncio.to_thread(gpu.stop, GPU_STOP_WAIT_S)
    if stopped and not ctx.get("stuck"):
        log.info("GPU thread stopped")
        return
    if ctx.get("stuck"):
        log.error("exiting with status %d: the engine is stuck (see above)", EXIT_STUCK)
        _exit_now(EXIT_STUCK)
        return
    # The running batch outlived the drain and this wait: its jobs are already back in the queue (arq cancelled
    # them). Interpreter exit with the thread inside torch would abort the process, so end it here, cleanly.
    log.warning("GPU thread still running a batch %.0f s after the drain; its rows are back in the queue; exiting now",
                GPU_STOP_WAIT_S)
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End the process with `code`, logs flushed, without joining the GPU thread. A worker run in a thread other than
    the main one (the tests' in-process worker) does not own its process: there this returns."""
    if threading.current_thread() is threading.main_thread():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


async def job_started(ctx: dict) -> None:
    ctx["backlog"].in_flight += 1


async def job_ended(ctx: dict) -> None:
    """After arq stored the result: the job no longer counts, and its producer is told to fetch it."""
    ctx["backlog"].in_flight -= 1
    if ctx.get("router") is not None:
        try:
            await ctx["router"].finished(ctx["job_id"])
        except Exception as e:  # noqa: BLE001 - the router's sweep removes it later
            log.warning("job %s: taking it off the queue failed: %s", ctx.get("job_id"), e)
    try:
        await ctx["redis"].publish(done_channel(ctx["settings"].queue), ctx["job_id"])
    except Exception as e:  # the producer falls back to polling
        log.warning("publishing job %s done failed: %s", ctx.get("job_id"), e)
