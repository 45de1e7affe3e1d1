"""The statecache worker: `arq worker.WorkerSettings` (health check: `arq worker.WorkerSettings --check`).

`WorkerSettings` is built on first access (it reads the environment through statecache.settings).
"""


def __getattr__(name):
    if name == "WorkerSettings":
        from worker.settings import WorkerSettings

        return WorkerSettings
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
