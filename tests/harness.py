"""Run the real worker for tests: in-process (a thread with its own event loop, any engine) or as a
subprocess (`python -m arq worker.WorkerSettings`, configured by environment, killable)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import msgpack
import redis as redis_sync
from arq.worker import create_worker

from statecache.protocol import health_key
from statecache.settings import Settings
from worker.settings import worker_settings

ROOT = Path(__file__).resolve().parents[1]


class IdleGpu:
    """What a router reads of the GPU thread: nothing running, nothing pending, no engine (rows route by home)."""

    engine = None
    busy = False

    def pending(self) -> int:
        return 0

    def making_progress(self, stuck_s: float) -> bool:
        return True


def answer_job(n: int) -> bytes:
    """arq's stored form (msgpack) of an `answer` job on token row n (rows of different n differ early)."""
    ids = [10 + (n * 7 + i) % 50 for i in range(80)]
    row = {"ids": ids, "state_len": 70, "slots": [79], "nopts": [3]}
    return msgpack.packb({"f": "answer", "a": [row], "k": {}, "t": None, "et": int(time.time() * 1000)})


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


class InProcessWorker:
    """The arq worker with `worker_settings(settings)`, running in a thread until the `with` block ends.
    Settings: the given fields over the defaults, metrics off unless `metrics_port` is given."""

    def __init__(self, redis_url: str, queue_name: str, make_engine, **fields):
        fields.setdefault("metrics_port", 0)
        self.settings = Settings(redis_url=redis_url, queue=queue_name, **fields)
        self.make_engine = make_engine
        self.worker = None
        self.error: BaseException | None = None
        self.error_trace = ""  # its traceback

    def __enter__(self) -> "InProcessWorker":
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        wait_for(lambda: self.error or (self.worker and "gpu" in self.worker.ctx), 60, "the worker to start")
        if self.error:
            raise self.error
        r = redis_sync.Redis.from_url(self.settings.redis_url)
        try:  # ready as operators see it: the health key is up
            wait_for(lambda: self.error or r.exists(health_key(self.settings.queue)), 30, "the health key")
        finally:
            r.close()
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        try:
            self.worker = create_worker(
                worker_settings(self.settings),
                handle_signals=False,
                ctx={"settings": self.settings, "make_engine": self.make_engine},
            )
            self.worker.run()
        except BaseException as e:  # reported to the test
            self.error = e
            self.error_trace = traceback.format_exc()

    @property
    def gpu(self):
        return self.worker.ctx["gpu"]

    @property
    def engine(self):
        return self.gpu.engine

    @property
    def metrics(self):
        return self.worker.ctx["metrics"]

    def __exit__(self, *exc) -> None:
        worker = self.worker
        if worker is not None and not worker.loop.is_closed():
            worker.loop.call_soon_threadsafe(worker.handle_sig, signal.SIGUSR1)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the in-process worker did not stop:\n" + self._stacks()

    def _stacks(self) -> str:
        frame = sys._current_frames().get(self._thread.ident)
        out = ["worker thread:", "".join(traceback.format_stack(frame)) if frame else "?"]
        try:
            for task in asyncio.all_tasks(self.worker.loop):
                out.append(f"task {task.get_name()}: " + "".join(traceback.format_stack(task.get_stack()[-1]))
                           if task.get_stack() else f"task {task!r}")
        except Exception as e:  # noqa: BLE001
            out.append(f"(tasks: {e})")
        return "\n".join(out)


class WorkerProcess:
    """`python -m arq worker.WorkerSettings` with the given environment; stderr goes to a log file."""

    def __init__(self, redis_url: str, queue_name: str, log_path: Path, **env):
        self.redis_url, self.queue_name, self.log_path = redis_url, queue_name, log_path
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "STATECACHE_QUEUE": queue_name,
            "STATECACHE_HEALTH_INTERVAL_S": "0.2",
            "STATECACHE_METRICS_PORT": "0",
            "PYTHONPATH": str(ROOT),
            **{k: str(v) for k, v in env.items()},
        }
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "WorkerProcess":
        """Start the process without waiting for it to be ready."""
        r = redis_sync.Redis.from_url(self.redis_url)
        r.delete(health_key(self.queue_name))
        r.close()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arq", "worker.WorkerSettings"], cwd=ROOT, env=self.env, stdout=self._log, stderr=self._log
        )
        return self

    def start(self, ready_timeout_s: float = 120) -> "WorkerProcess":
        self.launch()
        r = redis_sync.Redis.from_url(self.redis_url)
        try:
            wait_for(
                lambda: self.proc.poll() is not None or r.exists(health_key(self.queue_name)),
                ready_timeout_s,
                "the worker's health key",
                every_s=0.05,
            )
        finally:
            r.close()
        assert self.proc.poll() is None, f"worker exited early:\n{self.log()}"
        return self

    def check(self) -> int:
        """`arq worker.WorkerSettings --check` with this worker's environment: 0 while it serves the queue."""
        return subprocess.run(
            [sys.executable, "-m", "arq", "worker.WorkerSettings", "--check"], cwd=ROOT, env=self.env, capture_output=True
        ).returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
