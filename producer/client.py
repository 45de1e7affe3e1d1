"""The library agent services use to ask statecache questions through Redis.

    async with await Client.connect("redis://localhost:6379/0") as client:
        result = await client.answer_text(state, [{"text": "Next?", "options": ["click", "type"]}])
        result["probs"]  # one list per question, summing to 1; result["path"]: memo|hit|partial|cold|plain

`answer(row)` takes a token row or a text row (DESIGN.md section 7) and returns the worker's result, or
raises: `RowRejected` (the worker refused the row: `.code`, `.message`), `AnswerTimeout` (no answer in
`timeout_s`; the job expires with it, so a late worker does not run it), `WorkerError` (the job failed
outside any row). A result arrives as soon as the worker publishes the job id on the queue's done channel;
a missed message costs at most one `RESULT_POLL_S` poll. Each result is read once and deleted.

Knows the queue protocol (arq jobs, msgpack, the done channel); does not know the model or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, Iterable

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.constants import result_key_prefix
from arq.jobs import deserialize_result

from producer.serial import RemoteJobError, deserialize, serialize
from worker import constants as C

log = logging.getLogger("statecache.producer")


class RowRejected(ValueError):
    """The worker refused the row: `code` (e.g. "id_out_of_range") and `message` say why."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class AnswerTimeout(TimeoutError):
    """No answer within the timeout (no worker running, or the queue is too long)."""


class WorkerError(RuntimeError):
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
    def __init__(self, pool: ArqRedis, queue_name: str = C.QUEUE_NAME, timeout_s: float = C.ANSWER_TIMEOUT_S):
        self.pool = pool
        self.queue_name = queue_name
        self.timeout_s = timeout_s
        self._waiters: dict[str, asyncio.Event] = {}
        self._listener: asyncio.Task | None = None
        self._subscribed = asyncio.Event()

    @classmethod
    async def connect(
        cls, redis_url: str | None = None, queue_name: str | None = None, timeout_s: float = C.ANSWER_TIMEOUT_S
    ) -> "Client":
        """Connect to the queue at `redis_url` (default: $REDIS_URL, else localhost) named `queue_name`
        (default: $STATECACHE_QUEUE, else statecache:queue)."""
        redis_url = redis_url or os.environ.get(C.ENV_REDIS_URL) or C.REDIS_URL
        queue_name = queue_name or os.environ.get(C.ENV_QUEUE) or C.QUEUE_NAME
        pool = await create_pool(
            RedisSettings.from_dsn(redis_url),
            job_serializer=serialize,
            job_deserializer=deserialize,
            default_queue_name=queue_name,
        )
        client = cls(pool, queue_name, timeout_s)
        client._listener = asyncio.create_task(client._listen())
        try:
            await asyncio.wait_for(client._subscribed.wait(), 5)
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
        result = await self._run(C.JOB_ANSWER, (row,), timeout_s)
        if isinstance(result, dict) and "error" in result:
            err = result["error"]
            raise RowRejected(str(err.get("code")), str(err.get("message")))
        return result

    async def answer_text(self, state: str, questions: Iterable[Any], timeout_s: float | None = None) -> dict:
        return await self.answer(text_row(state, questions), timeout_s)

    async def stats(self, timeout_s: float = 10.0) -> dict:
        """The engine's cache counters and the worker's batch counters (from one worker)."""
        return await self._run(C.JOB_STATS, (), timeout_s)

    async def _run(self, function: str, args: tuple, timeout_s: float | None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        job_id = uuid.uuid4().hex
        done = self._waiters[job_id] = asyncio.Event()
        try:
            job = await self.pool.enqueue_job(
                function, *args, _job_id=job_id, _queue_name=self.queue_name, _expires=timeout_s
            )
            if job is None:
                raise WorkerError(f"job id {job_id} already exists")
            info = await self._wait(job_id, done, deadline, timeout_s)
        finally:
            del self._waiters[job_id]
        if info.success:
            return info.result
        if isinstance(info.result, RemoteJobError):
            raise WorkerError(f"job {job_id} failed in the worker: {info.result}")
        raise WorkerError(f"job {job_id} failed in the worker: {info.result!r}")

    async def _wait(self, job_id: str, done: asyncio.Event, deadline: float, timeout_s: float):
        key = result_key_prefix + job_id
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AnswerTimeout(f"no answer within {timeout_s:g} s (queue {self.queue_name}): is a worker running?")
            try:
                await asyncio.wait_for(done.wait(), min(remaining, C.RESULT_POLL_S))
            except asyncio.TimeoutError:
                pass
            done.clear()
            async with self.pool.pipeline(transaction=True) as tr:
                tr.get(key)
                tr.delete(key)
                raw, _ = await tr.execute()
            if raw:
                return deserialize_result(raw, deserializer=deserialize)

    async def _listen(self) -> None:
        """Wake the waiter of every job id published on the done channel; reconnect on errors."""
        channel = self.queue_name + C.DONE_CHANNEL_SUFFIX
        while True:
            pubsub = self.pool.pubsub()
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    if message["type"] == "subscribe":
                        self._subscribed.set()
                    elif message["type"] == "message":
                        data = message["data"]
                        waiter = self._waiters.get(data.decode() if isinstance(data, bytes) else str(data))
                        if waiter is not None:
                            waiter.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("done channel lost (%s); polling until it is back", e)
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()
