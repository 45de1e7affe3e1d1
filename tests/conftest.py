"""Shared fixtures: a real Redis server and a small ChatML tokenizer built in memory.

`redis_url`: `REDIS_URL` when it is set and answers PING, else a private `redis-server` (from PATH) on a free
port, no persistence, for the whole session; tests that need it skip with a clear message when neither
exists. Tests keep apart by queue name (`queue_name`), never by flushing a shared server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _ping(url: str, timeout_s: float = 0.5) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("REDIS_URL")
    if url and _ping(url):
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs Redis: set REDIS_URL to a running server or put redis-server on PATH")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not _ping(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def queue_name() -> str:
    return f"statecache:test:{uuid.uuid4().hex[:12]}"


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(chat_template: str | None = CHATML):
    """A byte-level BPE tokenizer trained in memory on a few sentences (any text encodes), with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the page shows a login form", "Answer: A. yes B. no", "user assistant goal steps taken"] * 10
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    return build_tokenizer(chat_template=None)
