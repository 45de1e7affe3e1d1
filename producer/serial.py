"""The job encoding both ways: msgpack, never pickle.

Pass `serialize` / `deserialize` to arq wherever it takes `job_serializer` / `job_deserializer`
(`create_pool(..., job_serializer=serialize, job_deserializer=deserialize)`) to enqueue `answer` jobs directly.

A pickled payload does not decode here (msgpack reads pickle's first byte as an empty map and then finds
extra data), so it is refused, never executed. The one extension type carries an exception that arq stores
as a failed job's result (a job that could not be decoded, a job that expired): it travels as its class name
and message and comes back as `RemoteJobError`, whatever class it was. Results from numpy/torch arrays are
sent as lists. Knows nothing about rows or the queue.
"""

from __future__ import annotations

from typing import Any

import msgpack

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
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def deserialize(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook)
