"""The wire protocol between agent services and the worker: job names, the msgpack serialiser pair, the row and
result schema, error codes and the Redis key names. `producer` and `worker` both import it; it imports neither.

An agent service needs only arq and this module (re-exported by `producer`):

    pool = await create_pool(RedisSettings(), job_serializer=serialize, job_deserializer=deserialize)
    job = await pool.enqueue_job("answer", row)
    result = await job.result()

Jobs. `answer(row)`: one row in, one result out. `stats()`: the engine's and the worker's counters. Both sit on
arq's default queue (`QUEUE_NAME`) unless the worker's settings name another.

Rows (checked by statecache.rows / statecache.text; see docs/ARCHITECTURE.md):
  token row  {"ids": [int], "state_len": int, "slots": [int], "nopts": [int]}
  text row   {"state": str, "questions": [{"text": str, "options": [str]}]}
Results: {"probs": [[float]] one list per slot/question, "path": one of PATHS, "reused": int, "computed": int},
or {"error": {"code": one of ERROR_CODES, "message": str}} for a row the worker refused or failed on.
A result carries no copy of its row: the worker strips arq's copy of the job's arguments before storing it.

Encoding: msgpack, never pickle. A pickled payload does not decode here (msgpack reads pickle's first byte as an
empty map, then finds extra data), so it is refused, never executed. The one extension type carries an
exception that arq stores as a failed job's result; it travels as its class name and message and comes back as
`RemoteJobError`. numpy/torch values in a result are sent as lists.

Knows arq's key layout and msgpack; knows nothing of the model, tensors or the worker's internals.
"""

from __future__ import annotations

from typing import Any

import msgpack
from arq.constants import default_queue_name, health_check_key_suffix, in_progress_key_prefix, job_key_prefix
from arq.constants import result_key_prefix

# ---- jobs and Redis keys ----------------------------------------------------------------------------------------
QUEUE_NAME = default_queue_name  # arq's default queue ("arq:queue"): what a bare enqueue_job uses
JOB_ANSWER = "answer"
JOB_STATS = "stats"
JOB_PROFILE = "profile"  # torch.profiler over the worker's engine thread for a few seconds, while rows flow
JOB_UNDECODABLE = "statecache:undecodable"  # what the worker runs in place of a job it could not decode
HEALTH_KEY_SUFFIX = health_check_key_suffix  # arq's: QUEUE + this lives while a ready worker serves QUEUE
DONE_CHANNEL_SUFFIX = ":done"  # pub/sub channel QUEUE + this: job ids published once their result is stored
JOB_KEY_PREFIX = job_key_prefix
RESULT_KEY_PREFIX = result_key_prefix
IN_PROGRESS_KEY_PREFIX = in_progress_key_prefix

PATHS = ("memo", "hit", "partial", "cold", "plain")

# ---- error codes (result["error"]["code"]) ----------------------------------------------------------------------
ERROR_CODES = {
    # the row (statecache.rows, statecache.text)
    "bad_row": "not a row: not a map, missing or unknown fields, text row without a tokenizer",
    "bad_type": "a field has the wrong type",
    "empty": "no ids, no slots or no questions",
    "too_long": "more tokens (or questions) than the worker's limit",
    "id_out_of_range": "a token id outside the model's vocabulary",
    "state_len_out_of_range": "state_len outside [0, len(ids)]",
    "slot_out_of_range": "an answer slot outside the row",
    "length_mismatch": "slots and nopts differ in length",
    "bad_nopts": "a question with too few or too many options",
    # images (statecache.rows, statecache.images, statecache.text)
    "no_vision": "the row has images but the model has no vision tower (or no image processor)",
    "image_count_mismatch": "the placeholders in the text and the images differ in number",
    "image_tokens_mismatch": "the image-pad runs in the ids do not match the images",
    "too_many_images": "more images than the limit",
    "bad_image": "an image that is not PNG, JPEG or WebP bytes, or does not decode",
    "image_too_large": "an image over the byte or pixel limit",
    # the job
    "bad_job": "the answer job was not called with exactly one row",
    "job_too_large": "the job's payload is larger than the worker's STATECACHE_MAX_JOB_BYTES; it was not decoded",
    # the worker
    "internal": "the engine failed on this row; the worker log has the traceback",
    # the producer CLI
    "bad_json": "an input line that is not JSON",
    "timeout": "no answer within the producer's timeout",
    "job_failed": "the job failed in the worker outside any row",
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
        kind, message = msgpack.unpackb(data, raw=False)
        return RemoteJobError(str(kind), str(message))
    raise ValueError(f"unknown msgpack extension type {code}")


def serialize(obj: Any) -> bytes:
    """arq's `job_serializer`: msgpack."""
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def deserialize(data: bytes) -> Any:
    """arq's `job_deserializer`: msgpack; raises on anything else (pickle included)."""
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook)


def looks_pickled(data: bytes) -> bool:
    """Pickle protocol 2+ starts with the PROTO opcode 0x80."""
    return bool(data) and data[:1] == b"\x80"


def error_result(code: str, message: str) -> dict:
    return {"error": {"code": str(code), "message": str(message)}}


def health_key(queue: str) -> str:
    return queue + HEALTH_KEY_SUFFIX


def done_channel(queue: str) -> str:
    return queue + DONE_CHANNEL_SUFFIX
