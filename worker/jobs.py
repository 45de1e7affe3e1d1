"""The arq job functions (`answer`, `stats`) and the worker's start-up / shutdown / per-job hooks.

`answer` hands its row to the GPU thread and awaits the result; it never raises for a bad row or a failed
engine call (arq would store the exception, and a job is worth an answer): it returns an error result. Only a
cancellation (shutdown, timeout) propagates, so arq re-queues the job; answers are deterministic, so a job
that runs twice (at-least-once delivery) answers the same.

`startup` builds everything once: the backlog reader, the GPU thread and, on it, the engine (the import
path in the `STATECACHE_ENGINE` setting; by default `statecache.engine:Engine.from_env`, which reads
STATECACHE_MODEL, STATECACHE_DEVICE, STATECACHE_DTYPE, STATECACHE_CACHE_MB). In-process callers (tests)
may put `config` (a `Config`) and/or `make_engine` (a callable) in arq's ctx instead.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from typing import Any

from arq.worker import Retry

from statecache.rows import error_result
from worker import constants as C
from worker.backlog import Backlog
from worker.config import Config
from worker.gpu_thread import GpuThread, Stopping

log = logging.getLogger("statecache.worker")


async def answer(ctx: dict, *args: Any, **kwargs: Any) -> dict:
    if len(args) == 1 and not kwargs:
        row = args[0]
    elif not args and set(kwargs) == {"row"}:
        row = kwargs["row"]
    else:
        return error_result("bad_job", f"answer takes exactly one row, got {len(args)} args and kwargs {sorted(kwargs)}")
    if not isinstance(row, dict):
        return error_result("bad_row", f"a row must be a map, got {type(row).__name__}")
    try:
        return await ctx["gpu"].answer(row)
    except Stopping:
        raise Retry(defer=1)  # back to the queue for the next worker
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("job %s failed outside the engine", ctx.get("job_id"))
        return error_result("internal", f"{type(e).__name__}: {e}")


async def stats(ctx: dict) -> dict:
    gpu: GpuThread = ctx["gpu"]
    backlog: Backlog = ctx["backlog"]
    engine_stats = await gpu.call(lambda engine: dict(engine.stats()))
    return {
        "engine": engine_stats,
        "worker": {**gpu.counters, "pending": gpu.pending(), "queued": backlog.queued, "in_flight": backlog.in_flight},
    }


def import_callable(path: str) -> Any:
    """'package.module:attr.attr' -> the object."""
    module_name, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def _engine_factory(config: Config, make_engine: Any = None):
    make = make_engine or import_callable(config.engine)

    def build():
        engine = make()
        if config.max_row_tokens is not None:
            engine.max_row_tokens = config.max_row_tokens
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
    config: Config = ctx.get("config") or Config.from_env()
    backlog = Backlog(ctx["redis"], config.queue_name, config.backlog_rows)
    gpu = GpuThread(_engine_factory(config, ctx.get("make_engine")), backlog.backed_up)
    await asyncio.to_thread(gpu.start)  # the engine (model, cache, graphs) is built once, on the GPU thread
    ctx.update(config=config, backlog=backlog, gpu=gpu, backlog_task=asyncio.create_task(backlog.run()))
    log.info(
        "statecache worker ready: queue %s, engine %s, backlog threshold %d rows",
        config.queue_name,
        type(gpu.engine).__name__,
        config.backlog_rows,
    )


async def shutdown(ctx: dict) -> None:
    task = ctx.get("backlog_task")
    if task is not None:
        task.cancel()
    gpu: GpuThread | None = ctx.get("gpu")
    if gpu is not None:
        stopped = await asyncio.to_thread(gpu.stop, C.GPU_STOP_WAIT_S)
        log.info("GPU thread %s", "stopped" if stopped else f"still busy after {C.GPU_STOP_WAIT_S} s; exiting anyway")


async def job_started(ctx: dict) -> None:
    ctx["backlog"].in_flight += 1


async def job_ended(ctx: dict) -> None:
    """After arq stored the result: the job no longer counts, and its producer is told to fetch it."""
    ctx["backlog"].in_flight -= 1
    try:
        await ctx["redis"].publish(ctx["config"].queue_name + C.DONE_CHANNEL_SUFFIX, ctx["job_id"])
    except Exception as e:  # the producer falls back to polling
        log.warning("publishing job %s done failed: %s", ctx.get("job_id"), e)
