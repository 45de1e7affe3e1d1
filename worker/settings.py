"""`arq worker.WorkerSettings`: the arq settings of the statecache worker, built from a `Config`.

arq reads a settings class's own `__dict__` (inherited attributes are ignored), so `WorkerSettings` is made
with every setting as its own attribute. `worker_settings(config)` gives the same as a dict, for running a
worker in-process (`arq.worker.create_worker(worker_settings(config), ...)`).
"""

from __future__ import annotations

from arq.connections import RedisSettings
from arq.worker import func

from producer.serial import deserialize, serialize
from worker import constants as C
from worker.config import Config
from worker.jobs import answer, job_ended, job_started, shutdown, startup, stats


def worker_settings(config: Config) -> dict:
    return {
        "functions": [func(answer, name=C.JOB_ANSWER), func(stats, name=C.JOB_STATS, max_tries=1)],
        "redis_settings": RedisSettings.from_dsn(config.redis_url),
        "queue_name": config.queue_name,
        "job_serializer": serialize,
        "job_deserializer": deserialize,
        "poll_delay": config.poll_delay_s,
        "max_jobs": config.max_jobs,
        "job_timeout": config.job_timeout_s,
        "keep_result": C.KEEP_RESULT_S,
        "max_tries": C.MAX_TRIES,
        "health_check_interval": config.health_interval_s,
        "job_completion_wait": config.drain_s,  # SIGTERM: finish in-flight jobs for up to this long
        "on_startup": startup,
        "on_shutdown": shutdown,
        "on_job_start": job_started,
        "after_job_end": job_ended,
        "ctx": {"config": config},
    }


WorkerSettings = type("WorkerSettings", (), worker_settings(Config.from_env()))
