"""The statecache worker: `arq worker.WorkerSettings` (health check: `arq worker.WorkerSettings --check`).

`WorkerSettings` is loaded on first access, so `worker.constants` stays cheap to import for producers.
"""


def __getattr__(name):
    if name == "WorkerSettings":
        from worker.settings import WorkerSettings

        return WorkerSettings
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
