"""The engine: a batch of rows in, one result per row out, in order; the one object the worker's GPU thread drives.

For each batch: validate (and tokenise text rows), answer exact repeats from the memo, group the rest by their
aligned state tokens, run each group through the state cache (its first row plants checkpoints, the rows
behind it hit them), and pack what the cache declines into plain forwards. `backed_up` (the caller's view of
the queue) decides whether a row with nothing to reuse may take the cached path: under backlog a singleton new
state goes plain (throughput first); a state shared by several waiting rows is planted anyway.
A bad row gets an error result; an exception while computing fails only the rows of that group.
Not thread-safe: one thread drives it. Knows nothing of Redis or asyncio.
"""

from __future__ import annotations

import dataclasses
import logging
import string
import time
from collections import OrderedDict

import torch

from .cache import CacheSettings, StateCache
from .kernels import kernels_for
from .loader import load_weights
from .memo import Memo, row_key
from .model import Qwen35
from .plain import PlainPath
from .policy import load_policy
from .rows import RowError, check_row, error_result
from .runner import ChunkRunner

log = logging.getLogger("statecache.engine")
LETTERS = list(string.ascii_uppercase)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class Engine:
    def __init__(self, model_dir=None, device: str | None = None, dtype: str | None = None, cache_mb: int | None = None,
                 *, settings: CacheSettings | None = None, max_pos: int = 8192, memo_entries: int = 4096,
                 max_row_tokens: int = 32768, plain_tokens: int = 16384, pad_chunks: bool | None = None,
                 compile: bool | None = None, precapture: bool = False, cold_ok=None, cache_fraction: float = 0.9,
                 specialists: str | None = None, backlog_rows: int = 8, home: str | None = None):
        if model_dir is None:
            from .tiny import tiny_model_dir

            model_dir = tiny_model_dir(home)
        self.cold_ok = cold_ok if cold_ok is not None else load_policy(None)  # statecache.policy: the one decision
        self.cache_fraction = cache_fraction  # share of free device memory for the cache when cache_mb is None
        self.specialists = specialists
        self.backlog_rows = backlog_rows
        self.model_dir = str(model_dir)
        self.device = torch.device(device or default_device())
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16")
        self.dtype = getattr(torch, dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        ids = self.tokenizer.convert_tokens_to_ids(LETTERS)
        unk = self.tokenizer.unk_token_id
        if any(i is None or (unk is not None and i == unk) for i in ids):
            raise ValueError(f"the tokenizer in {self.model_dir} lacks single tokens for the letters A-Z")
        self.letter_ids: list[int] = list(ids)
        t0 = time.perf_counter()
        weights = load_weights(self.model_dir, self.letter_ids, self.device, self.dtype)
        self.load_s = time.perf_counter() - t0
        self.model = Qwen35(weights)
        if compile is None:  # fused elementwise kernels on the GPU (measured on an H200, 9B shape: bench/README.md)
            compile = self.device.type == "cuda"
        if compile:
            self.model.compile_elementwise()
        self.vocab_size = weights.cfg.vocab_size
        self.kernels = kernels_for(self.device, compile)
        settings = dataclasses.replace(settings or CacheSettings())  # a copy: the caller's stays as it was
        if cache_mb is not None:
            settings.mb = cache_mb
        self.runner = ChunkRunner(self.model, self.kernels, max_pos=max_pos, max_slots=max(4, settings.max_slots), pad=pad_chunks)
        self.cache = StateCache(self.runner, settings)
        self.precapture_info = self.runner.precapture() if precapture and self.runner.use_graphs else None
        self.plain = PlainPath(self.model, self.kernels, plain_tokens, pool=self.runner.pool)  # one graph pool
        self.memo = Memo(memo_entries)
        self.max_row_tokens = max_row_tokens
        self.counts = {"rows": 0, "memo": 0, "plain": 0, "errors": 0, "batches": 0, "plain_tokens": 0}

    @classmethod
    def from_settings(cls, settings=None, **kw) -> "Engine":
        """The engine a `statecache.settings.Settings` describes (default: `Settings.from_env()`); `kw` overrides."""
        from .settings import Settings

        s = settings if settings is not None else Settings.from_env()
        args = dict(settings=s.cache_settings(), compile=s.compile, precapture=s.precapture, cold_ok=load_policy(s.cold_ok),
                    cache_fraction=s.cache_fraction, specialists=s.specialists, backlog_rows=s.backlog_rows, home=s.home)
        if s.max_row_tokens is not None:
            args["max_row_tokens"] = s.max_row_tokens
        return cls(s.model, s.device, s.dtype, s.cache_mb, **{**args, **kw})

    # ---- a batch --------------------------------------------------------------------------------------------------

    def answer(self, rows: list, waiting_rows: int = 0, backed_up: bool | None = None) -> list[dict]:
        """`waiting_rows`: rows the caller holds beyond this batch (its backlog). `backed_up` is the older form of
        the same news (derived from `waiting_rows` and `backlog_rows` when not given)."""
        if backed_up is None:
            backed_up = waiting_rows > self.backlog_rows
        results: list[dict | None] = [None] * len(rows)
        self.counts["batches"] += 1
        todo = []  # (index, row, memo key)
        for i, raw in enumerate(rows):
            self.counts["rows"] += 1
            try:
                row = check_row(raw, self.vocab_size, self.max_row_tokens, self.tokenizer)
            except RowError as e:
                results[i] = self._error(e.code, e.message)
                continue
            except Exception as e:  # noqa: BLE001 - a row never takes the worker down
                log.exception("row %d could not be prepared", i)
                results[i] = self._error("bad_row", f"{type(e).__name__}: {e}")
                continue
            key = row_key(row["ids"], row["slots"], row["nopts"])
            if (hit := self._memo(key)) is not None:
                results[i] = hit
            else:
                todo.append((i, row, key))
        groups, plain = self._groups(todo)
        for members in groups.values():
            try:
                plain += self._cached_group(members, backed_up, results)
            except Exception as e:  # noqa: BLE001
                log.exception("cached path failed")
                for i, _, _ in members:
                    if results[i] is None:
                        results[i] = self._error("internal", f"{type(e).__name__}: {e}")
        self._plain(plain, results)
        return results  # type: ignore[return-value]

    def _groups(self, todo) -> tuple["OrderedDict[tuple, list]", list]:
        """Eligible rows by their aligned state tokens (rows that can share a checkpoint), in first-seen order;
        and the rows the cached path cannot take (for the plain path)."""
        align = self.cache.s.align
        groups: OrderedDict = OrderedDict()
        plain = []
        for item in todo:
            row = item[1]
            if not self.cache.eligible(row["ids"], row["state_len"], row["slots"]):
                plain.append(item)
                continue
            p = row["state_len"] - row["state_len"] % align
            groups.setdefault(tuple(row["ids"][:p]), []).append(item)
        return groups, plain

    def _cached_group(self, members, backed_up: bool, results) -> list:
        """Run a group's rows through the cache; returns those it declines (for the plain path)."""
        declined = []
        shared = len({key for _, _, key in members}) > 1  # other *different* rows wait on this state
        self.cache.cold_ok = lambda: not backed_up
        for i, row, key in members:
            if (hit := self._memo(key)) is not None:  # the same row twice in one batch
                results[i] = hit
                continue
            ans = self.cache.row(row["ids"], row["state_len"], row["slots"], row["nopts"], plant_anyway=shared)
            if ans is None:
                declined.append((i, row, key))
                continue
            res = {"probs": ans.probs, "path": ans.path, "reused": ans.reused, "computed": ans.computed}
            self.memo.put(key, res)
            results[i] = res
        return declined

    def _plain(self, items, results) -> None:
        unique: OrderedDict = OrderedDict()
        for i, row, key in items:
            unique.setdefault(key, (row, []))[1].append(i)
        if not unique:
            return
        try:
            outs = self.plain.forward([(r["ids"], r["slots"], r["nopts"]) for r, _ in unique.values()])
        except Exception as e:  # noqa: BLE001
            log.exception("plain path failed")
            for _, idx in unique.values():
                for i in idx:
                    results[i] = self._error("internal", f"{type(e).__name__}: {e}")
            return
        for (key, (row, idx)), probs in zip(unique.items(), outs):
            res = {"probs": probs, "path": "plain", "reused": 0, "computed": len(row["ids"])}
            self.memo.put(key, res)
            self.counts["plain"] += 1
            self.counts["plain_tokens"] += len(row["ids"])
            for k, i in enumerate(idx):
                results[i] = res if k == 0 else (self._memo(key) or dict(res, path="memo", reused=0, computed=0))

    def _memo(self, key) -> dict | None:
        hit = self.memo.get(key)
        if hit is None:
            return None
        self.counts["memo"] += 1
        hit.update(path="memo", reused=0, computed=0)
        return hit

    def _error(self, code: str, message: str) -> dict:
        self.counts["errors"] += 1
        return error_result(code, message)

    def stats(self) -> dict:
        c = self.cache.info()
        return {**{k: v for k, v in self.counts.items() if k != "plain_tokens"}, "hits": c["hits"],
                "partial": c["partial"], "cold": c["cold"], "tokens_reused": c["tokens_reused"],
                "tokens_computed": c["tokens_computed"] + self.counts["plain_tokens"], "cache": c,
                "plain_graphs": dict(self.plain.stats, graphs=sum(g is not None for g in self.plain.graphs.values()))}
