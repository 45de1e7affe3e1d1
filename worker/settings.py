"""`arq worker.WorkerSettings`: the arq settings of the statecache worker, built from `statecache.settings.Settings`.

arq reads a settings class's own `__dict__` (inherited attributes are ignored), so `WorkerSettings` is made
with every setting as its own attribute. `worker_settings(settings)` gives the same as a dict, for running a
worker in-process (`arq.worker.create_worker(worker_settings(settings), ...)`). The Redis client is
worker.resilient's (it waits out a Redis restart); `redis_settings` stays for `arq ... --check`. Both read
REDIS_URL as statecache.redis_url does (every form redis-py accepts: `?password=`, rediss://, unix://).

Knows arq's settings; the values come from Settings.
"""

from __future__ import annotations

from arq.worker import func

from statecache.protocol import JOB_ANSWER, JOB_PROFILE, JOB_STATS, JOB_UNDECODABLE, health_key, private_queue
from statecache.redis_url import arq_settings
from statecache.settings import Settings
from worker.jobs import answer, job_ended, job_started, profile, shutdown, startup, stats, undecodable
from worker.resilient import ResilientRedis
from worker.routing import new_worker_id
from worker.serial import job_deserializer, job_serializer

KEEP_RESULT_S = 600.0  # results stay in Redis this long for the producer to read
MAX_TRIES = 5  # a job cancelled (shutdown), re-queued (waited too long) or lost (killed worker) runs again up to this


def worker_settings(settings: Settings) -> dict:
    pool = ResilientRedis.from_dsn(settings.redis_url)
    pool.job_serializer = job_serializer
    pool.job_deserializer = job_deserializer(settings.max_job_bytes)
    pool.default_queue_name = settings.queue
    return {
        "functions": [
            func(answer, name=JOB_ANSWER),
            func(stats, name=JOB_STATS, max_tries=1),
            func(profile, name=JOB_PROFILE, max_tries=1),
            func(undecodable, name=JOB_UNDECODABLE, max_tries=1),
        ],
        "redis_settings": arq_settings(settings.redis_url),  # for `arq ... --check` only: the worker uses redis_pool
        "redis_pool": pool,
        # arq serves this worker's own queue; its router (worker.routing) moves the rows meant for it there from
        # settings.queue, where agents enqueue
        "queue_name": private_queue(settings.queue, settings.worker_id or new_worker_id()),
        "job_serializer": job_serializer,
        "job_deserializer": job_deserializer(settings.max_job_bytes),
        "poll_delay": settings.poll_delay_s,
        "max_jobs": settings.max_jobs,
        "job_timeout": settings.job_timeout_s,
        "keep_result": KEEP_RESULT_S,
        "log_results": False,  # arq would log every result's repr (a row's probabilities) at INFO
        "max_tries": MAX_TRIES,
        "health_check_interval": settings.health_interval_s,
        "health_check_key": health_key(settings.queue),  # the queue's, not the worker's own queue's: what producers check
        "job_completion_wait": settings.drain_s,  # SIGTERM: finish in-flight jobs for up to this long
        "on_startup": startup,
        "on_shutdown": shutdown,
        "on_job_start": job_started,
        "after_job_end": job_ended,
        "ctx": {"settings": settings},
    }


def __getattr__(name: str):
    if name == "WorkerSettings":  # built on first use: reading the environment warns about unknown settings once
        global WorkerSettings
        WorkerSettings = type("WorkerSettings", (), worker_settings(Settings.from_env()))
        return WorkerSettings
    raise AttributeError(f"module 'worker.settings' has no attribute {name!r}")
