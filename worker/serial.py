"""The worker's side of the msgpack pair (statecache.protocol): what arq gets as `job_serializer` / `job_deserializer`.

Decoding a job never fails here, so arq never logs a bare "unable to deserialize job": a payload larger than
`max_job_bytes` (not decoded at all), a payload that is not msgpack (pickle, arq's default, included) or not a
job map becomes a stand-in job for `statecache.protocol.JOB_UNDECODABLE`, which ends the job with a message
naming the fix (worker.jobs.undecodable). Encoding a result drops arq's copy of the job's arguments (a result
never carries its row back into Redis) and, for a job that came pickled, writes the failure as pickle so that
the pickling client can read why (the worker never unpickles anything).

Job arguments that are maps (rows) arrive as `QuietDict`s: dicts whose repr is a short summary (arq logs every
job's arguments). Knows arq's job and result maps; knows nothing of rows or the engine.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from statecache.protocol import JOB_UNDECODABLE, UNDECODABLE_HINT, deserialize, looks_pickled, serialize


class JobRefused(Exception):
    """The job could not be decoded; its message names the serialiser pair to use."""

    def __init__(self, message: str, pickled: bool = False):
        super().__init__(message)
        self.pickled = pickled


class QuietDict(dict):
    """A job argument that is a map (a row), with a short repr. arq logs every job's arguments through repr() and
    truncates the text after, so a long row's repr was event-loop time spent for 80 characters of log
    (bench/worker_overhead.py). Everything else sees a dict."""

    def __repr__(self) -> str:
        ids = self.get("ids")
        size = f"{len(ids)} ids" if isinstance(ids, (list, tuple)) else f"keys {sorted(map(str, self))[:6]}"
        return f"<row: {size}>"


def _quiet(x: Any) -> Any:
    return QuietDict(x) if type(x) is dict else x


def _stand_in(**kwargs: Any) -> dict:
    return {"f": JOB_UNDECODABLE, "a": [], "k": kwargs, "t": 1, "et": int(time.time() * 1000)}


def job_deserializer(max_job_bytes: int):
    def decode(data: bytes) -> Any:
        if len(data) > max_job_bytes:
            return _stand_in(code="job_too_large", message=(
                f"the job's payload is {len(data)} bytes, more than the worker's limit of {max_job_bytes} "
                "(STATECACHE_MAX_JOB_BYTES); it was not decoded"))
        pickled = looks_pickled(data)
        try:
            job = deserialize(data)
        except Exception as e:  # noqa: BLE001 - anything that is not our msgpack
            what = "a pickled job" if pickled else f"an undecodable job ({type(e).__name__}: {e})"
            return _stand_in(code="undecodable", pickled=pickled, message=f"{what}: {UNDECODABLE_HINT}")
        if not (isinstance(job, dict) and {"f", "a", "k", "et"} <= set(job) and isinstance(job["f"], str)
                and isinstance(job["a"], (list, tuple)) and isinstance(job["k"], dict)):
            return _stand_in(code="undecodable", pickled=False,
                             message=f"msgpack that is not an arq job map: {UNDECODABLE_HINT}")
        job["a"] = [_quiet(x) for x in job["a"]]
        job["k"] = {key: _quiet(x) for key, x in job["k"].items()}
        return job

    return decode


def job_serializer(obj: Any) -> bytes:
    if isinstance(obj, dict) and "s" in obj and "st" in obj:  # a result (arq.jobs.serialize_result's map)
        obj = {**obj, "a": [], "k": {}}  # no copy of the row in the stored result
        r = obj.get("r")
        if isinstance(r, JobRefused) and r.pickled:  # the pickling client reads pickle: tell it in its own terms
            return pickle.dumps({**obj, "r": RuntimeError(str(r))})
    return serialize(obj)
