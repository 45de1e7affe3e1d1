"""Rows checked and tokenised off the event loop, once per row in this worker.

A text row's tokenisation takes host time in proportion to its text (about a second for a 2 M-character page with a
byte-level BPE). On the event loop it stalled the router, arq's poll and the heartbeats (which keep this worker's
queue from being recovered by the others), and the engine then tokenised the same row again on the GPU thread.
Here it runs on one thread of its own (`RowPrep`: a one-thread executor, so at most one row at a time and the engine's
tokenizer copy is never shared between threads), through the engine's `check_aside` (statecache.engine), which gives
a CheckedRow (statecache.rows.check): the row as the engine would check it, or its error. The router checks the rows it
routes (`check_one`, on the row thread through `run`) and remembers those it routes to this worker (`remember`); the `answer` job (worker.jobs) takes the
remembered one (`take`) or checks its row there, and hands the CheckedRow to the GPU thread, whose engine takes it
as it is. So every row of this worker is tokenised once, off the loop and off the GPU thread; a row routed here by
another worker is tokenised here once (the routing worker's tokens stay in its process).

A remembered row is found by a digest of the row itself (BLAKE2b of its msgpack form), never by job id: a row can
only be answered with the tokens of an equal row, whatever happens to the id (a retry, a job id used again). At most
`REMEMBERED_ROWS` are kept (the oldest go first; a row not found is checked again, never wrong). Rows with images,
rows that cannot be packed (in-process callers' objects) and an engine not yet built go to the GPU thread as they are.

Knows the engine's check_aside and asyncio; nothing of Redis or arq.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

REMEMBERED_ROWS = 128  # checked rows routed here and not yet run (each about its ids' int64s: 256 KiB at 32k
# tokens, so at most 32 MiB); more than max_jobs and a dispatch round's rows, so a routed row is rarely checked twice


def digest(row: Any) -> bytes | None:
    """A row's identity: BLAKE2b-128 of its msgpack form (equal rows, equal digests); None if it cannot be packed."""
    try:
        return hashlib.blake2b(msgpack.packb(row, use_bin_type=True), digest_size=16).digest()
    except Exception:  # noqa: BLE001 - an in-process caller's object: not remembered
        return None


class RowPrep:
    def __init__(self, gpu: Any, entries: int = REMEMBERED_ROWS):
        self.gpu, self.entries = gpu, entries
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="statecache-rows")
        self._memo: OrderedDict[bytes, Any] = OrderedDict()
        self.counts = {"checked": 0, "reused": 0}

    def check_one(self, row: Any):
        """On the row thread only: (digest, CheckedRow), or None for a row checked on the GPU thread instead."""
        engine = self.gpu.engine
        if engine is None or not hasattr(engine, "check_aside") or not isinstance(row, dict) or row.get("images"):
            return None
        checked = engine.check_aside(row)
        if checked is None:
            return None
        self.counts["checked"] += 1
        return digest(row), checked

    async def run(self, fn, *args):
        """fn(*args) on the row thread (the loop goes on meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def remember(self, key: bytes | None, checked: Any) -> None:
        """Keep a checked row for its job here (the router routed it to this worker)."""
        if key is None or checked is None:
            return
        self._memo[key] = dataclasses.replace(checked, raw=None)
        self._memo.move_to_end(key)
        while len(self._memo) > self.entries:
            self._memo.popitem(last=False)

    async def take(self, row: Any) -> Any:
        """What the `answer` job hands the GPU thread for `row`: its CheckedRow (remembered, or checked now on the row
        thread), or the row itself (images, an engine without check_aside)."""
        loop = asyncio.get_running_loop()
        if self._memo and isinstance(row, dict) and not row.get("images"):
            key = await loop.run_in_executor(self._pool, digest, row)
            checked = self._memo.pop(key, None) if key is not None else None
            if checked is not None:
                self.counts["reused"] += 1
                return dataclasses.replace(checked, raw=row)
        got = await loop.run_in_executor(self._pool, self.check_one, row)
        return row if got is None else dataclasses.replace(got[1], raw=row)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
