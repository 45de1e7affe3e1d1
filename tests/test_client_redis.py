"""REDIS_URL read one way everywhere (statecache.redis_url), and the Client under Redis errors other than a lost
connection: on private redis-servers (one with a password and a unix socket, others set to a tiny maxmemory with
noeviction), with the real worker on the tiny model."""

import asyncio
import os
import subprocess
import sys
import time

import pytest
import redis as redis_sync

from producer.client import Client, ClientError, QueueError, QueueFull
from producer.local_redis import LocalRedis, redis_server_binary
from statecache.engine import Engine
from statecache.protocol import RESULT_KEY_PREFIX
from statecache.redis_url import BadRedisURL, arq_settings, connection_pool
from tests.harness import ROOT, InProcessWorker, wait_for

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server on PATH")
MARKER = "ROW-MARKER-7f3a"  # in every row's text: no error message may carry it


def row(tag: str) -> dict:
    return {"state": f"{MARKER} {tag}: the page shows a form", "questions": [{"text": "Next?", "options": ["a", "b"]}]}


def check(url: str, queue: str) -> subprocess.CompletedProcess:
    """`arq worker.WorkerSettings --check` with REDIS_URL=url, as an operator runs it."""
    env = {**os.environ, "REDIS_URL": url, "STATECACHE_QUEUE": queue, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "arq", "worker.WorkerSettings", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_every_url_form_reads_as_redis_py_reads_it():
    """arq's RedisSettings (for `--check`) and the pool the worker and the Client use say the same as redis-py for
    each form: user-info and query credentials, the db in the path or the query, TLS, unix sockets."""
    cases = {
        "redis://:pw@h:7000/2": dict(host="h", port=7000, database=2, password="pw", ssl=False),
        "redis://h:7000/0?password=pw&db=3": dict(host="h", port=7000, database=3, password="pw"),
        "redis://h?username=u&password=pw": dict(host="h", port=6379, username="u", password="pw"),
        "rediss://u:pw@h:7001?ssl_cert_reqs=none&socket_connect_timeout=3": dict(
            host="h", port=7001, username="u", password="pw", ssl=True, ssl_cert_reqs="none", conn_timeout=3.0),
        "unix:///tmp/r.sock?password=pw&db=1": dict(unix_socket_path="/tmp/r.sock", database=1, password="pw"),
        "unix://:pw@/tmp/r.sock": dict(unix_socket_path="/tmp/r.sock", password="pw"),
    }
    for url, want in cases.items():
        got = arq_settings(url)
        assert {k: getattr(got, k) for k in want} == want, url
        assert "pw" not in repr(got), repr(got)
        pool = connection_pool(url, socket_connect_timeout=9)
        assert pool.connection_kwargs.get("password") == "pw", url
        assert pool.connection_kwargs.get("db", 0) == want.get("database", 0), url
    assert connection_pool("redis://h", socket_connect_timeout=9).connection_kwargs["socket_connect_timeout"] == 9
    assert connection_pool("redis://h?socket_connect_timeout=3", socket_connect_timeout=9).connection_kwargs[
        "socket_connect_timeout"] == 3.0  # the URL's own option wins
    with pytest.raises(BadRedisURL) as e:
        arq_settings("http://:s3cret@h/0")
    assert "s3cret" not in str(e.value) and "redis://" in str(e.value)


@needs_redis
def test_password_in_the_query_and_a_unix_socket_serve_the_client_and_check(queue_name):
    """REDIS_URL with the password as `?password=` (TCP) and as a unix socket URL: the worker serves, the Client
    answers rows and `arq worker.WorkerSettings --check` says healthy through both; a wrong `?password=` is
    QueueRefused and an unhealthy check, neither showing the password."""
    with LocalRedis(password="q-s3cret", unix_socket=True) as server:
        query_url = f"redis://127.0.0.1:{server.port}/0?password=q-s3cret"
        unix_url = f"unix://{server.socket_path}?password=q-s3cret&db=0"
        with InProcessWorker(query_url, queue_name, Engine):

            async def main():
                got = []
                for url in (query_url, unix_url):
                    async with await Client.connect(url, queue_name, timeout_s=60) as client:
                        got.append(await client.answer(row(url[:4])))
                return got

            for result in asyncio.run(main()):
                assert len(result["probs"]) == 1 and abs(sum(result["probs"][0]) - 1) < 1e-4, result
            for url in (query_url, unix_url):
                done = check(url, queue_name)
                assert done.returncode == 0, (url, done.stdout, done.stderr)
                assert "q-s3cret" not in done.stdout + done.stderr
            wrong = query_url.replace("q-s3cret", "wrong-pw")
            done = check(wrong, queue_name)
            assert done.returncode != 0 and "wrong-pw" not in done.stdout + done.stderr

            async def refused():
                with pytest.raises(ClientError) as e:
                    await Client.connect(wrong, queue_name, timeout_s=5)
                return e.value

            e = asyncio.run(refused())
            assert type(e).__name__ == "QueueRefused" and "wrong-pw" not in str(e) and "password=***" in str(e), e


def full(r: redis_sync.Redis) -> None:
    """Redis at its maxmemory with noeviction: every command that may grow memory is refused (OOM)."""
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)


def assert_clean(e: BaseException, *secrets: str) -> None:
    """The message names the problem and carries neither the row's bytes nor a secret; no Redis error rides along."""
    text = str(e) + repr(e)
    for s in (MARKER, *secrets):
        assert s not in text, text
    assert e.__cause__ is None and e.__context__ is None, (e.__cause__, e.__context__)


@needs_redis
def test_a_full_redis_is_queue_full_not_a_raw_redis_error(queue_name):
    """Redis at maxmemory with noeviction: the Client waits it out for its timeout, then raises QueueFull naming
    maxmemory, without the row's bytes (redis-py quotes PSETEX's arguments) or the URL's password."""
    with LocalRedis(password="oom-s3cret") as server:
        r = redis_sync.Redis.from_url(server.url)

        async def main():
            async with await Client.connect(server.url, queue_name, timeout_s=1.5) as client:
                full(r)
                with pytest.raises(QueueFull) as e:
                    await client.answer(row("full"))
                return e.value

        try:
            e = asyncio.run(main())
        finally:
            r.config_set("maxmemory", 0)
            r.close()
    assert "maxmemory" in str(e) and "store the job" in str(e), e
    assert_clean(e, "oom-s3cret")


@needs_redis
def test_the_client_waits_out_a_full_redis(queue_name, caplog):
    """A Redis that is full when the row is sent and has room again a moment later: the row is answered."""
    with LocalRedis() as server, InProcessWorker(server.url, queue_name, Engine):
        r = redis_sync.Redis.from_url(server.url)

        async def main():
            async with await Client.connect(server.url, queue_name, timeout_s=60) as client:
                full(r)
                task = asyncio.create_task(client.answer(row("waits")))
                while not any("refused to store the job" in rec.getMessage() for rec in caplog.records):
                    assert not task.done(), task  # (on old code: the raw OutOfMemoryError)
                    await asyncio.sleep(0.01)
                r.config_set("maxmemory", 0)
                return await task

        try:
            result = asyncio.run(main())
        finally:
            r.config_set("maxmemory", 0)
            r.close()
    assert len(result["probs"]) == 1, result


@needs_redis
def test_a_stored_result_is_read_from_a_full_redis(queue_name):
    """The worker stored the result, then Redis filled up before the Client read it: the Client still reads it
    (a GET a full Redis answers; a transaction's queued GET it refuses)."""
    with LocalRedis() as server, InProcessWorker(server.url, queue_name, Engine):
        r = redis_sync.Redis.from_url(server.url)

        async def main():
            async with await Client.connect(server.url, queue_name, timeout_s=60) as client:
                task = asyncio.create_task(client.answer(row("stored")))
                while not r.keys("arq:job:*"):  # enqueued
                    await asyncio.sleep(0.005)
                # the event loop (the Client) waits here, blocked, while the worker answers and stores the result
                wait_for(lambda: r.keys(RESULT_KEY_PREFIX + "*"), 60, "the stored result")
                full(r)
                return await task

        try:
            result = asyncio.run(main())
        finally:
            r.config_set("maxmemory", 0)
            r.close()
    assert len(result["probs"]) == 1, result


@needs_redis
def test_another_redis_error_is_a_queue_error_at_once(queue_name):
    """A Redis error that does not pass (the queue's key holds a string): QueueError at once, naming what Redis said
    and not the row's bytes."""
    with LocalRedis() as server:
        r = redis_sync.Redis.from_url(server.url)
        r.set(queue_name, "not a queue")
        r.close()

        async def main():
            async with await Client.connect(server.url, queue_name, timeout_s=60) as client:
                t0 = time.monotonic()
                with pytest.raises(QueueError) as e:
                    await client.answer(row("wrongtype"))
                return e.value, time.monotonic() - t0

        e, took_s = asyncio.run(main())
    assert not isinstance(e, QueueFull) and "WRONGTYPE" in str(e) and queue_name in str(e), e
    assert took_s < 30, took_s  # not waited out for the 60 s timeout
    assert_clean(e)


def oom_refusals(r: redis_sync.Redis) -> int:
    return r.info("errorstats").get("errorstat_OOM", {}).get("count", 0)


@needs_redis
def test_the_worker_waits_out_a_full_redis(queue_name, caplog):
    """The worker's writes (health key, routing heartbeat) refused for want of memory for a while: it waits, logs it
    once, and serves once Redis has room (it used to let the OutOfMemoryError end it)."""
    with LocalRedis() as server, InProcessWorker(server.url, queue_name, Engine, health_interval_s=0.2) as w:
        r = redis_sync.Redis.from_url(server.url)
        try:
            full(r)
            wait_for(lambda: w.error or oom_refusals(r) >= 5, 30, "the worker's writes to be refused")
            r.config_set("maxmemory", 0)
            assert w.error is None, w.error_trace

            async def main():
                async with await Client.connect(server.url, queue_name, timeout_s=30) as client:
                    return await client.answer(row("after"))

            result = asyncio.run(main())
        finally:
            r.config_set("maxmemory", 0)
            r.close()
        assert w.error is None, w.error_trace
    assert len(result["probs"]) == 1, result
    said = [rec.getMessage() for rec in caplog.records if "out of memory" in rec.getMessage()]
    assert len(said) == 1 and "maxmemory" in said[0], said
