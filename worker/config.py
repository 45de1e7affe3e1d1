"""The worker's settings, read from the environment once (names and defaults in `worker.constants`).

Knows the environment variables and their types; does not know arq or the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from worker import constants as C


def _env(name: str, default, cast):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {cast.__name__}") from None


@dataclass(frozen=True)
class Config:
    redis_url: str = C.REDIS_URL
    queue_name: str = C.QUEUE_NAME
    engine: str = C.ENGINE  # "module:callable" returning an engine
    backlog_rows: int = C.BACKLOG_ROWS
    max_row_tokens: int | None = None  # None: the engine's own limit
    max_jobs: int = C.MAX_JOBS
    poll_delay_s: float = C.POLL_DELAY_S
    job_timeout_s: float = C.JOB_TIMEOUT_S
    drain_s: float = C.DRAIN_S
    health_interval_s: float = C.HEALTH_INTERVAL_S

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            redis_url=_env(C.ENV_REDIS_URL, C.REDIS_URL, str),
            queue_name=_env(C.ENV_QUEUE, C.QUEUE_NAME, str),
            engine=_env(C.ENV_ENGINE, C.ENGINE, str),
            backlog_rows=_env(C.ENV_BACKLOG_ROWS, C.BACKLOG_ROWS, int),
            max_row_tokens=_env(C.ENV_MAX_ROW_TOKENS, None, int),
            max_jobs=_env(C.ENV_MAX_JOBS, C.MAX_JOBS, int),
            poll_delay_s=_env(C.ENV_POLL_DELAY_S, C.POLL_DELAY_S, float),
            job_timeout_s=_env(C.ENV_JOB_TIMEOUT_S, C.JOB_TIMEOUT_S, float),
            drain_s=_env(C.ENV_DRAIN_S, C.DRAIN_S, float),
            health_interval_s=_env(C.ENV_HEALTH_INTERVAL_S, C.HEALTH_INTERVAL_S, float),
        )
