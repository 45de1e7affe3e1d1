"""The wire protocol between agent services and the worker: job names, the msgpack serialiser pair, the row and
result schema, error codes and the Redis key names. `producer` and `worker` both import it; it imports neither.

An agent service needs only arq and this module (re-exported by `producer`; `arq_settings` reads a Redis URL as the
worker does: statecache.redis_url):

    pool = await create_pool(arq_settings(REDIS_URL), job_serializer=serialize, job_deserializer=deserialize)
    job = await pool.enqueue_job("answer", row)
    result = await job.result()

Jobs. `answer(row)`: one row in, one result out. `stats()`: the engine's and the worker's counters. Both sit on
arq's default queue (`QUEUE_NAME`) unless the worker's settings name another.

Rows (checked by statecache.rows.check / statecache.rows.text; see docs/ARCHITECTURE.md):
  token row  {"ids": [int], "state_len": int, "slots": [int], "nopts": [int]}  (per slot: the first nopts letters)
         or  {"ids": [int], "state_len": int, "slots": [int], "options": [[int]]}  (per slot: its option token ids)
  text row   {"state": str, "questions": [{"text": str, "options": [str]}]}
Results: {"probs": [[float]] one list per slot/question, "path": one of PATHS, "reused": int, "computed": int},
or {"error": {"code": one of ERROR_CODES, "message": str}} for a row the worker refused or failed on.
A result carries no copy of its row: the worker strips arq's copy of the job's arguments before storing it.

Encoding: msgpack, never pickle. A pickled payload does not decode here (msgpack reads pickle's first byte as an
empty map, then finds extra data), so it is refused, never executed. The one extension type carries an
exception that arq stores as a failed job's result; it travels as its class name and message and comes back as
`RemoteJobError`. numpy/torch values in a result are sent as lists. The worker decodes a job with `decode_job`,
which first bounds what the payload may decode into (`MAX_JOB_VALUES` values, `MAX_JOB_DEPTH` nesting), read from
its headers before any object exists.

Knows arq's key layout and msgpack; knows nothing of the model, tensors or the worker's internals.
"""

from __future__ import annotations

import asyncio
import re
from functools import lru_cache
from typing import Any, Callable

import msgpack
from arq.constants import default_queue_name, health_check_key_suffix, in_progress_key_prefix, job_key_prefix
from arq.constants import result_key_prefix
from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, AuthorizationError
from redis.exceptions import NoPermissionError

# ---- jobs and Redis keys ----------------------------------------------------------------------------------------
QUEUE_NAME = default_queue_name  # arq's default queue ("arq:queue"): what a bare enqueue_job uses
JOB_ANSWER = "answer"
JOB_STATS = "stats"
JOB_PROFILE = "profile"  # torch.profiler over the worker's engine thread for a few seconds, while rows flow
JOB_UNDECODABLE = "statecache:undecodable"  # what the worker runs in place of a job it could not decode
HEALTH_KEY_SUFFIX = health_check_key_suffix  # arq's: QUEUE + this lives while a ready worker serves QUEUE
DONE_CHANNEL_SUFFIX = ":done"  # pub/sub channel QUEUE + this: job ids published once their result is stored
ENQUEUED_CHANNEL_SUFFIX = ":enqueued"  # pub/sub channel QUEUE + this: producer.Client's note that it enqueued a job
# (wakes the workers' routers at once; they poll QUEUE besides, for jobs enqueued without a note)
JOB_KEY_PREFIX = job_key_prefix
RESULT_KEY_PREFIX = result_key_prefix
IN_PROGRESS_KEY_PREFIX = in_progress_key_prefix

# several workers on one queue (worker.routing): each worker's arq serves a queue of its own; every worker's
# dispatcher moves ids from QUEUE (where agents enqueue) to the chosen worker's queue
ROUTE_PREFIX = "statecache:route:"  # + QUEUE + ":workers" (set of worker ids), ":live:<id>" (heartbeat, with a TTL),
# ":draining:<id>" (heartbeat of a worker told to stop, finishing what it runs: takes nothing new), ":fp:<id>" (hash:
# fingerprint -> last used, the states the worker holds; statecache.cache.routing)
PRIVATE_QUEUE_INFIX = ":w:"  # QUEUE + this + worker id: the worker's own arq queue

PATHS = ("memo", "hit", "partial", "cold", "plain")

# ---- error codes (result["error"]["code"]) ----------------------------------------------------------------------
ERROR_CODES = {
    # the row (statecache.rows.check, statecache.rows.text)
    "bad_row": "not a row: not a map, missing or unknown fields, text row without a tokenizer",
    "bad_type": "a field has the wrong type",
    "empty": "no ids, no slots or no questions",
    "too_long": "more tokens (or questions) than the worker's limit",
    "id_out_of_range": "a token id outside the model's vocabulary",
    "state_len_out_of_range": "state_len outside [0, len(ids)]",
    "slot_out_of_range": "an answer slot outside the row",
    "length_mismatch": "slots and nopts (or options) differ in length",
    "bad_nopts": "a question or slot with too few or too many options",
    "option_out_of_range": "an option token id outside the model's vocabulary",
    "duplicate_options": "a slot's options name one token id twice",
    "options_mismatch": "a row with both nopts and options whose counts disagree",
    # images (statecache.rows.check, statecache.rows.images, statecache.rows.text)
    "no_vision": "the row has images but the model has no vision tower (or no image processor)",
    "image_count_mismatch": "the placeholders in the text and the images differ in number",
    "image_tokens_mismatch": "the image-pad runs in the ids do not match the images",
    "too_many_images": "more images than the limit",
    "bad_image": "an image that is not PNG, JPEG or WebP bytes, or does not decode",
    "image_too_large": "an image over the byte or pixel limit",
    # the job
    "bad_job": "the answer job was not called with exactly one row",
    "job_too_large": "the job's payload is larger than the worker's STATECACHE_MAX_JOB_BYTES, or would decode into more "
                     "than MAX_JOB_VALUES values or nest deeper than MAX_JOB_DEPTH; it was not decoded",
    # the worker
    "internal": "the engine failed on this row; the worker log has the traceback",
    # the producer CLI
    "bad_json": "an input line that is not JSON",
    "timeout": "no answer within the producer's timeout",
    "job_failed": "the job failed in the worker outside any row",
    "queue_error": "Redis answered the producer with an error (out of memory at its maxmemory, read-only, ...)",
}

UNDECODABLE_HINT = (
    "enqueue jobs with the msgpack serialiser pair: create_pool(..., job_serializer=statecache.protocol.serialize, "
    "job_deserializer=statecache.protocol.deserialize) (also exported by `producer`); arq's default, pickle, is refused"
)

EXC_EXT = 1  # msgpack extension code of an exception: msgpack [class name, message]


class RemoteJobError(RuntimeError):
    """A job failed in the worker outside any row (could not be decoded, expired, retried too often)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


# ---- what a job may decode into ---------------------------------------------------------------------------------
MAX_JOB_VALUES = 2**18  # values a job may decode into: every array item, map key and map value (a 32k-token row: ~98k)
MAX_JOB_DEPTH = 16  # arrays and maps nested deeper are refused (a text row's options sit 6 deep in its job)


class JobTooComplex(ValueError):
    """A payload that would decode into more values, or deeper nesting, than a job may have (`check_job_shape`)."""


# one value that needs no step of its own: a fixed-size scalar (int, float, nil, bool) or an empty array or map; the
# first byte decides which, so the alternatives never overlap
_SCALAR = rb"(?>[\x00-\x7f\x80\x90\xc0\xc2\xc3\xe0-\xff]|[\xcc\xd0].|[\xcd\xd1]..|[\xca\xce\xd2].{4}|[\xcb\xcf\xd3].{8})"
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5,
          0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # type byte -> the value's whole size in bytes
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # bin, str
          0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}  # ext: (bytes of the length, bytes between it and the data)
_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # array16/32, map16/32: (length bytes, values/item)


@lru_cache(maxsize=40)
def _scalars(count: int) -> "re.Pattern[bytes]":
    return re.compile(_SCALAR + b"{%d}" % count, re.DOTALL)


def _skip_scalars(data: bytes, pos: int, count: int) -> tuple[int, int]:
    """Step over the longest run of fixed-size scalars (at most `count`) at `pos`: (new pos, items stepped over). One
    match per power of two, largest first: a run of 4,000 ids takes about a dozen C-speed matches."""
    done, bit = 0, 1 << (count.bit_length() - 1)
    while bit:
        if bit <= count - done:
            m = _scalars(bit).match(data, pos)
            if m is not None:
                pos, done = m.end(), done + bit
                continue
        bit >>= 1
    return pos, done


def check_job_shape(data: bytes, max_values: int = MAX_JOB_VALUES, max_depth: int = MAX_JOB_DEPTH) -> None:
    """Raise JobTooComplex when the msgpack `data` would decode into more than `max_values` values or nest arrays and
    maps deeper than `max_depth`. Reads type bytes and container headers only, before any object exists: a header's
    length counts when the header is read, so an array announcing 15 M items is refused on its first 5 bytes. An
    array's leading run of fixed-size scalars (a row's ids) is stepped over by a few regular-expression matches
    (`_skip_scalars`); every other value takes a Python step, so a refused payload costs at most `max_values` of
    them (tens of ms). Malformed or truncated msgpack is left to the decoder, which raises."""
    end = len(data)
    pos, values = 0, 0
    stack: list[int] = []  # items still to read in each open container, innermost last
    left = 1  # items still to read at this level (the top level holds one object)
    while True:
        if left == 0:
            if not stack:
                return
            left = stack.pop()
            continue
        if pos >= end:
            return  # truncated: the decoder says so
        b = data[pos]
        left -= 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            pos += 1
            continue
        if b <= 0x9F:  # fixmap, fixarray
            n, per, pos = b & 0x0F, (2 if b <= 0x8F else 1), pos + 1
        elif b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
            continue
        elif b in _FIXED:
            pos += _FIXED[b]
            continue
        elif b in _SIZED:
            width, gap = _SIZED[b]
            pos += 1 + width + gap + int.from_bytes(data[pos + 1:pos + 1 + width], "big")
            continue
        elif b in _CONTAINER:
            width, per = _CONTAINER[b]
            n, pos = int.from_bytes(data[pos + 1:pos + 1 + width], "big"), pos + 1 + width
        else:  # 0xc1 (never used): the decoder refuses it
            return
        values += n * per
        if values > max_values:
            raise JobTooComplex(f"the job would decode into more than {max_values} values (array items, map keys and "
                                "values); it was not decoded")
        if len(stack) >= max_depth:
            raise JobTooComplex(f"the job nests arrays and maps more than {max_depth} deep; it was not decoded")
        stack.append(left)
        left = n * per
        if per == 1 and left > 1 and len(stack) < max_depth:  # an array: its leading scalars at C speed
            pos, done = _skip_scalars(data, pos, left)
            left -= done


def _default(obj: Any) -> Any:
    if isinstance(obj, BaseException):
        kind = obj.kind if isinstance(obj, RemoteJobError) else type(obj).__name__
        message = obj.message if isinstance(obj, RemoteJobError) else str(obj)
        return msgpack.ExtType(EXC_EXT, msgpack.packb([kind, message], use_bin_type=True))
    if hasattr(obj, "tolist"):  # numpy / torch values in a result
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__} as msgpack")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXC_EXT:
        check_job_shape(data, max_values=2, max_depth=1)  # [class name, message], nothing bigger
        kind, message = msgpack.unpackb(data, raw=False)
        return RemoteJobError(str(kind), str(message))
    raise ValueError(f"unknown msgpack extension type {code}")


def serialize(obj: Any) -> bytes:
    """arq's `job_serializer`: msgpack."""
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def deserialize(data: bytes) -> Any:
    """arq's `job_deserializer`: msgpack; raises on anything else (pickle included)."""
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook)


def decode_job(data: bytes, max_values: int = MAX_JOB_VALUES, max_depth: int = MAX_JOB_DEPTH) -> Any:
    """`deserialize` for a job the worker took from Redis: refused (JobTooComplex) before anything is decoded when it
    would decode into more than `max_values` values or nest deeper than `max_depth` (`check_job_shape`). Then it
    costs at most about 100 bytes a value plus its strings' bytes: ~30 MB at the defaults."""
    check_job_shape(data, max_values, max_depth)
    return deserialize(data)


def looks_pickled(data: bytes) -> bool:
    """Pickle protocol 2+ starts with the PROTO opcode 0x80."""
    return bool(data) and data[:1] == b"\x80"


# ---- delivery ---------------------------------------------------------------------------------------------------
JOB_TIMEOUT_S = 120.0  # a job's limit by default (the worker's STATECACHE_JOB_TIMEOUT_S, statecache.settings)
IN_PROGRESS_EXTRA_S = 10.0  # arq marks a taken job in progress for its timeout + this; a killed worker's jobs run
# again once the mark expires (arq.worker.Worker.in_progress_timeout_s; tests/test_worker_redis.py checks they agree)
RETRY_KEY_PREFIX = "arq:retry:"  # + job id: arq's count of a job's tries (incremented when a worker takes it)
# Redis refusing a URL's credentials or permissions (wrong password or user, NOAUTH, WRONGPASS, NOPERM): no outage,
# never retried by the worker (worker/resilient.py) or the Client; redis-py makes the first ones ConnectionErrors
REFUSED = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)


def job_lifetime_s(job_timeout_s: float) -> float:
    """How long a producer's job must live, and its producer wait, for at-least-once delivery through one killed
    worker: from when a worker takes it, up to a job timeout until the kill, the in-progress mark's
    `IN_PROGRESS_EXTRA_S` more, then a job timeout for the run again (`producer.Client`'s default answer timeout
    and job expiry; a bare `enqueue_job` keeps arq's day)."""
    return 2 * job_timeout_s + IN_PROGRESS_EXTRA_S


_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/\s]*)@")
_SECRET_QUERY = re.compile(r"(?P<key>[?&](?:password|pass|pwd|secret|token)=)[^&#\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` (a URL, or a message that may hold URLs) with the credentials of every URL replaced by `***`: a
    password (`redis://user:***@host`, `redis://:***@host`), a lone user-info part (redis-py reads `redis://pw@host`
    as a name, and people put passwords there) and `password=` query parameters. Every message, log line or
    exception that shows a Redis URL shows it through this."""

    def userinfo(m: re.Match) -> str:
        user, colon, _ = m["userinfo"].partition(":")
        return m["scheme"] + (f"{user}:***" if colon else "***") + "@"

    return _SECRET_QUERY.sub(lambda m: m["key"] + "***", _USERINFO.sub(userinfo, str(text)))


def error_result(code: str, message: str) -> dict:
    return {"error": {"code": str(code), "message": str(message)}}


def health_key(queue: str) -> str:
    return queue + HEALTH_KEY_SUFFIX


def done_channel(queue: str) -> str:
    return queue + DONE_CHANNEL_SUFFIX


def enqueued_channel(queue: str) -> str:
    return queue + ENQUEUED_CHANNEL_SUFFIX


async def follow_channel(redis: Any, channel: str, on_message: Callable[[Any], None],
                         on_state: Callable[[Exception | None], None], retry_s: float = 0.5) -> None:
    """Follow a pub/sub channel until cancelled: on_message(data) for each message; on_state(None) each time the
    subscription holds, on_state(error) when it is lost (once until it holds again; it subscribes again every
    retry_s meanwhile)."""
    lost = False
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    lost = False
                    on_state(None)
                elif message["type"] == "message":
                    on_message(message["data"])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a lost connection: subscribe again
            if not lost:
                lost = True
                on_state(e)
            await asyncio.sleep(retry_s)
        finally:
            try:
                await pubsub.aclose()
            except Exception:  # noqa: BLE001 - the connection is gone already
                pass


def private_queue(queue: str, worker_id: str) -> str:
    return queue + PRIVATE_QUEUE_INFIX + worker_id


def workers_key(queue: str) -> str:
    return ROUTE_PREFIX + queue + ":workers"


def live_key(queue: str, worker_id: str) -> str:
    return ROUTE_PREFIX + queue + ":live:" + worker_id


def draining_key(queue: str, worker_id: str) -> str:
    return ROUTE_PREFIX + queue + ":draining:" + worker_id


def private_queue_pattern(queue: str) -> str:
    """A SCAN MATCH pattern for every worker's private queue on `queue` (glob characters in the name escaped)."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", queue + PRIVATE_QUEUE_INFIX) + "*"


def fingerprints_key(queue: str, worker_id: str) -> str:
    return ROUTE_PREFIX + queue + ":fp:" + worker_id
