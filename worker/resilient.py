"""A Redis client for the worker that waits out a Redis restart or failover instead of failing.

arq's worker lets a `ConnectionError` from any Redis call escape its poll loop and exit. The worker hands arq
this client (`ResilientRedis`, arq's `redis_pool` setting) instead: every command, and every pipeline, that
fails for want of a connection is tried again with backoff (`RETRY_FIRST_S` doubling up to `RETRY_MAX_S`)
until Redis answers. Meanwhile the poll loop, the health key and the results of rows that finish wait; the
health key expires, so the worker reads as not healthy; rows already on the GPU are computed and their results
are stored once Redis is back. Transactions that WATCH keys (arq's job start) re-watch on the new connection;
one whose EXEC was cut off ends as a `WatchError` (arq then leaves the job in the queue for the next poll).
Redis at its maxmemory with noeviction (`OutOfMemoryError`: it refuses every write, and every command queued in a
transaction) is waited out the same way (`no_room`): nothing of a refused command or transaction ran, so it is sent
again once Redis has room (a watched one ends as a `WatchError`, as above); the worker logs it once, without the
command's arguments (redis-py quotes them: a job's row, a result), and does not exit.
After `give_up()` (the worker is stopping) errors are raised as they come. Redis refusing the worker's
credentials or permissions (statecache.protocol's `REFUSED`: wrong password or user, NOAUTH, WRONGPASS, NOPERM;
redis-py makes the first ones `ConnectionError`s) is no outage: it is not retried, at start-up or later; the
worker logs what to fix in `REDIS_URL` and exits with status `EXIT_REFUSED`.

Every call is bounded by `COMMAND_TIMEOUT_S` here, with `asyncio.timeout`, and redis-py's own socket timeout is left
off: with one set, redis-py sends each command through `asyncio.wait_for`, and Python 3.11's `wait_for` drops a
cancellation that arrives as the send finishes (the call returns as if never cancelled; about one in four cancels
thrown at a busy call). In the worker, the router's loop went on after shutdown had cancelled it
(tests/test_worker_units.py::test_a_cancelled_redis_call_is_cancelled).

Knows redis-py's asyncio client and arq's `ArqRedis`; nothing of jobs or the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from arq.connections import ArqRedis
from redis.asyncio.client import Pipeline
from redis.exceptions import BusyLoadingError, ConnectionError, OutOfMemoryError, TimeoutError, WatchError

from statecache.protocol import REFUSED, redact
from statecache.redis_url import connection_pool

log = logging.getLogger("statecache.worker")

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
COMMAND_TIMEOUT_S = 10.0  # a command (or pipeline) Redis has not answered in this long counts as a lost connection
LOST = (ConnectionError, TimeoutError, BusyLoadingError, OSError)
EXIT_REFUSED = 78  # sysexits' EX_CONFIG: the worker's configuration (REDIS_URL) is wrong; a restart will not help


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


class ResilientRedis(ArqRedis):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.up = True
        self.down_since = 0.0
        self.outages = 0
        self.on_change: Callable[[bool], None] | None = None  # called with the new state (metrics)
        self._giving_up = False
        self._failures = 0
        # the ids of jobs this worker is running now (set by worker.jobs at start-up from arq's own task table): see
        # zrangebyscore
        self.running_here: Callable[[], set[str]] | None = None
        self.url = ""  # REDIS_URL (from_dsn), for the message when Redis refuses it; shown redacted
        self._refused = False
        self._full_since = 0.0  # when Redis last began refusing writes for want of memory (0: it has room)

    @classmethod
    def from_dsn(cls, url: str, **kwargs: Any) -> "ResilientRedis":
        """The client for `url`, read as everywhere else (statecache.redis_url: every form redis-py accepts)."""
        kwargs.setdefault("socket_connect_timeout", 2)
        redis = cls(connection_pool(url, **kwargs))  # no socket_timeout: COMMAND_TIMEOUT_S (above)
        redis.url = url
        return redis

    def give_up(self) -> None:
        """From now on, raise connection errors instead of waiting (the worker is stopping)."""
        self._giving_up = True

    async def lost(self, error: BaseException) -> None:
        """A call failed for want of Redis: note it, then sleep the next backoff step (or raise)."""
        if self._giving_up:
            raise error
        if self.up:
            self.up = False
            self.down_since = time.monotonic()
            self.outages += 1
            self._failures = 0
            log.warning("Redis unreachable (%s: %s); waiting for it, retrying with backoff", type(error).__name__,
                        redact(error))
            if self.on_change:
                self.on_change(False)
        self._failures += 1
        await asyncio.sleep(min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(self._failures, 10)))

    async def no_room(self, error: OutOfMemoryError) -> None:
        """Redis refused a write for want of memory (maxmemory, noeviction): say so once, sleep the next backoff step
        (or raise, without the command's arguments, once the worker is stopping)."""
        if self._giving_up:
            raise OutOfMemoryError("Redis is out of memory (maxmemory, noeviction)") from None
        if not self._full_since:
            self._full_since = time.monotonic()
            self._failures = 0
            log.warning("Redis is out of memory (used memory over its maxmemory, maxmemory-policy noeviction) and "
                        "refuses writes: waiting for room, retrying with backoff; raise its maxmemory or free memory")
        self._failures += 1
        await asyncio.sleep(min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(self._failures, 10)))

    def roomy(self) -> None:
        if self._full_since:
            log.warning("Redis has room again after %.1f s", time.monotonic() - self._full_since)
            self._full_since = 0.0

    def refused(self, error: BaseException) -> None:
        """Redis refused the credentials or permissions of REDIS_URL: say what to fix (once) and stop the worker."""
        if not self._refused:
            self._refused = True
            log.error("Redis refused this worker (%s: %s): check REDIS_URL=%s (user and password: "
                      "redis://user:password@host:port/db; that user's ACL permissions); not retried, the worker stops",
                      type(error).__name__, redact(error), redact(self.url) or "?")
        raise SystemExit(EXIT_REFUSED)

    def back(self) -> None:
        if not self.up:
            self.up = True
            log.warning("Redis is back after %.1f s", time.monotonic() - self.down_since)
            if self.on_change:
                self.on_change(True)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        waited_for_room = False  # "has room again" only from a write that was refused (reads pass on a full Redis)
        while True:
            try:
                async with asyncio.timeout(COMMAND_TIMEOUT_S):  # a TimeoutError is an OSError: LOST
                    result = await super().execute_command(*args, **options)
            except REFUSED as e:
                self.refused(e)
            except LOST as e:
                await self.lost(e)
                continue
            except OutOfMemoryError as e:
                waited_for_room = True
                await self.no_room(e)
                continue
            self.back()
            if waited_for_room:
                self.roomy()
            return result

    async def zrangebyscore(self, name: Any, *args: Any, **kwargs: Any) -> Any:
        """As Redis's, less the jobs this worker is running now. arq's poll reads the queue's first ids every
        `poll_delay` and, for each, runs a WATCH / EXISTS / ZSCORE transaction to find out it is already in progress;
        a job stays in the queue until it ends, so with jobs waiting on the model that was three round trips per
        running job per poll: event-loop Python under the GIL the thread that drives the GPU needs
        (bench/worker_overhead.py --engine-ms). Ids arq would skip anyway are dropped here."""
        ids = await super().zrangebyscore(name, *args, **kwargs)
        odd = {j for j in ids if isinstance(j, bytes) and not _utf8(j)}
        if odd:  # arq decodes every id outside any job: an id written by hand that is not UTF-8 would end the worker
            log.warning("removed %d queue entries whose ids are not UTF-8 (not arq job ids)", len(odd))
            await self.zrem(name, *odd)
            ids = [j for j in ids if j not in odd]
        running = self.running_here() if self.running_here is not None else None
        if not running or kwargs.get("withscores") or (len(args) > 4 and args[4]):
            return ids
        return [j for j in ids if (j.decode() if isinstance(j, bytes) else str(j)) not in running]

    async def close(self, close_connection_pool: bool | None = None) -> None:  # arq calls the deprecated name
        await self.aclose(close_connection_pool)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> "ResilientPipeline":
        return ResilientPipeline(self, self.connection_pool, self.response_callbacks, transaction, shard_hint)


class ResilientPipeline(Pipeline):
    def __init__(self, owner: ResilientRedis, *args: Any):
        super().__init__(*args)
        self._owner = owner
        self._watched: list = []

    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        """WATCH and the reads after it, before MULTI: on a lost connection, wait, re-WATCH, read again. A job's
        queue score below 1 (ZADD by hand) reads as 1 ms, the oldest: arq makes an int of -inf outside any job, and
        skips a job whose score is 0 (falsy) for ever."""
        while True:
            try:
                async with asyncio.timeout(COMMAND_TIMEOUT_S):
                    result = await super().immediate_execute_command(*args, **options)
                if args and str(args[0]).upper() == "ZSCORE" and isinstance(result, float) and result < 1:
                    result = 1.0
            except REFUSED as e:
                self._owner.refused(e)
            except LOST + (WatchError,) as e:  # redis-py reports a connection lost while watching as WatchError
                await self._owner.lost(e)
                await self._rewatch()
                continue
            self._owner.back()
            if args and str(args[0]).upper() == "WATCH":
                self._watched += list(args[1:])
            return result

    async def _rewatch(self) -> None:
        if self.connection is not None:
            await self.connection.disconnect()
        self.watching = False
        if self._watched:
            keys, self._watched = self._watched, []
            await self.immediate_execute_command("WATCH", *keys)

    async def execute(self, raise_on_error: bool = True) -> Any:
        stack = list(self.command_stack)
        watched = bool(self._watched) or self.explicit_transaction
        waited_for_room = False
        while True:
            try:
                async with asyncio.timeout(COMMAND_TIMEOUT_S):
                    result = await super().execute(raise_on_error)
            except REFUSED as e:
                self._owner.refused(e)
            except LOST as e:
                await self._owner.lost(e)
                if watched:  # the WATCH died with the connection: arq treats this as "taken elsewhere"
                    self._watched = []
                    raise WatchError("connection lost during a watched transaction") from e
                self.command_stack = list(stack)
                continue
            except OutOfMemoryError as e:  # the transaction was refused whole (EXECABORT): nothing of it ran
                waited_for_room = True
                await self._owner.no_room(e)
                if watched:
                    self._watched = []
                    raise WatchError("Redis refused a watched transaction for want of memory") from None
                self.command_stack = list(stack)
                continue
            except WatchError:
                self._watched = []
                raise
            self._owner.back()
            if waited_for_room:
                self._owner.roomy()
            self._watched = []
            return result
