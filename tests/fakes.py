"""A fake engine with the real engine's interface (statecache.engine.Engine), for worker tests without torch.

Same contract: `answer(rows, waiting_rows=0)` returns one result per row and never raises for a bad row (the old
`backed_up=` keyword is accepted, as the engine accepts it); rows are checked with statecache.rows/text; the paths
follow DESIGN.md section 4 (memo for an exact repeat, hit for a state planted before, cold for the first row of a
new state: every forward plants, whatever the backlog). Answers are a deterministic function of the row's tokens.
"""

from __future__ import annotations

import hashlib
import math
import string
import threading
import time
from collections import Counter

from statecache.rows import RowError, check_row, error_result


def fake_probs(ids: list[int], slot: int, nopts: int) -> list[float]:
    digest = hashlib.sha256(repr((ids[: slot + 1], nopts)).encode()).digest()
    logits = [digest[j] / 32.0 for j in range(nopts)]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


class FakeEngine:
    def __init__(self, tokenizer=None, vocab_size: int = 1000, delay_s: float = 0.0, fail_on_state_len: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer) if tokenizer is not None else vocab_size
        self.letter_ids = list(range(26)) if tokenizer is None else tokenizer.convert_tokens_to_ids(list(string.ascii_uppercase))
        self.max_row_tokens = 4096
        self.delay_s = delay_s
        self.fail_on_state_len = fail_on_state_len  # a row with this state_len makes answer() raise
        self.planted: set[tuple] = set()
        self.memo: dict[tuple, list] = {}
        self.calls: list[tuple[int, bool]] = []  # (rows, backed_up) per answer() call
        self.threads: set[str] = set()
        self.counts = Counter()
        self.release = threading.Event()  # cleared by a test: answer() blocks until it is set
        self.release.set()

    def answer(self, rows: list, waiting_rows: int = 0, backed_up: bool = False) -> list[dict]:
        self.threads.add(threading.current_thread().name)
        self.release.wait()
        self.calls.append((len(rows), backed_up))
        if self.delay_s:
            time.sleep(self.delay_s)
        checked = []
        for row in rows:
            try:
                checked.append(check_row(row, self.vocab_size, self.max_row_tokens, self.tokenizer))
            except RowError as e:
                checked.append(e)
        if self.fail_on_state_len is not None and any(
            isinstance(r, dict) and r["state_len"] == self.fail_on_state_len for r in checked
        ):
            raise RuntimeError("fake engine failure")
        return [self._one(r) for r in checked]

    def _one(self, row) -> dict:
        if isinstance(row, RowError):
            return error_result(row.code, row.message)
        key = (tuple(row["ids"]), tuple(row["slots"]), tuple(row["nopts"]))
        probs = [fake_probs(row["ids"], s, k) for s, k in zip(row["slots"], row["nopts"])]
        state = tuple(row["ids"][: row["state_len"]])
        n = len(row["ids"])
        if key in self.memo:
            path, reused = "memo", n
        elif state in self.planted:
            path, reused = "hit", len(state)
        else:
            path, reused = "cold", 0
            self.planted.add(state)
        self.memo[key] = probs
        self.counts[path] += 1
        return {"probs": probs, "path": path, "reused": reused, "computed": 0 if path == "memo" else n - reused}

    def stats(self) -> dict:
        return {"rows": sum(self.counts.values()), **{p: self.counts[p] for p in ("memo", "hit", "partial", "cold", "plain")}}


class GatedEngine:
    """A real engine behind a gate: while `gate` is clear, `answer` waits, so rows pile up in the worker
    (an artificial backlog); `delay_s` more per call keeps rows in flight for a while. Records
    `(rows, backed_up)` per call; everything else is the inner engine's."""

    def __init__(self, inner, delay_s: float = 0.0):
        self.__dict__.update(inner=inner, gate=threading.Event(), calls=[], entered=0, delay_s=delay_s)
        self.gate.set()

    def answer(self, rows: list, waiting_rows: int = 0, backed_up: bool = False) -> list[dict]:
        self.__dict__["entered"] += 1
        self.gate.wait()
        self.calls.append((len(rows), backed_up))
        time.sleep(self.delay_s)
        return self.inner.answer(rows, waiting_rows=waiting_rows)

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
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


def text_engine() -> FakeEngine:
    """A fake engine that reads text rows too (STATECACHE_ENGINE=tests.fakes:text_engine)."""
    return FakeEngine(tokenizer=build_tokenizer())


def slow_engine() -> GatedEngine:
    """The real engine (STATECACHE_MODEL etc.), half a second slower per batch: rows stay in flight
    long enough for a signal to land among them (STATECACHE_ENGINE=tests.fakes:slow_engine)."""
    from statecache.engine import Engine

    return GatedEngine(Engine.from_env(), delay_s=0.5)
