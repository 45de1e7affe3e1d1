"""Is the queue backed up? Waiting work = ready jobs in Redis not yet taken + rows waiting in this worker.

arq keeps a job in its queue (a sorted set scored by the time it may run) until the job has finished, so the
ready jobs nobody has taken are `ZCOUNT queue -inf now` minus the jobs this worker holds (`in_flight`,
counted by the job start/end hooks). Jobs held by other workers read as waiting here: the threshold is per
worker. The count is read by an event-loop task at most every `read_every_s` and kept in `queued`, which the
GPU thread reads without touching Redis.

"Backed up" (DESIGN.md section 4) = more waiting rows than `threshold_rows`, the rows one plain batch
absorbs. The GPU thread counts the batch it is about to run as waiting too: a batch of 20 new states is a
backlog by itself, a handful of agents asking one question at a time is not.

Knows Redis and arq's queue layout; does not know the engine.
"""

from __future__ import annotations

import asyncio
import logging

from arq.utils import timestamp_ms

from worker import constants as C

log = logging.getLogger("statecache.worker")


class Backlog:
    def __init__(self, redis, queue_name: str, threshold_rows: int, read_every_s: float = C.BACKLOG_READ_EVERY_S):
        self.redis = redis
        self.queue_name = queue_name
        self.threshold_rows = threshold_rows
        self.read_every_s = read_every_s
        self.in_flight = 0  # jobs this worker has started and not finished (event loop only)
        self.queued = 0  # last read: ready jobs in Redis that no job of this worker holds

    def waiting(self, local_rows: int) -> int:
        return self.queued + local_rows

    def backed_up(self, local_rows: int) -> bool:
        """Called from the GPU thread with the rows it holds (the batch and its queue)."""
        return self.waiting(local_rows) > self.threshold_rows

    async def read(self) -> int:
        ready = await self.redis.zcount(self.queue_name, "-inf", timestamp_ms())  # arq's clock, as its scores
        self.queued = max(0, ready - self.in_flight)
        return self.queued

    async def run(self) -> None:
        failing = False
        while True:
            try:
                await self.read()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the last value; Redis trouble is arq's to report
                if not failing:
                    log.warning("reading the backlog failed (%s); keeping the last count", e)
                failing = True
            await asyncio.sleep(self.read_every_s)
