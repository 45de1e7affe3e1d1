"""The worker's side of the msgpack pair (statecache.protocol): what arq gets as `job_serializer` / `job_deserializer`.

Decoding a job never fails here, so arq never logs a bare "unable to deserialize job": a payload larger than
`max_job_bytes` (not decoded at all), a payload that is not msgpack (pickle, arq's default, included) or not a
job map becomes a stand-in job for `statecache.protocol.JOB_UNDECODABLE`, which ends the job with a message
naming the fix (worker.jobs.undecodable). Encoding a result drops arq's copy of the job's arguments (a result
never carries its row back into Redis) and, for a job that came pickled, writes the failure as pickle so that
the pickling client can read why (the worker never unpickles anything).

Every field arq reads from a job map is type- and range-checked first (`job_problem`): a map that fails becomes the
stand-in too, so no hand-written job reaches arq's run_job with, say, a string for its enqueue time (which ended
the worker). What a payload may decode into is bounded before it is decoded (statecache.protocol.decode_job:
`job_too_large`).

Job arguments that are maps, arrays, strings or bytes arrive as `QuietDict`, `QuietList`, `QuietStr`,
`QuietBytes`: the types they are, with a repr that gives their size only (arq logs every job's arguments at INFO;
no row content reaches the log). Knows arq's job and result maps; knows nothing of rows or the engine.
"""

from __future__ import annotations

import math
import pickle
import re
import time
from typing import Any

from statecache.protocol import JOB_UNDECODABLE, UNDECODABLE_HINT, JobTooComplex, decode_job, looks_pickled, serialize

MAX_TRY = 2**31 - 1  # `t`, the try count the producer asks for
MAX_ENQUEUE_MS = 32503680000000  # `et`, milliseconds since 1970: up to the year 3000 (arq makes a datetime of it)
_FUNCTION = re.compile(r"[A-Za-z0-9_.:-]{1,100}")  # `f`: arq looks it up and logs it
_KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # `k`'s keys: arq calls the function with **k and logs the names


def job_problem(job: Any) -> str | None:
    """What makes a decoded job map unfit for arq's run_job, or None. arq reads `f` (looked up in its function table,
    logged), `a` (the positional arguments), `k` (the keyword arguments, **k), `t` (compared with its own int try
    count; None when the producer named none) and `et` (the enqueue time in ms: made a datetime, subtracted from
    now), outside any job's try block, so a wrong type there would end the worker. Names the field and the rule,
    never the value."""
    if not isinstance(job, dict):
        return "the job is not a map"
    missing = [k for k in ("f", "a", "k", "t", "et") if k not in job]
    if missing:
        return f"the job map lacks {', '.join(missing)}"
    if not (isinstance(job["f"], str) and _FUNCTION.fullmatch(job["f"])):
        return "f (the function) must be a name of 1-100 letters, digits or _.:-"
    if not isinstance(job["a"], list):
        return "a (the arguments) must be an array"
    if not (isinstance(job["k"], dict) and all(isinstance(k, str) and _KWARG.fullmatch(k) for k in job["k"])):
        return "k (the keyword arguments) must be a map whose keys are identifiers of at most 64 characters"
    t = job["t"]
    if t is not None and not (type(t) is int and 0 <= t <= MAX_TRY):
        return f"t (the try count) must be nil or an int in 0..{MAX_TRY}"
    et = job["et"]
    if not ((type(et) is int or (type(et) is float and math.isfinite(et))) and 0 <= et <= MAX_ENQUEUE_MS):
        return f"et (the enqueue time) must be a number of milliseconds since 1970 in 0..{MAX_ENQUEUE_MS}"
    return None


class JobRefused(Exception):
    """The job could not be decoded; its message names the serialiser pair to use."""

    def __init__(self, message: str, pickled: bool = False):
        super().__init__(message)
        self.pickled = pickled


class QuietDict(dict):
    """A job argument that is a map (a row), with a short repr. arq logs every job's arguments through repr() at
    INFO, so a row's repr was both row content in the log and event-loop time (bench/worker_overhead.py): the repr
    says sizes only. Everything else sees a dict."""

    def __repr__(self) -> str:
        ids = self.get("ids")
        size = f"{len(ids)} ids" if isinstance(ids, (list, tuple)) else f"{len(self)} fields"
        return f"<row: {size}>"


class QuietList(list):
    def __repr__(self) -> str:
        return f"<array: {len(self)} items>"


class QuietStr(str):
    def __repr__(self) -> str:
        return f"<string: {len(self)} characters>"


class QuietBytes(bytes):
    def __repr__(self) -> str:
        return f"<bytes: {len(self)}>"


_QUIET = {dict: QuietDict, list: QuietList, str: QuietStr, bytes: QuietBytes}


def _quiet(x: Any) -> Any:
    """A job argument as arq will log it: maps, arrays, strings and bytes with a repr of their size only."""
    quiet = _QUIET.get(type(x))
    return quiet(x) if quiet is not None else x


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
            job = decode_job(data)
        except JobTooComplex as e:
            return _stand_in(code="job_too_large", message=str(e))
        except Exception as e:  # noqa: BLE001 - anything that is not our msgpack
            what = "a pickled job" if pickled else f"an undecodable job ({type(e).__name__})"
            return _stand_in(code="undecodable", pickled=pickled, message=f"{what}: {UNDECODABLE_HINT}")
        problem = job_problem(job)
        if problem is not None:
            return _stand_in(code="undecodable", pickled=False,
                             message=f"msgpack that is not an arq job map ({problem}): {UNDECODABLE_HINT}")
        return {"f": job["f"], "a": [_quiet(x) for x in job["a"]],
                "k": {key: _quiet(x) for key, x in job["k"].items()}, "t": job["t"], "et": int(job["et"])}

    return decode


def job_serializer(obj: Any) -> bytes:
    if isinstance(obj, dict) and "s" in obj and "st" in obj:  # a result (arq.jobs.serialize_result's map)
        obj = {**obj, "a": [], "k": {}}  # no copy of the row in the stored result
        r = obj.get("r")
        if isinstance(r, JobRefused) and r.pickled:  # the pickling client reads pickle: tell it in its own terms
            return pickle.dumps({**obj, "r": RuntimeError(str(r))})
    return serialize(obj)
