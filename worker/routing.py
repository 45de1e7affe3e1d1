"""Several workers on one Redis: the Redis side of routing each row to the worker that holds its state.

Every worker's arq serves a queue of its own (`statecache.protocol.private_queue(QUEUE, worker_id)`); agents keep
enqueueing to QUEUE. A `Router` task in every worker:
- beats: its heartbeat key (`live_key`, with a TTL of `route_ttl_s`) holds it live, its id is in `workers_key`, and
  it refreshes QUEUE's health key (what producers and operators check) and its fingerprints hash's TTL;
- advertises what its cache holds: the engine's index reports plants, hits and evictions to a
  statecache.cache.routing.FingerprintLedger; the router writes them to its hash (`fingerprints_key`: fingerprint -> last
  use, seconds), withdraws evicted ones, and writes all of them again when Redis lost the hash (a restart);
- dispatches: takes the ready ids of QUEUE, reads each job's row (arq's job key; the payload stays where it is;
  a key of another Redis type is one job that cannot be read), has the engine check and align it on the row thread
  (worker.prepare, `Engine.state_key`: decoding and tokenising never run on the event loop; a row routed to this
  worker is remembered there, so its job does not tokenise it again),
  fingerprints it (statecache.cache.routing), asks the live workers' hashes for those fingerprints, and lets
  statecache.cache.routing.choose pick a worker from what they hold and their loads (ids in their queues), the live
  workers read afresh each round. Jobs other than `answer` (stats, profile) and jobs it cannot read go to the worker
  that read them. The id moves by `ASSIGN` (a Lua script), which checks the chosen worker is listed and live (else
  the id stays ready in QUEUE and the dispatcher chooses again): into its queue with its score, and it stays in
  QUEUE parked `PARKED_MS` in the future (no dispatcher sees it as ready, while arq's Job.result() and status(),
  which look for the id in QUEUE, still find it) until its result is stored (`finished`, from arq's after_job_end;
  `SWEEP` for jobs arq ended without running them). arq's job and result keys, and so every producer, are untouched.
  The ids a round moved to this worker's own queue go to `on_routed_here` (worker.jobs starts them at once);
- takes, when idle (nothing in its queue, nothing on its GPU thread), ids that have waited past `route_grace_s` in
  another worker's queue (statecache.cache.routing.take_from; `MOVE`, from that queue to its own, only while it is live);
- recovers a dead worker (its id listed, no heartbeat, live or draining): its queue's ids go back to QUEUE and arq's
  in-progress marks of those without a result are cleared, so they run again at once (`RECOVER`, one Lua script: a
  job that has a result is never run again, and a worker whose heartbeat came back is left alone); its hash goes
  too, and its id leaves the list. Every `ORPHAN_SCAN_BEATS` beats it also looks for private queues of workers not
  listed (`recover_orphans`, SCAN over the private queues' names) and recovers them the same way.
The guarantee: every id without a result is in QUEUE, ready, or parked there and in exactly one worker's queue; that
worker is live, or draining (its heartbeat says it finishes what it runs), or listed without a heartbeat (recovered
at the next beat of any worker), or unlisted (recovered by the next orphan scan). Every move is one script.
A job leaves a worker's queue only while no arq start of it is under way: MOVE and HANDBACK refuse an id in progress
and touch its in-progress key (arq starts a job in a transaction that WATCHes that key, so a start racing the move
fails and arq skips the id).
Stopping: from the moment a worker is told to stop (`stop_soon`, from arq's SIGTERM/SIGINT handler and the stuck-engine
watch, worker.jobs) it takes nothing new: its heartbeat becomes a draining one (`draining_key`; no ASSIGN or MOVE
targets it), the ids it has not started go back to QUEUE (`HANDBACK`), and what comes back to its queue later (a job
sent back for waiting) too, each round, while arq's drain lets the running ones finish. `close` (arq's shutdown,
after the drain) RECOVERs what is left on its own queue, its heartbeats deleted first.

Knows Redis, arq's key layout and the worker's GPU thread (busy, pending); the decision is statecache.cache.routing's.
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

from statecache.cache.routing import choose, home_key, prefix_fingerprints, take_from
from statecache.protocol import (IN_PROGRESS_KEY_PREFIX, JOB_ANSWER, JOB_KEY_PREFIX, RESULT_KEY_PREFIX, draining_key,
                                 enqueued_channel, fingerprints_key, follow_channel, health_key, live_key,
                                 private_queue, private_queue_pattern, workers_key)
from worker.prepare import RowPrep
from worker.serial import job_deserializer

log = logging.getLogger("statecache.worker")

DISPATCH_BATCH = 64  # ids read from QUEUE per round
IDLE_CHECK_S = 0.1  # an idle worker looks for rows to take this often
TAKE_AT_ONCE = 4  # and takes at most this many a look
CLOSE_TRIES, CLOSE_WAIT_S = 5, 1.0  # close() cancels the routing task up to this many times, waiting this long each

PARKED_MS = 10**13  # a routed id stays in QUEUE, this far in the future (arq's Job.result() and status() look for
# it there), until its result is stored; its own score plus this, so never ready for a dispatcher

ASSIGN = """
if redis.call('exists', KEYS[3]) == 0 or redis.call('sismember', KEYS[4], ARGV[3]) == 0 then return -1 end
local s = redis.call('zscore', KEYS[1], ARGV[1])
if not s or tonumber(s) >= tonumber(ARGV[2]) then return 0 end
s = math.max(tonumber(s), 1)
redis.call('zadd', KEYS[2], s, ARGV[1])
redis.call('zadd', KEYS[1], s + tonumber(ARGV[2]), ARGV[1])
return 1
"""  # KEYS: QUEUE, the chosen worker's queue, its live key, the workers set; ARGV: job id, PARKED_MS, its id. -1: that
# worker is not live (the id stays ready in QUEUE); 0: the id is no longer ready there (another dispatcher moved it).
# A score below 1 (0, -inf: written by hand) is 1, the oldest: arq skips a job whose score is 0, and -inf + PARKED_MS
# would never park

MOVE = """
if redis.call('exists', KEYS[3]) == 0 or redis.call('sismember', KEYS[4], ARGV[3]) == 0 then return -1 end
if redis.call('exists', ARGV[2]) == 1 then return 0 end
local s = redis.call('zscore', KEYS[1], ARGV[1])
if not s then return 0 end
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('set', ARGV[2], '0')
redis.call('del', ARGV[2])
redis.call('zadd', KEYS[2], s, ARGV[1])
return 1
"""  # KEYS: source worker's queue, destination worker's queue, its live key, the workers set; ARGV: job id, its
# in-progress key, the destination's id. Only to a live destination

HANDBACK = """
local items = redis.call('zrange', KEYS[1], 0, -1, 'WITHSCORES')
local n = 0
for i = 1, #items, 2 do
  local id = items[i]
  if redis.call('exists', ARGV[1] .. id) == 0 then
    redis.call('zrem', KEYS[1], id)
    if redis.call('exists', ARGV[2] .. id) == 1 then
      redis.call('zrem', KEYS[2], id)
    else
      redis.call('set', ARGV[1] .. id, '0')
      redis.call('del', ARGV[1] .. id)
      redis.call('zadd', KEYS[2], items[i + 1], id)
      n = n + 1
    end
  end
end
return n
"""  # KEYS: a stopping worker's queue, QUEUE; ARGV: in-progress and result prefixes. The ids it has not started go back
# to QUEUE, ready (their own scores); those it runs stay. Touching the in-progress key fails an arq start racing this

RECOVER = """
if redis.call('exists', KEYS[1]) == 1 or redis.call('exists', KEYS[2]) == 1 then return -1 end
local items = redis.call('zrange', KEYS[3], 0, -1, 'WITHSCORES')
local n = 0
for i = 1, #items, 2 do
  local id = items[i]
  if redis.call('exists', ARGV[3] .. id) == 0 then
    redis.call('del', ARGV[2] .. id)
    redis.call('zadd', KEYS[4], items[i + 1], id)
    n = n + 1
  else
    redis.call('zrem', KEYS[4], id)
  end
end
redis.call('del', KEYS[3], KEYS[5])
redis.call('srem', KEYS[6], ARGV[1])
return n
"""  # KEYS: its live key, its draining key, its queue, QUEUE, its fingerprints, the workers set; ARGV: its id, in-progress
# and result prefixes. Its ids without a result are ready in QUEUE again (their own scores), the others leave QUEUE;
# -1 (nothing done) while it beats, live or draining

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


ORPHAN_SCAN_BEATS = 8  # every this many beats, private queues of workers not listed are looked for (recover_orphans)


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else str(b)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Router:
    def __init__(self, redis: Any, settings: Any, worker_id: str, gpu: Any, ledger: Any, metrics: Any = None,
                 prep: RowPrep | None = None):
        self.redis, self.settings, self.id = redis, settings, worker_id
        self.prep = prep if prep is not None else RowPrep(gpu)  # the row thread (worker.prepare)
        self.queue = settings.queue
        self.mine = private_queue(self.queue, worker_id)
        self.gpu, self.ledger, self.metrics = gpu, ledger, metrics
        self.ttl_ms = max(1, int(settings.route_ttl_s * 1000))
        self.beat_s = max(0.05, min(settings.route_ttl_s / 4, settings.health_interval_s))
        self.live: list[str] = [worker_id]
        self.counts = {"routed": {}, "shed": 0, "taken": 0, "recovered": 0}
        self._assign = redis.register_script(ASSIGN)
        self._move = redis.register_script(MOVE)
        self._handback = redis.register_script(HANDBACK)
        self._recover = redis.register_script(RECOVER)
        self._finished = redis.register_script(FINISHED)
        self._decode = job_deserializer(settings.max_job_bytes)
        self._sweep = redis.register_script(SWEEP)
        self._task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None
        self._closing = False
        self.stopping = False  # told to stop: takes nothing new, beats as draining (stop())
        # called with the ids a dispatch round moved to this worker's own queue (worker.jobs starts them at once)
        self.on_routed_here: Any = None
        self._announced = asyncio.Event()  # a producer enqueued a job (the enqueued channel): the next round now
        self._listener: asyncio.Task | None = None
        self._last_beat = 0.0
        self._last_idle = 0.0
        self._beats = 0

    # ---- life ---------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self.run())
        self._listener = asyncio.create_task(self._listen())

    async def run(self) -> None:
        failing = False
        while not self._closing:
            try:
                now = time.monotonic()
                if now - self._last_beat >= self.beat_s:
                    await self.beat()
                moved = 0
                if self.stopping:
                    await self.hand_back()
                else:
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
                if self.stopping:
                    await asyncio.sleep(self.beat_s)
                else:
                    await self._nap(self.settings.poll_delay_s)

    async def _nap(self, seconds: float) -> None:
        """Sleep `seconds`, or less: until a producer announces a job on QUEUE."""
        try:
            async with asyncio.timeout(seconds):
                await self._announced.wait()
        except TimeoutError:
            pass
        self._announced.clear()  # one announced later (during the round) wakes the next nap at once

    async def _listen(self) -> None:
        """Producers' announcements (the enqueued channel) wake the loop's nap; lost, the loop polls every
        poll_delay_s as before, and this subscribes again."""

        def on_state(error: Exception | None) -> None:
            if error is not None:
                log.info("the enqueued channel is lost (%s); polling %s until it is back", error, self.queue)

        await follow_channel(self.redis, enqueued_channel(self.queue), lambda _: self._announced.set(), on_state)

    def stop_soon(self) -> None:
        """Told to stop (SIGTERM, a stuck engine), called from a signal handler or the loop: stop() starts now."""
        if self._stop_task is None and not self._closing:
            self.stopping = True  # the loop dispatches and takes nothing from its next step on
            self._stop_task = asyncio.get_event_loop().create_task(self.stop())

    async def stop(self) -> None:
        """Take nothing new from now on: the routing round under way ends (cancelled), the heartbeat becomes a
        draining one (no dispatcher assigns here, no idle worker takes into here; the others still see this
        worker's queue as watched and recover it should this one die), and the jobs not yet started go back to
        QUEUE. The jobs already running may finish within arq's drain; the loop goes on beating as draining and
        handing back what comes back here (a job sent back for waiting) until close()."""
        self.stopping = True
        await self._cancel_task()
        async with self.redis.pipeline(transaction=False) as p:
            p.psetex(draining_key(self.queue, self.id), self.ttl_ms, "draining")
            p.delete(live_key(self.queue, self.id))
            await p.execute()
        await self.hand_back()
        if self._task is not None and not self._closing:  # a started router goes on beating as draining
            self._task = asyncio.create_task(self.run())

    async def hand_back(self) -> int:
        n = int(await self._handback(keys=[self.mine, self.queue], args=[IN_PROGRESS_KEY_PREFIX, RESULT_KEY_PREFIX]))
        if n:
            log.info("stopping: handed %d jobs not yet started back to %s", n, self.queue)
        return n

    async def _cancel_task(self) -> None:
        task = self._task
        if task is asyncio.current_task():
            return
        for _ in range(CLOSE_TRIES):
            if task is None or task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
        if task is not None and not task.done():
            log.warning("the routing task outlived %d cancellations; going on beside it", CLOSE_TRIES)

    async def close(self) -> None:
        """Stop routing and hand this worker's queue back to QUEUE (arq has finished or cancelled its jobs)."""
        stop = self._stop_task
        self._closing = True  # ends the loop at its next round, should a cancellation be lost on the way
        if stop is not None and not stop.done():
            await asyncio.wait({stop}, timeout=CLOSE_TRIES * CLOSE_WAIT_S)
        await self._cancel_task()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait({self._listener}, timeout=CLOSE_WAIT_S)
        try:
            await self.redis.delete(live_key(self.queue, self.id), draining_key(self.queue, self.id))
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
        self._beats += 1
        info = json.dumps({"pending": self.gpu.pending(), "busy": bool(self.gpu.busy), "t": time.time(),
                           "live": len(self.live)})  # the workers this one routes over (as of its last beat)
        health_ms = int((self.settings.health_interval_s + 1) * 1000)
        fps = fingerprints_key(self.queue, self.id)
        async with self.redis.pipeline(transaction=False) as p:
            if self.stopping:  # still watched (its queue holds what it runs), never a target
                p.psetex(draining_key(self.queue, self.id), self.ttl_ms, info)
                p.delete(live_key(self.queue, self.id))
            else:
                p.psetex(live_key(self.queue, self.id), self.ttl_ms, info)
                if self.gpu.making_progress(self.settings.engine_stuck_s):  # a stuck engine is not healthy (worker.jobs)
                    p.psetex(health_key(self.queue), health_ms, f"{time.strftime('%b-%d %H:%M:%S')} routed by {self.id}")
            p.sadd(workers_key(self.queue), self.id)
            p.pexpire(fps, self.ttl_ms)
            p.exists(fps)
            p.smembers(workers_key(self.queue))
            *_, has_fps, members = await p.execute()
        if not has_fps and not self.stopping:  # Redis lost the hash (restart, or nothing held yet): advertise all held
            held = self.ledger.held()
            if held:
                await self._hset(held)
        ids = sorted(_text(m) for m in members)
        live = await self.recover_dead(ids)
        self.live = sorted(live)
        if self._beats % ORPHAN_SCAN_BEATS == 1:
            await self.recover_orphans(set(ids))
        await self._sweep(keys=[self.queue], args=[PARKED_MS, RESULT_KEY_PREFIX, JOB_KEY_PREFIX, 100])
        if self.metrics is not None:
            self.metrics.workers_live.set(len(self.live))

    async def recover_dead(self, members: list[str]) -> list[str]:
        """Recover every listed worker with no heartbeat (neither live nor draining); the live ones (this one too,
        unless it is stopping)."""
        others = [w for w in members if w != self.id]
        if others:
            async with self.redis.pipeline(transaction=False) as p:
                for w in others:
                    p.exists(live_key(self.queue, w))
                    p.exists(draining_key(self.queue, w))
                flags = await p.execute()
        else:
            flags = []
        live = [] if self.stopping else [self.id]
        for i, w in enumerate(others):
            is_live, draining = flags[2 * i], flags[2 * i + 1]
            if is_live:
                live.append(w)
            elif not draining:
                await self._recovered(w, await self._recover_worker(w))
        return live

    async def recover_orphans(self, members: set[str]) -> int:
        """Private queues of workers not in the workers set (a Redis restart that kept the queues but not the set, or
        ids put there by hand): recovered like a dead worker's unless that worker beats."""
        prefix = private_queue(self.queue, "")
        found = 0
        async for key in self.redis.scan_iter(match=private_queue_pattern(self.queue), count=1000):
            w = _text(key)[len(prefix):]
            if w in members or w == self.id:
                continue
            n = await self._recover_worker(w)
            if n >= 0:
                found += 1
                await self._recovered(w, n)
        return found

    async def _recovered(self, w: str, n: int) -> None:
        if n >= 0:
            self.counts["recovered"] += n
            log.warning("worker %s is gone (no heartbeat for %.1f s): %d of its jobs back to %s", w,
                        self.settings.route_ttl_s, n, self.queue)

    async def _recover_worker(self, w: str) -> int:
        return int(await self._recover(
            keys=[live_key(self.queue, w), draining_key(self.queue, w), private_queue(self.queue, w), self.queue,
                  fingerprints_key(self.queue, w), workers_key(self.queue)],
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
        """The live workers now (listed, with a live heartbeat: read afresh, never the last beat's view) and their
        loads (ids in their queues)."""
        members = sorted(_text(m) for m in await self.redis.smembers(workers_key(self.queue)))
        async with self.redis.pipeline(transaction=False) as p:
            for w in members:
                p.exists(live_key(self.queue, w))
                p.zcard(private_queue(self.queue, w))
            got = await p.execute()
        return {w: int(got[2 * i + 1]) for i, w in enumerate(members) if got[2 * i]}

    def _route_key(self, data: bytes | None):
        """(route key, (digest, CheckedRow) or None) of a job: the route key is (fingerprints, home key) of its row,
        None for a row no state keeps together, or False for a job that is not an answer (or cannot be read): it goes
        to this worker. Runs on the row thread (worker.prepare): decoding, checking and tokenising stay off the loop."""
        if data is None:
            return False, None
        # the worker's own decoding (worker.serial): the same bounds and field checks as arq's, so a job written by
        # hand is refused there, by this worker's arq, with the usual message
        try:
            job = self._decode(data)
        except Exception:  # noqa: BLE001 - this worker's arq refuses it
            return False, None
        args, kwargs = job.get("a"), job.get("k")
        if job.get("f") != JOB_ANSWER or not isinstance(args, list) or not isinstance(kwargs, dict):
            return False, None
        row = args[0] if len(args) == 1 and not kwargs else kwargs.get("row") if not args else None
        try:
            checked = self.prep.check_one(row)
            return self._row_key(row, checked[1]), checked
        except Exception as e:  # noqa: BLE001 - a row the engine cannot read: this worker's engine answers its error
            log.debug("a row that cannot be routed (%s) goes to this worker", type(e).__name__)
            return False, None

    def _row_key(self, row, checked=None):
        """(fingerprints, home key) of a row, from its CheckedRow (worker.prepare; None: a row with images, or no
        engine yet), or None."""
        engine = self.gpu.engine
        key = engine.state_key(checked) if engine is not None and checked is not None else None
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
        """Route QUEUE's ready ids; returns how many moved. A job key that cannot be read (of another Redis type)
        fails that job only: it goes to this worker, whose arq fails it (worker.jobs)."""
        got = await self.redis.zrangebyscore(self.queue, "-inf", timestamp_ms(), start=0, num=DISPATCH_BATCH)
        if not got:
            return 0
        ids = [_text(j) for j in got]
        async with self.redis.pipeline(transaction=False) as p:
            for j in ids:
                p.get(JOB_KEY_PREFIX + j)
            payloads = await p.execute(raise_on_error=False)
        # decoded, checked and tokenised on the row thread (worker.prepare): the loop beats and polls meanwhile
        routed = await self._beating(self.prep.run(
            lambda: [self._route_key(d if isinstance(d, bytes) else None) for d in payloads]))
        keys = [k for k, _ in routed]
        loads = await self.loads()
        if not loads:
            return 0  # no live worker (this one's heartbeat lapsed): the ids stay ready for the next round
        live = sorted(loads)
        held: list[dict[str, int]] = [{} for _ in ids]
        asks = [(i, w) for i, k in enumerate(keys) if k and k[0] for w in live]
        if asks:
            async with self.redis.pipeline(transaction=False) as p:
                for i, w in asks:
                    p.hmget(fingerprints_key(self.queue, w), keys[i][0])
                answers = await p.execute(raise_on_error=False)
            for (i, w), vals in zip(asks, answers):
                if isinstance(vals, Exception):
                    continue  # a hash of another type: holds nothing
                depth = max((d + 1 for d, v in enumerate(vals) if v is not None), default=0)
                if depth:
                    held[i][w] = depth
        moved, here = 0, []
        for j, k, h, (_, checked) in zip(ids, keys, held, routed):  # checked: (digest, CheckedRow) or None
            while loads:
                if k is False:
                    target, reason = self.id, None
                else:
                    d = choose(loads, h, k[1] if k else None, self.settings.route_shed_rows)
                    target, reason = d.worker, d.reason
                done = await self.assign(j, target)
                if done == -1:  # its heartbeat lapsed since loads(): choose again among the others
                    loads.pop(target, None)
                    h.pop(target, None)
                    if k is False:
                        break
                    continue
                if done:
                    moved += 1
                    loads[target] = loads.get(target, 0) + 1
                    if target == self.id:
                        here.append(j)
                        if checked is not None:  # its job runs here: tokenised already
                            self.prep.remember(*checked)
                    if reason is not None:
                        self._count(reason)
                break
        if here and self.on_routed_here is not None and not self.stopping:
            self.on_routed_here(here)
        return moved

    async def _beating(self, work):
        """Await `work` (the row thread's), beating every `beat_s` meanwhile: however long a round's rows take to
        check and tokenise (or the row thread is busy with jobs' rows), this worker's heartbeat does not lapse."""
        fut = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.beat_s)
                if done:
                    return fut.result()
                await self.beat()
        finally:
            fut.cancel()  # a cancelled round: the thread's result is dropped

    async def assign(self, job_id: str, target: str) -> int:
        """ASSIGN: 1 moved, 0 no longer ready in QUEUE, -1 `target` is not live (the id stays ready)."""
        return int(await self._assign(
            keys=[self.queue, private_queue(self.queue, target), live_key(self.queue, target), workers_key(self.queue)],
            args=[job_id, PARKED_MS, target]))

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
        if self.stopping or self.gpu.busy or self.gpu.pending() or len(self.live) < 2:
            return 0
        if await self.redis.zcard(self.mine):
            return 0
        now_ms = timestamp_ms()
        grace_ms = int(self.settings.route_grace_s * 1000)
        taken, refused = 0, False
        for w in self.live:
            if w == self.id or taken >= TAKE_AT_ONCE or refused:
                continue
            q = private_queue(self.queue, w)
            old = await self.redis.zrangebyscore(q, "-inf", now_ms - grace_ms, start=0, num=TAKE_AT_ONCE - taken,
                                                 withscores=True)
            for j, score in old:
                if not take_from(0, (now_ms - score) / 1000, self.settings.route_grace_s):
                    break
                j = _text(j)
                done = await self._move(keys=[q, self.mine, live_key(self.queue, self.id), workers_key(self.queue)],
                                        args=[j, IN_PROGRESS_KEY_PREFIX + j, self.id])
                if done == -1:  # this worker is not live (stopping, or its heartbeat lapsed): takes nothing
                    refused = True
                    break
                if done:
                    taken += 1
        if taken:
            self.counts["taken"] += taken
            if self.metrics is not None:
                self.metrics.taken.inc(taken)
        return taken
