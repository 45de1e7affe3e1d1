"""The library agent services use to ask statecache questions through Redis.

    async with await Client.connect("redis://localhost:6379/0") as client:
        result = await client.answer_text(state, [{"text": "Next?", "options": ["click", "type"]}])
        result["probs"]  # one list per question, summing to 1; result["path"]: memo|hit|partial|cold|plain

`answer(row)` takes a token row or a text row (statecache.protocol) and returns the worker's result, or
raises one of its own errors, all `ClientError`s:
  `RowRejected`      the worker refused the row (`.code`, `.message`; codes in statecache.protocol.ERROR_CODES)
  `AnswerTimeout`    no answer in `timeout_s`; the job expires with it, so a late worker does not run it. The
                     default outlives a run again after a killed worker (statecache.protocol.job_lifetime_s of
                     the STATECACHE_JOB_TIMEOUT_S setting: 250 s for the default 120 s), so at-least-once holds
  `QueueUnavailable` (an AnswerTimeout) Redis did not answer for the whole of `timeout_s`
  `QueueRefused`     Redis refused the URL's credentials or permissions (raised at once: not an outage)
  `QueueError`       Redis answered with another error, named with what to change: `QueueFull` when it is at its
                     maxmemory and evicts nothing; a read-only replica; MISCONF (cannot persist); a key of another
                     type. Errors that pass (those three) are waited out with backoff within `timeout_s` first;
                     no message carries a row's bytes (redis-py quotes a failed command's arguments) or credentials
  `WorkerError`      the job failed in the worker outside any row
Through a Redis outage (a restart, a failover) the client keeps trying with backoff until its timeout: a job
enqueued before the outage is still answered once Redis is back (with append-only persistence). A result
arrives as soon as the worker publishes the job id on the queue's done channel; a missed message costs at most
one `RESULT_POLL_S` poll. Each job enqueued is announced on the queue's enqueued channel, which wakes the workers'
routers at once (a bare `enqueue_job` waits for their next poll, `STATECACHE_POLL_DELAY_S`). Each result is read
once (a plain GET, which a Redis at its maxmemory still answers), then deleted.

The URL is read as the worker reads REDIS_URL (statecache.redis_url: every form redis-py accepts, `?password=`,
rediss://, unix://); one redis-py does not accept raises statecache.redis_url.BadRedisURL (a ValueError).

Knows the queue protocol (statecache.protocol); does not know the model or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Iterable

from arq.connections import ArqRedis
from arq.jobs import deserialize_result
from redis.exceptions import BusyLoadingError, ConnectionError, OutOfMemoryError, ReadOnlyError, ResponseError, TimeoutError
from redis.exceptions import WatchError

from statecache.protocol import JOB_ANSWER, JOB_PROFILE, JOB_STATS, RESULT_KEY_PREFIX, RemoteJobError, deserialize, done_channel
from statecache.protocol import REFUSED, enqueued_channel, follow_channel, job_lifetime_s, redact, serialize
from statecache.redis_url import connection_pool
from statecache.settings import Settings

log = logging.getLogger("statecache.producer")

RESULT_POLL_S = 0.1  # fallback poll for a result when its done message was missed
ANNOUNCE_TIMEOUT_S = 1.0  # a job's announcement (the enqueued channel) is given up after this: the routers poll
RETRY_MAX_S = 1.0  # backoff cap while Redis does not answer (or answers with a passing error: QueueError)
CONNECT_TIMEOUT_S = 1.0  # a connection attempt (unless the URL's socket_connect_timeout says otherwise)
LOST = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


class ClientError(Exception):
    """Base of the errors `Client` raises."""


class RowRejected(ClientError, ValueError):
    """The worker refused the row: `code` (e.g. "id_out_of_range") and `message` say why."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class AnswerTimeout(ClientError, TimeoutError):
    """No answer within the timeout (no worker running, or the queue is too long)."""


class QueueUnavailable(AnswerTimeout):
    """Redis did not answer within the timeout (down, restarting, unreachable)."""


class QueueRefused(ClientError, PermissionError):
    """Redis refused the credentials or permissions of the Client's URL (wrong password or user, NOPERM)."""


def _refused(error: BaseException, where: str) -> QueueRefused:
    return QueueRefused(f"Redis refused the credentials or permissions of {redact(where)} "
                        f"({type(error).__name__}: {_server_text(error)}): check the URL's user and password (REDIS_URL)")


class QueueError(ClientError, RuntimeError):
    """Redis answered with an error that is neither a lost connection nor refused credentials: out of memory
    (`QueueFull`), a read-only replica, unable to persist, a key of the wrong type. The message says what Redis
    said and what to change; it never carries a row's bytes or the URL's credentials."""


class QueueFull(QueueError):
    """Redis is at its maxmemory and evicts nothing (maxmemory-policy noeviction): no room for the job."""


def _server_text(error: BaseException) -> str:
    """Redis's own words for a command's error, without the arguments redis-py adds (a pipeline's error names the
    command with its arguments: a job's PSETEX carries the row's msgpack bytes), redacted, at most 200 characters."""
    text = str(error.args[0]) if error.args else ""
    if " of pipeline caused error: " in text:  # redis-py: "Command # N (CMD ARGS...) of pipeline caused error: (...)"
        text = text.rsplit(" of pipeline caused error: ", 1)[1].strip().strip("(),").strip("'\"")
    text = text.split(", with args beginning with", 1)[0]  # an unknown command's error quotes its arguments
    return redact(text)[:200]


# Redis errors that pass (memory is freed as results are read and jobs end; a failover promotes a replica; a disk is
# fixed): the Client waits them out with backoff within the answer's timeout, then raises the QueueError
_PASSING_CODES = ("MISCONF", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN")


def _passes(error: ResponseError) -> bool:
    return isinstance(error, (OutOfMemoryError, ReadOnlyError)) or _server_text(error).startswith(_PASSING_CODES)


def _queue_error(error: ResponseError, doing: str, queue: str) -> QueueError:
    """The QueueError for Redis's `error` while the Client did `doing` on `queue`: what Redis said and what to change."""
    said = f"{type(error).__name__}: {_server_text(error)}"
    if isinstance(error, OutOfMemoryError):
        return QueueFull(f"Redis is out of memory and refused to {doing} (queue {queue}; {said}): its used memory is over "
                         "its maxmemory and its maxmemory-policy evicts nothing. Raise maxmemory (CONFIG SET maxmemory, "
                         "redis.conf) or free memory on that Redis; keep noeviction (an evicting policy would drop queued "
                         "jobs)")
    if isinstance(error, ReadOnlyError):
        return QueueError(f"Redis refused to {doing} (queue {queue}; {said}): the URL names a read-only replica; point "
                          "REDIS_URL at the master (after a failover, the new one)")
    if _server_text(error).startswith("MISCONF"):
        return QueueError(f"Redis refused to {doing} (queue {queue}; {said}): it refuses writes while it cannot persist "
                          "to disk; its log says why (disk full, permissions)")
    return QueueError(f"Redis refused to {doing} (queue {queue}; {said}): check that Redis and that nothing else writes "
                      f"the queue's keys ({queue}, arq:job:*, arq:result:*) with other types")


class WorkerError(ClientError, RuntimeError):
    """The job failed in the worker outside any row (could not be decoded, expired, retried too often)."""


def text_row(state: str, questions: Iterable[Any]) -> dict:
    """A text row from a state and questions given as {text, options} maps or (text, options) pairs."""
    qs = []
    for q in questions:
        if isinstance(q, dict):
            qs.append(q)
        else:
            text, options = q
            qs.append({"text": text, "options": list(options)})
    return {"state": state, "questions": qs}


class Client:
    def __init__(self, pool: ArqRedis, queue_name: str | None = None, timeout_s: float | None = None):
        self.pool = pool
        self.queue_name = queue_name or Settings().queue
        # the default: the job outlives a run again after a killed worker (at-least-once, statecache.protocol)
        if timeout_s is None:
            timeout_s = job_lifetime_s(Settings.from_env(warn_unknown=False).job_timeout_s)
        self.timeout_s = timeout_s
        self._waiters: dict[str, asyncio.Event] = {}
        self._listener: asyncio.Task | None = None
        self._subscribed = asyncio.Event()

    @classmethod
    async def connect(
        cls, redis_url: str | None = None, queue_name: str | None = None, timeout_s: float | None = None
    ) -> "Client":
        """Connect to the queue at `redis_url` named `queue_name` (defaults: the REDIS_URL and STATECACHE_QUEUE
        settings, statecache.settings). `timeout_s` (default: long enough for a job to run again after a killed
        worker, from the STATECACHE_JOB_TIMEOUT_S setting) is each answer's; raises QueueUnavailable when Redis
        does not answer within it."""
        if redis_url is None or queue_name is None or timeout_s is None:
            env = Settings.from_env(warn_unknown=False)
            redis_url, queue_name = redis_url or env.redis_url, queue_name or env.queue
            timeout_s = job_lifetime_s(env.job_timeout_s) if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        # the URL read as the worker reads it (statecache.redis_url: every form redis-py accepts)
        pool = ArqRedis(connection_pool(redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S), job_serializer=serialize,
                        job_deserializer=deserialize, default_queue_name=queue_name)
        try:
            await _ping(pool, deadline, timeout_s, redis_url, queue_name)
        except BaseException:
            await pool.aclose(close_connection_pool=True)
            raise
        client = cls(pool, queue_name, timeout_s)
        client._listener = asyncio.create_task(client._listen())
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop a cancellation
            async with asyncio.timeout(5):
                await client._subscribed.wait()
        except asyncio.TimeoutError:
            log.warning("no subscription to the done channel yet; results will be polled")
        return client

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        await self.pool.aclose(close_connection_pool=True)

    # --- asking ------------------------------------------------------------------------------------------

    async def answer(self, row: dict, timeout_s: float | None = None) -> dict:
        """The worker's result for one row; raises RowRejected, AnswerTimeout or WorkerError."""
        result = await self._run(JOB_ANSWER, (row,), timeout_s)
        if isinstance(result, dict) and "error" in result:
            err = result["error"]
            raise RowRejected(str(err.get("code")), str(err.get("message")))
        return result

    async def answer_text(self, state: str, questions: Iterable[Any], timeout_s: float | None = None) -> dict:
        return await self.answer(text_row(state, questions), timeout_s)

    async def stats(self, timeout_s: float = 10.0) -> dict:
        """The engine's cache counters and the worker's batch counters (from one worker)."""
        return await self._run(JOB_STATS, (), timeout_s)

    async def profile(self, seconds: float = 5.0, rows: int = 40, timeout_s: float | None = None) -> dict:
        """torch.profiler over one worker's engine thread for `seconds` while it serves (slower meanwhile): text
        tables of the top `rows` ops by host and by device time, and the engine's phases over that stretch."""
        got = await self._run(JOB_PROFILE, (seconds, rows), timeout_s if timeout_s is not None else seconds + 60)
        if isinstance(got, dict) and "error" in got:
            raise RowRejected(got["error"].get("code", "bad_job"), got["error"].get("message", ""))
        return got

    async def _run(self, function: str, args: tuple, timeout_s: float | None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        job_id = uuid.uuid4().hex
        done = self._waiters[job_id] = asyncio.Event()
        try:
            failures = 0
            while True:
                problem: ClientError | None = None
                try:
                    job = await self.pool.enqueue_job(
                        function, *args, _job_id=job_id, _queue_name=self.queue_name, _expires=timeout_s
                    )
                except REFUSED as e:
                    problem, passes = _refused(e, f"queue {self.queue_name}"), False
                except LOST + (WatchError,) as e:
                    failures += 1
                    await _backoff(e, failures, deadline, timeout_s, self.queue_name)
                    continue
                # the errors that pass (OOM, READONLY, MISCONF) refuse the transaction whole: nothing of the job was stored,
                # so sending it again is safe; one at EXEC (WRONGTYPE on the queue's key) is raised at once
                except ResponseError as e:
                    problem, passes = _queue_error(e, "store the job", self.queue_name), _passes(e)
                if problem is not None:  # outside the except block: the Redis error (with the row's bytes) is not kept
                    if not passes:
                        raise problem
                    failures += 1
                    await _wait_out(problem, failures, deadline)
                    continue
                if job is None and not failures:
                    raise WorkerError(f"job id {job_id} already exists")
                break  # (None after a lost connection: our own enqueue had gone through)
            await self._announce()
            info = await self._wait(job_id, done, deadline, timeout_s)
        finally:
            del self._waiters[job_id]
        if info.success:
            return info.result
        if isinstance(info.result, RemoteJobError):
            raise WorkerError(f"job {job_id} failed in the worker: {info.result}")
        raise WorkerError(f"job {job_id} failed in the worker: {info.result!r}")

    async def _wait(self, job_id: str, done: asyncio.Event, deadline: float, timeout_s: float):
        key = RESULT_KEY_PREFIX + job_id
        failures, passing = 0, None  # passing: the QueueError of a Redis error that passes (_passes), while it lasts
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and passing is not None:
                raise passing
            if remaining <= 0 and failures:
                raise QueueUnavailable(f"Redis did not answer within {timeout_s:g} s (queue {self.queue_name})")
            if remaining <= 0:
                raise AnswerTimeout(f"no answer within {timeout_s:g} s (queue {self.queue_name}): is a worker running?")
            try:
                async with asyncio.timeout(min(remaining, RESULT_POLL_S)):
                    await done.wait()
            except asyncio.TimeoutError:
                pass
            done.clear()
            problem: ClientError | None = None
            try:
                # a plain GET, no MULTI: Redis at its maxmemory refuses every command queued in a transaction, but a
                # GET it answers, so a result already stored is read whatever the memory
                raw = await self.pool.get(key)
            except REFUSED as e:
                problem, passes = _refused(e, f"queue {self.queue_name}"), False
            except LOST as e:
                failures, passing = failures + 1, None
                await _backoff(e, failures, deadline, timeout_s, self.queue_name)
                continue
            except ResponseError as e:
                problem, passes = _queue_error(e, "read the result", self.queue_name), _passes(e)
            if problem is not None:  # raised outside the except block: the Redis error is not its context
                if not passes:
                    raise problem
                failures, passing = failures + 1, problem
                await _wait_out(problem, failures, deadline)
                continue
            failures, passing = 0, None
            if raw:
                await self._forget(key)
                return deserialize_result(raw, deserializer=deserialize)

    async def _forget(self, key: str) -> None:
        """Delete a result once read (separately from the read: a connection lost here loses no result). Best
        effort: a result left behind expires with the worker's keep_result (worker.settings.KEEP_RESULT_S)."""
        try:
            await self.pool.delete(key)
        except (ResponseError,) + LOST as e:
            log.debug("a result read was not deleted (%s); it expires on its own", type(e).__name__)

    async def _announce(self) -> None:
        """Tell the workers' routers a job is in the queue (the enqueued channel): they take it now instead of at
        their next poll. Best effort: a note lost costs that poll's wait, nothing more."""
        try:
            async with asyncio.timeout(ANNOUNCE_TIMEOUT_S):
                await self.pool.publish(enqueued_channel(self.queue_name), "")
        except Exception:  # noqa: BLE001 - the routers poll the queue anyway
            pass

    async def _listen(self) -> None:
        """Wake the waiter of every job id published on the done channel; reconnect on errors."""

        def on_state(error: Exception | None) -> None:
            if error is None:
                self._subscribed.set()
            else:
                log.warning("done channel lost (%s); polling until it is back", redact(error))

        def on_message(data: Any) -> None:
            waiter = self._waiters.get(data.decode() if isinstance(data, bytes) else str(data))
            if waiter is not None:
                waiter.set()

        await follow_channel(self.pool, done_channel(self.queue_name), on_message, on_state)


async def _ping(pool: ArqRedis, deadline: float, timeout_s: float, redis_url: str, queue_name: str) -> None:
    """PING until Redis answers (backoff through an outage, QueueUnavailable past the deadline); QueueRefused or
    QueueError at once when it answers with an error."""
    failures = 0
    while True:
        problem: ClientError | None = None
        try:
            await pool.ping()
            return
        except REFUSED as e:
            problem = _refused(e, redis_url)
        except ResponseError as e:
            problem = _queue_error(e, "answer PING", queue_name)
        except LOST as e:
            failures += 1
            await _backoff(e, failures, deadline, timeout_s, redact(redis_url))
        if problem is not None:  # raised outside the except block: the Redis error is not its context
            raise problem


async def _wait_out(problem: QueueError, failures: int, deadline: float) -> None:
    """Sleep the next backoff step while Redis answers with an error that passes (`_passes`); `problem` once past the
    deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise problem
    if failures == 1:
        log.warning("%s; retrying for up to %.0f s", problem, remaining)
    await asyncio.sleep(min(remaining, RETRY_MAX_S, 0.05 * 2 ** min(failures, 10)))


async def _backoff(error: BaseException, failures: int, deadline: float, timeout_s: float, where: str) -> None:
    """Sleep the next backoff step while Redis does not answer; QueueUnavailable once past the deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise QueueUnavailable(f"Redis did not answer within {timeout_s:g} s ({redact(where)}): "
                               f"{type(error).__name__}: {redact(error)}") from error
    if failures == 1:
        log.warning("Redis does not answer (%s); retrying for up to %.0f s", redact(error), remaining)
    await asyncio.sleep(min(remaining, RETRY_MAX_S, 0.05 * 2 ** min(failures, 10)))
