"""Several workers on one Redis: the Redis side of routing each row to the worker that holds its state.

Every worker's arq serves a queue of its own (`statecache.protocol.private_queue(QUEUE, worker_id)`); agents keep
enqueueing to QUEUE. A `Router` task in every worker:
- beats: its heartbeat key (`live_key`, with a TTL of `route_ttl_s`) holds it live, its id is in `workers_key`, and
  it refreshes QUEUE's health key (what producers and operators check) and its fingerprints hash's TTL;
- advertises what its cache holds: the engine's index reports plants, hits and evictions to a
  statecache.routing.FingerprintLedger; the router writes them to its hash (`fingerprints_key`: fingerprint -> last
  use, seconds), withdraws evicted ones, and writes all of them again when Redis lost the hash (a restart);
- dispatches: takes the ready ids of QUEUE, reads each job's row (arq's job key; the payload stays where it is),
  has the engine align it (`Engine.state_key`), fingerprints it (statecache.routing), asks the live workers' hashes
  for those fingerprints, and lets statecache.routing.choose pick a worker from what they hold and their loads
  (ids in their queues). Jobs other than `answer`
  (stats, profile) and jobs it cannot read go to the worker that read them. The id moves by `ASSIGN` (a Lua
  script): into the chosen worker's queue with its score, and it stays in QUEUE parked `PARKED_MS` in the future
  (no dispatcher sees it as ready, while arq's Job.result() and status(), which look for the id in QUEUE, still
  find it) until its result is stored (`finished`, from arq's after_job_end; `SWEEP` for jobs arq ended without
  running them). arq's job and result keys, and so every producer, are untouched;
- takes, when idle (nothing in its queue, nothing on its GPU thread), ids that have waited past `route_grace_s` in
  another worker's queue (statecache.routing.take_from; `MOVE`, from that queue to its own);
- recovers a dead worker (its id listed, its heartbeat gone): its queue's ids go back to QUEUE and arq's in-progress
  marks of those without a result are cleared, so they run again at once (`RECOVER`, one Lua script: a job that has
  a result is never run again, and a worker whose heartbeat came back is left alone); its hash goes too.
A job leaves a worker's queue only while no arq start of it is under way: MOVE refuses an id in progress and touches
its in-progress key (arq starts a job in a transaction that WATCHes that key, so a start racing the move fails and
arq skips the id). A stopping worker hands its queue back itself (`close`: RECOVER on its own queue, its heartbeat
deleted first).

Knows Redis, arq's key layout and the worker's GPU thread (busy, pending); the decision is statecache.routing's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from arq.utils import timestamp_ms

from statecache.protocol import (IN_PROGRESS_KEY_PREFIX, JOB_ANSWER, JOB_KEY_PREFIX, RESULT_KEY_PREFIX,
                                 fingerprints_key, health_key, live_key, private_queue, workers_key)
from statecache.routing import choose, home_key, prefix_fingerprints, take_from
from worker.serial import job_deserializer

log = logging.getLogger("statecache.worker")

DISPATCH_BATCH = 64  # ids read from QUEUE per round
IDLE_CHECK_S = 0.1  # an idle worker looks for rows to take this often
TAKE_AT_ONCE = 4  # and takes at most this many a look
CLOSE_TRIES, CLOSE_WAIT_S = 5, 1.0  # close() cancels the routing task up to this many times, waiting this long each

PARKED_MS = 10**13  # a routed id stays in QUEUE, this far in the future (arq's Job.result() and status() look for
# it there), until its result is stored; its own score plus this, so never ready for a dispatcher

ASSIGN = """
local s = redis.call('zscore', KEYS[1], ARGV[1])
if not s or tonumber(s) >= tonumber(ARGV[2]) then return 0 end
redis.call('zadd', KEYS[2], s, ARGV[1])
redis.call('zadd', KEYS[1], tonumber(s) + tonumber(ARGV[2]), ARGV[1])
return 1
"""  # KEYS: QUEUE, the chosen worker's queue; ARGV: job id, PARKED_MS

MOVE = """
if redis.call('exists', ARGV[2]) == 1 then return 0 end
local s = redis.call('zscore', KEYS[1], ARGV[1])
if not s then return 0 end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('set', ARGV[2], '0')
redis.call('del', ARGV[2])
redis.call('zadd', KEYS[2], s, ARGV[1])
return 1
"""  # KEYS: source worker's queue, destination worker's queue; ARGV: job id, its in-progress key

RECOVER = """
if redis.call('exists', KEYS[1]) == 1 then return -1 end
local items = redis.call('zrange', KEYS[2], 0, -1, 'WITHSCORES')
local n = 0
for i = 1, #items, 2 do
  local id = items[i]
  if redis.call('exists', ARGV[3] .. id) == 0 then
    redis.call('del', ARGV[2] .. id)
    redis.call('zadd', KEYS[3], items[i + 1], id)
    n = n + 1
  else
    redis.call('zrem', KEYS[3], id)
  end
end
redis.call('del', KEYS[2], KEYS[4])
redis.call('srem', KEYS[5], ARGV[1])
return n
"""  # KEYS: its live key, its queue, QUEUE, its fingerprints, the workers set; ARGV: its id, in-progress and result
# prefixes. Its ids without a result are ready in QUEUE again (their own scores), the others leave QUEUE

FINISHED = """
if redis.call('exists', ARGV[2] .. ARGV[1]) == 1 then return redis.call('zrem', KEYS[1], ARGV[1]) end
return 0
"""  # KEYS: QUEUE; ARGV: job id, result prefix. A job that ended with its result stored leaves QUEUE

SWEEP = """
local ids = redis.call('zrangebyscore', KEYS[1], ARGV[1], '+inf', 'LIMIT', 0, tonumber(ARGV[4]))
local n = 0
for _, id in ipairs(ids) do
  if redis.call('exists', ARGV[2] .. id) == 1 or redis.call('exists', ARGV[3] .. id) == 0 then
    redis.call('zrem', KEYS[1], id)
    n = n + 1
  end
end
return n
"""  # KEYS: QUEUE; ARGV: PARKED_MS, result prefix, job prefix, how many. Parked ids whose job ended another way (failed
# by arq before it ran: expired, too many tries) or whose job key is gone leave QUEUE


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Router:
    def __init__(self, redis: Any, settings: Any, worker_id: str, gpu: Any, ledger: Any, metrics: Any = None):
        self.redis, self.settings, self.id = redis, settings, worker_id
        self.queue = settings.queue
        self.mine = private_queue(self.queue, worker_id)
        self.gpu, self.ledger, self.metrics = gpu, ledger, metrics
        self.ttl_ms = max(1, int(settings.route_ttl_s * 1000))
        self.beat_s = max(0.05, min(settings.route_ttl_s / 4, settings.health_interval_s))
        self.live: list[str] = [worker_id]
        self.counts = {"routed": {}, "shed": 0, "taken": 0, "recovered": 0}
        self._assign = redis.register_script(ASSIGN)
        self._move = redis.register_script(MOVE)
        self._recover = redis.register_script(RECOVER)
        self._finished = redis.register_script(FINISHED)
        self._decode = job_deserializer(settings.max_job_bytes)
        self._sweep = redis.register_script(SWEEP)
        self._task: asyncio.Task | None = None
        self._closing = False
        self._last_beat = 0.0
        self._last_idle = 0.0

    # ---- life ---------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        failing = False
        while not self._closing:
            try:
                now = time.monotonic()
                if now - self._last_beat >= self.beat_s:
                    await self.beat()
                await self.advertise()
                moved = await self.dispatch()
                if now - self._last_idle >= IDLE_CHECK_S:
                    self._last_idle = now
                    moved += await self.take_idle()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - routing trouble must not end the worker; its jobs stay in Redis
                if not failing:
                    log.exception("routing failed; trying again")
                failing, moved = True, 0
                await asyncio.sleep(0.5)
            if not moved:
                await asyncio.sleep(self.settings.poll_delay_s)

    async def close(self) -> None:
        """Stop routing and hand this worker's queue back to QUEUE (arq has finished or cancelled its jobs)."""
        self._closing = True  # ends the loop at its next round, should a cancellation be lost on the way
        task = self._task
        for _ in range(CLOSE_TRIES):
            if task is None or task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
        if task is not None and not task.done():
            log.warning("the routing task outlived %d cancellations; handing the queue back beside it", CLOSE_TRIES)
        try:
            await self.redis.delete(live_key(self.queue, self.id))
            n = await self._recover_worker(self.id)
            if n:
                log.info("handed %d queued jobs back to %s", n, self.queue)
            # a job whose task arq cancelled between storing its result and after_job_end is still parked in QUEUE
            await self._sweep(keys=[self.queue], args=[PARKED_MS, RESULT_KEY_PREFIX, JOB_KEY_PREFIX, 100])
            others = [w for w in self.live if w != self.id]
            if not others or not await self.redis.exists(*[live_key(self.queue, w) for w in others]):
                await self.redis.delete(health_key(self.queue))  # the last one: no worker serves the queue now
        except Exception as e:  # noqa: BLE001 - the others recover them once the heartbeat is gone
            log.warning("handing the queue back failed (%s); the other workers take it once this one's heartbeat expires", e)

    # ---- heartbeat, liveness, recovery ----------------------------------------------------------------------------

    async def beat(self) -> None:
        self._last_beat = time.monotonic()
        info = json.dumps({"pending": self.gpu.pending(), "busy": bool(self.gpu.busy), "t": time.time(),
                           "live": len(self.live)})  # the workers this one routes over (as of its last beat)
        health_ms = int((self.settings.health_interval_s + 1) * 1000)
        fps = fingerprints_key(self.queue, self.id)
        async with self.redis.pipeline(transaction=False) as p:
            p.psetex(live_key(self.queue, self.id), self.ttl_ms, info)
            p.sadd(workers_key(self.queue), self.id)
            if self.gpu.making_progress(self.settings.engine_stuck_s):  # a stuck engine is not healthy (worker.jobs)
                p.psetex(health_key(self.queue), health_ms, f"{time.strftime('%b-%d %H:%M:%S')} routed by {self.id}")
            p.pexpire(fps, self.ttl_ms)
            p.exists(fps)
            p.smembers(workers_key(self.queue))
            *_, has_fps, members = await p.execute()
        if not has_fps:  # Redis lost the hash (restart, or nothing held yet): advertise everything held
            held = self.ledger.held()
            if held:
                await self._hset(held)
        ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        others = [w for w in ids if w != self.id]
        if others:
            async with self.redis.pipeline(transaction=False) as p:
                for w in others:
                    p.exists(live_key(self.queue, w))
                alive = await p.execute()
        else:
            alive = []
        live = [self.id]
        for w, up in zip(others, alive):
            if up:
                live.append(w)
                continue
            n = await self._recover_worker(w)
            if n >= 0:
                self.counts["recovered"] += n
                log.warning("worker %s is gone (no heartbeat for %.1f s): %d of its jobs back to %s", w,
                            self.settings.route_ttl_s, n, self.queue)
        self.live = sorted(live)
        await self._sweep(keys=[self.queue], args=[PARKED_MS, RESULT_KEY_PREFIX, JOB_KEY_PREFIX, 100])
        if self.metrics is not None:
            self.metrics.workers_live.set(len(self.live))

    async def _recover_worker(self, w: str) -> int:
        return int(await self._recover(
            keys=[live_key(self.queue, w), private_queue(self.queue, w), self.queue, fingerprints_key(self.queue, w),
                  workers_key(self.queue)],
            args=[w, IN_PROGRESS_KEY_PREFIX, RESULT_KEY_PREFIX]))

    async def finished(self, job_id: str) -> None:
        """After arq ended a job (arq's after_job_end): once its result is stored it leaves QUEUE."""
        await self._finished(keys=[self.queue], args=[job_id, RESULT_KEY_PREFIX])

    # ---- what this worker holds -----------------------------------------------------------------------------------

    async def advertise(self) -> None:
        fresh, gone = self.ledger.drain()
        if fresh:
            await self._hset(fresh)
        if gone:
            await self.redis.hdel(fingerprints_key(self.queue, self.id), *gone)

    async def _hset(self, fps) -> None:
        key = fingerprints_key(self.queue, self.id)
        now = int(time.time())
        async with self.redis.pipeline(transaction=False) as p:
            p.hset(key, mapping={fp: now for fp in fps})
            p.pexpire(key, self.ttl_ms)
            await p.execute()

    # ---- dispatch -------------------------------------------------------------------------------------------------

    async def loads(self) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as p:
            for w in self.live:
                p.zcard(private_queue(self.queue, w))
            counts = await p.execute()
        return {w: int(n) for w, n in zip(self.live, counts)}

    def _route_key(self, data: bytes | None):
        """(fingerprints, home key) of a job's row, None for a row no state keeps together, or False for a job that is
        not an answer (or cannot be read): it goes to this worker."""
        if data is None:
            return False
        # the worker's own decoding (worker.serial): the same bounds and field checks as arq's, so a job written by
        # hand is refused there, by this worker's arq, with the usual message
        job = self._decode(data)
        args, kwargs = job.get("a"), job.get("k")
        if job.get("f") != JOB_ANSWER or not isinstance(args, list) or not isinstance(kwargs, dict):
            return False
        row = args[0] if len(args) == 1 and not kwargs else kwargs.get("row") if not args else None
        try:
            return self._row_key(row)
        except Exception as e:  # noqa: BLE001 - a row the engine cannot read: this worker's engine answers its error
            log.debug("a row that cannot be routed (%s) goes to this worker", type(e).__name__)
            return False

    def _row_key(self, row):
        engine = self.gpu.engine
        key = engine.state_key(row) if engine is not None and hasattr(engine, "state_key") else None
        if key is None:  # not for the cache, or a row with images: a token row still has a home by its first ids
            ids, state_len = (row.get("ids"), row.get("state_len")) if isinstance(row, dict) else (None, None)
            if isinstance(ids, list) and type(state_len) is int and 0 < state_len <= len(ids):
                try:
                    return [], home_key(ids, state_len, self.ledger.align)
                except (TypeError, ValueError, OverflowError):
                    pass
            return None
        ids, p, state_len = key
        align = self.ledger.align
        return prefix_fingerprints(ids, p, align), home_key(ids, state_len, align)

    async def dispatch(self) -> int:
        """Route QUEUE's ready ids; returns how many moved."""
        got = await self.redis.zrangebyscore(self.queue, "-inf", timestamp_ms(), start=0, num=DISPATCH_BATCH)
        if not got:
            return 0
        ids = [j.decode() if isinstance(j, bytes) else str(j) for j in got]
        async with self.redis.pipeline(transaction=False) as p:
            for j in ids:
                p.get(JOB_KEY_PREFIX + j)
            payloads = await p.execute()
        keys = [self._route_key(d) for d in payloads]
        loads = await self.loads()
        held: list[dict[str, int]] = [{} for _ in ids]
        asks = [(i, w) for i, k in enumerate(keys) if k and k[0] for w in self.live]
        if asks:
            async with self.redis.pipeline(transaction=False) as p:
                for i, w in asks:
                    p.hmget(fingerprints_key(self.queue, w), keys[i][0])
                answers = await p.execute()
            for (i, w), vals in zip(asks, answers):
                depth = max((d + 1 for d, v in enumerate(vals) if v is not None), default=0)
                if depth:
                    held[i][w] = depth
        moved = 0
        for j, k, h in zip(ids, keys, held):
            if k is False:
                target, reason = self.id, None
            else:
                d = choose(loads, h, k[1] if k else None, self.settings.route_shed_rows)
                target, reason = d.worker, d.reason
            if await self._assign(keys=[self.queue, private_queue(self.queue, target)], args=[j, PARKED_MS]):
                moved += 1
                loads[target] = loads.get(target, 0) + 1
                if reason is not None:
                    self._count(reason)
        return moved

    def _count(self, reason: str) -> None:
        r = self.counts["routed"]
        r[reason] = r.get(reason, 0) + 1
        if reason == "shed":
            self.counts["shed"] += 1
        if self.metrics is not None:
            self.metrics.routed.labels(reason).inc()
            if reason == "shed":
                self.metrics.shed.inc()

    async def take_idle(self) -> int:
        """Idle: take rows that waited past the grace period in other workers' queues."""
        if self.gpu.busy or self.gpu.pending() or len(self.live) < 2:
            return 0
        if await self.redis.zcard(self.mine):
            return 0
        now_ms = timestamp_ms()
        grace_ms = int(self.settings.route_grace_s * 1000)
        taken = 0
        for w in self.live:
            if w == self.id or taken >= TAKE_AT_ONCE:
                continue
            q = private_queue(self.queue, w)
            old = await self.redis.zrangebyscore(q, "-inf", now_ms - grace_ms, start=0, num=TAKE_AT_ONCE - taken,
                                                 withscores=True)
            for j, score in old:
                if not take_from(0, (now_ms - score) / 1000, self.settings.route_grace_s):
                    break
                j = j.decode() if isinstance(j, bytes) else str(j)
                if await self._move(keys=[q, self.mine], args=[j, IN_PROGRESS_KEY_PREFIX + j]):
                    taken += 1
        if taken:
            self.counts["taken"] += taken
            if self.metrics is not None:
                self.metrics.taken.inc(taken)
        return taken
