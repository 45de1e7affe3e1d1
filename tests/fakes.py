"""Test helpers around the real engine (statecache.engine.Engine on the built-in tiny model): no fake decides
a path. `GatedEngine` holds the real engine back (or makes one submission fail) so a test can pile rows up or see
the worker survive an engine exception; `build_tokenizer` makes small tokenizers in memory.
"""

from __future__ import annotations

import threading
import time


class GatedEngine:
    """A real engine behind a gate: while `gate` is clear, `submit` (and `answer`) waits, so rows pile up in the
    worker (an artificial backlog); `delay_s` more per submission keeps rows in flight for a while; a submission with a
    row for which `fail_when(row)` is true raises (an engine failure). Records `(rows, waiting_rows)` per submission
    and the threads that called; `step`, `pending` and everything else is the inner engine's."""

    def __init__(self, inner, delay_s: float = 0.0, fail_when=None):
        self.__dict__.update(inner=inner, gate=threading.Event(), calls=[], entered=0, delay_s=delay_s,
                             fail_when=fail_when, threads=set())
        self.gate.set()

    def _enter(self, rows: list, waiting_rows: int) -> None:
        self.__dict__["entered"] += 1
        self.threads.add(threading.current_thread().name)
        self.gate.wait()
        self.calls.append((len(rows), waiting_rows))
        time.sleep(self.delay_s)
        if self.fail_when is not None and any(self.fail_when(r) for r in rows):
            raise RuntimeError("engine failure (test)")

    def submit(self, rows: list, tags: list, waiting_rows: int = 0) -> list:
        self._enter(rows, waiting_rows)
        return self.inner.submit(rows, tags, waiting_rows=waiting_rows)

    def answer(self, rows: list, waiting_rows: int = 0, **kw) -> list[dict]:
        self._enter(rows, waiting_rows)
        return self.inner.answer(rows, waiting_rows=waiting_rows, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


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
    from statecache.dev.tiny import with_spaced_letters

    fast = PreTrainedTokenizerFast(tokenizer_object=with_spaced_letters(tok), eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


def slow_engine(settings=None) -> GatedEngine:
    """The real engine (from the settings), half a second slower per submission: rows stay in flight long enough for
    a signal to land among them (STATECACHE_ENGINE=tests.fakes:slow_engine)."""
    from statecache.engine import Engine

    return GatedEngine(Engine.from_settings(settings), delay_s=0.5)


def stuck_engine(settings=None) -> GatedEngine:
    """The real engine, 30 s slower per submission: a submission that outlives any short drain
    (STATECACHE_ENGINE=tests.fakes:stuck_engine)."""
    from statecache.engine import Engine

    return GatedEngine(Engine.from_settings(settings), delay_s=30.0)


def slow_start_engine(settings=None):
    """The real engine, its construction 2 s longer (as a precapture would be); the time it was done is written
    to the file $TEST_BUILT_AT (STATECACHE_ENGINE=tests.fakes:slow_start_engine)."""
    import os
    from pathlib import Path

    from statecache.engine import Engine

    engine = Engine.from_settings(settings)
    time.sleep(2.0)
    Path(os.environ["TEST_BUILT_AT"]).write_text(repr(time.time()))
    return engine


def held_engine(settings=None) -> GatedEngine:
    """The real engine, each submission held $TEST_ENGINE_DELAY_S seconds longer (default 1): a worker process whose rows
    stay in flight as long as a test needs (STATECACHE_ENGINE=tests.fakes:held_engine)."""
    import os

    from statecache.engine import Engine

    return GatedEngine(Engine.from_settings(settings), delay_s=float(os.environ.get("TEST_ENGINE_DELAY_S", "1")))


def hung_engine(settings=None) -> GatedEngine:
    """The real engine behind a gate that never opens: its first submission never ends, as a hung GPU would
    (STATECACHE_ENGINE=tests.fakes:hung_engine)."""
    from statecache.engine import Engine

    engine = GatedEngine(Engine.from_settings(settings))
    engine.gate.clear()
    return engine
