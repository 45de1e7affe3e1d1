"""The backlog the worker sees: ready jobs in Redis not yet taken + rows waiting in this worker's GPU thread.

arq keeps a job in its queue (a sorted set scored by the time it may run) until the job has finished, so the
ready jobs nobody has taken are `ZCOUNT queue -inf now` minus the jobs this worker holds (`in_flight`,
counted by the job start/end hooks). Jobs held by other workers read as waiting here. The count is read by an
event-loop task at most every `read_every_s` and kept in `queued`, which the GPU thread reads (through
`waiting`) without touching Redis; the engine's cold_ok policy gets it as `waiting_rows`.

Knows Redis and arq's queue layout; does not know the engine.
"""

from __future__ import annotations

import asyncio
import logging

from arq.utils import timestamp_ms

log = logging.getLogger("statecache.worker")

READ_EVERY_S = 0.25  # the Redis backlog (ZCOUNT of ready jobs) is read at most this often (it informs the cold_ok
# policy and a gauge; every read is a round trip and an event-loop wake-up beside the GPU thread)


class Backlog:
    def __init__(self, redis, queue_name: str, read_every_s: float = READ_EVERY_S, also: str | None = None):
        self.redis = redis
        self.queue_name = queue_name
        self.also = also  # a routed worker (worker.routing): the shared queue's ready ids wait for this worker too
        self.read_every_s = read_every_s
        self.in_flight = 0  # jobs this worker has started and not finished (event loop only)
        self.queued = 0  # last read: ready jobs in Redis that no job of this worker holds

    def waiting(self, local_rows: int) -> int:
        """Rows waiting beyond the batch being run: Redis's ready jobs not taken + `local_rows` queued here."""
        return self.queued + local_rows

    async def read(self) -> int:
        ready = await self.redis.zcount(self.queue_name, "-inf", timestamp_ms())  # arq's clock, as its scores
        shared = await self.redis.zcount(self.also, "-inf", timestamp_ms()) if self.also else 0
        self.queued = max(0, ready - self.in_flight) + shared
        return self.queued

    async def run(self, metrics=None, pending=lambda: 0) -> None:
        failing = False
        while True:
            try:
                await self.read()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the last value; Redis trouble is reported by the Redis client
                if not failing:
                    log.warning("reading the backlog failed (%s); keeping the last count", e)
                failing = True
            if metrics is not None:
                metrics.waiting.set(self.waiting(pending()))
            await asyncio.sleep(self.read_every_s)
