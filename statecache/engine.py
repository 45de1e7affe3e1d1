"""The engine: rows in (`submit`), answered a step at a time (`step`); the one object the worker's GPU thread drives.

`submit(rows, tags)` checks each row (text rows tokenised; a CheckedRow, checked beside the engine's thread by
`check_aside`, is taken as it is), answers bad rows and exact repeats (the memo) at once, and hands the rest to the
step loop (statecache.step.Steps over statecache.sched.Scheduler): a row equal to one already scheduled waits for its
answer. `step()` runs one step: the scheduler fills a token budget with hits, grown states and chunks of new pages,
the batched runner (statecache.batch) runs them as packed forwards, each sequence from its own state, and the rows
whose last piece ran are answered; states are planted as their pieces pass their checkpoint positions, and a row
whose state another row is computing waits for it. Whether a new state is planted is the `cold_ok` policy's decision
(statecache.policy), asked once per new state; `waiting_rows` (the caller's view of its queue) only informs it.
`answer(rows)` is both, stepped until every row is answered (what `statecache score` and the tests use).

Rows with images (checkpoints with a vision tower: statecache.images, statecache.vision) go through the step loop too:
their memo and group keys include each image's content hash, the index knows their states by key tokens, and a piece
holding image tokens runs in an eager forward of its own. So do rows with specialists (`specialists=`: every result
then names its `route`): each runs with a route, guessed until its router has spoken over the whole row, and one the
router disagrees with runs again with the router's route (statecache.step). Rows the step loop does not take run at
submission through the paths that came before it (`_run`): rows a step gave back (`retry`), and every row when there
is no batched runner (`batch=0`), or no step loop (a cache aligned off the 64-token chunks); start-up warms and
captures these paths only in the last two cases (`others_warm`). There: rows of saved states through one batched
call (StateCache.rows_batched), new states through the plain path's forwards (statecache.plain, statecache.plant),
what those leave one row at a time through the state cache; the checkpoints they restore are pinned meanwhile.

A bad row gets an error result; a failing forward fails only its row (the step loop halves it until the failing
piece stands alone; the other paths fail the rows of that group or forward). Not thread-safe: one thread drives it.
Knows nothing of Redis or asyncio.
"""
from __future__ import annotations

import dataclasses
import logging
import string
import time
from collections import OrderedDict

import torch

from .budget import (DEFAULT_FRACTION, Budget, DeviceTooSmall, cache_budget, check_fits, device_free_bytes,
                     forward_workspace_bytes, rebudget)
from .cache import CacheSettings, StateCache
from .compile_cache import use_persistent_caches
from .kernels import kernels_for
from .config import load_config
from .loader import load_weights
from .index import as_ids
from .memo import Memo, row_key
from .model import Qwen35
from .plain import PlainPath
from .policy import ColdContext, ColdPolicy, PlantWhenItFits, load_policy
from .rows import CheckedRow, RowError, check_row, error_result
from .runner import ChunkRunner
from .text import answer_tokens, text_bound
from .specialists import load_specialists
from .batch import CHUNK
from .step import BUDGET_TOKENS, CHUNK_TOKENS, RowFailed, Steps

log = logging.getLogger("statecache.engine")
LETTERS = list(string.ascii_uppercase)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


MEMORY_CHECK_S = 2.0  # how often a step re-checks the device's free memory (statecache.budget.rebudget)
# how long memory given back must stay free before the budget grows into it: a worker started in place of one that
# died (a rolling restart, a crash loop's next try) loads its weights and sizes its cache within about a minute
# (57 s with warm compile caches on an H100, bench/README.md); a survivor growing at once took that memory and the
# new worker refused to start (s41_run3)
GROW_AFTER_S = 120.0


def _now() -> float:
    return time.monotonic()


class Engine:
    def __init__(self, model_dir=None, device: str | None = None, dtype: str | None = None, cache_mb: int | None = None,
                 *, settings: CacheSettings | None = None, max_pos: int = 8192, memo_entries: int = 4096,
                 max_row_tokens: int = 32768, plain_tokens: int = 16384, pad_chunks: bool | None = None,
                 compile: bool | None = None, precapture: bool = False, cold_ok: ColdPolicy | None = None,
                 specialists=None, cache_fraction: float | None = None, batch: int = 64, home: str | None = None,
                 auto_budget: bool | None = None, step_tokens: int = BUDGET_TOKENS,
                 step_chunk: int = CHUNK_TOKENS):
        if model_dir is None:
            from .tiny import tiny_model_dir

            model_dir = tiny_model_dir(home)
        self.cache_fraction = cache_fraction  # share of free device memory for the cache when cache_mb is None
        self.model_dir = str(model_dir)
        self.device = torch.device(device or default_device())
        if self.device.type == "cuda":
            use_persistent_caches(home)  # before anything compiles or autotunes
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
        self.letter_ids: list[int] = list(ids)  # what a token row's `nopts` reads: the first letters, bare
        # a text row's slots read the letters as the tokenizer writes them there (" A" after a cue): found once, checked
        self.answer_tokens = answer_tokens(self.tokenizer)
        t0 = time.perf_counter()
        # specialists (a folder, statecache.specialists.folder): checked in full before the model's weights load
        self.specialists = None if specialists is None else load_specialists(
            specialists, load_config(self.model_dir), self.device, self.dtype)
        try:
            weights = load_weights(self.model_dir, self.letter_ids, self.device, self.dtype)
        except torch.OutOfMemoryError as e:
            free = device_free_bytes(self.device)
            raise DeviceTooSmall(f"the weights of {self.model_dir} in {dtype} did not fit {self.device} "
                                 f"({(free or 0) / 2**20:.0f} MiB free after the attempt): give the worker a device "
                                 f"nothing else holds, or a larger one ({str(e).splitlines()[0][:300]})") from None
        self.load_s = time.perf_counter() - t0
        self.loaded_at = time.time()  # wall clock: start-up is measured from here (bench/load_bench.py)
        self.model = Qwen35(weights)
        if compile is None:  # fused elementwise kernels on the GPU (measured on an H200, 9B shape: bench/README.md)
            compile = self.device.type == "cuda"
        if compile:
            self.model.compile_elementwise()
        self.vocab_size = weights.cfg.vocab_size
        self.kernels = kernels_for(self.device, compile)
        if auto_budget is None:  # sized from the device unless the caller gives a figure (cache_mb, else settings.mb)
            auto_budget = cache_mb is None and settings is None
        settings = dataclasses.replace(settings or CacheSettings())  # a copy: the caller's stays as it was
        if cache_mb is not None:
            settings.mb = cache_mb
        self.runner = ChunkRunner(self.model, self.kernels, max_pos=max_pos, max_slots=max(4, settings.max_slots), pad=pad_chunks,
                                  specialists=self.specialists)
        self.cache = StateCache(self.runner, settings)
        # the step loop's runner takes rows up to the longest a row may be (its key span only sizes kernel splits)
        self.cache.batch = self._batch_runner(batch, max(max_pos, max_row_tokens)) if batch > 0 else None
        # image rows (a checkpoint with a vision tower and an image processor): known before start-up captures
        from .images import ImageSupport

        self.images = ImageSupport.for_model(self.model_dir, self.tokenizer)
        # the step loop (statecache.step) runs every row, image rows and specialists included, where the batched
        # runner runs (its snapshots sit on its 64-token chunks, so the cache's checkpoints must too). The engine's
        # other paths (the chunk runner, statecache.plain) then serve only rows a step gave
        # back (`retry`): start-up captures and warms them only where there is no step loop; else they capture on
        # first use, and the largest forward the device must leave room for is the step's.
        step_loop = self.cache.batch is not None and self.cache.s.align % CHUNK == 0
        self.others_warm = not step_loop
        self.precapture_info = None
        if precapture and self.runner.use_graphs:
            self.precapture_info = info = (self.runner.precapture() if self.others_warm
                                           else {"graphs": 0, "seconds": 0.0, "failed": []})
            if self.others_warm:
                log.info("precaptured %d chunk graphs in %.1f s%s", info["graphs"], info["seconds"],
                         f"; failed: {info['failed']}" if info["failed"] else "")
            if self.cache.batch is not None:
                info["batch"] = self.cache.batch.precapture()
                log.info("precaptured %d batch graphs in %.1f s", info["batch"]["graphs"], info["batch"]["seconds"])
        self.plain = PlainPath(self.model, self.kernels, plain_tokens, pool=self.runner.pool,  # one graph pool
                               specialists=self.specialists)
        if self.precapture_info is not None and self.others_warm:
            self.precapture_info["packed_warmup_s"] = self._warm_packed()
            self.precapture_info["plain"] = self.plain.precapture()  # short lone rows' graphs
        if self.precapture_info is not None:
            self.plain.capture_on_demand = False  # nothing is captured while serving (other lone rows run packed)
        # image rows: the vision tower loads before the cache's budget is sized from the memory left
        self.embeddings = None
        if self.images is not None:
            from .vision import Embeddings, VisionTower

            self.embeddings = Embeddings(self.images, VisionTower.from_checkpoint(self.model_dir, self.device, self.dtype))
        self._reserved0: int | None = None  # set by _size_cache where the budget comes from the device
        largest = max(plain_tokens, max_row_tokens) if self.others_warm else self.cache.batch.max_tokens
        self.budget = self._size_cache(settings, auto_budget, cache_fraction, largest)
        self.budget_at_start = self.budget
        self.memory = {"rechecks": 0, "shrunk": 0, "grown": 0, "grow_deferred": 0}  # the budget re-checked while serving
        self._grow_since: float | None = None  # when the free memory first allowed a larger budget (recheck_memory)
        self._recheck_at = 0.0
        self.memo = Memo(memo_entries)
        self.max_row_tokens = max_row_tokens
        self.cold_ok: ColdPolicy = cold_ok if cold_ok is not None else PlantWhenItFits()
        self.counts = {"rows": 0, "memo": 0, "plain": 0, "errors": 0, "batches": 0, "plain_tokens": 0, "declined": 0}
        # wall seconds and rows per phase (the GPU is synchronised at the end of each, so these are where the engine's
        # time goes): the step loop's steps (step_*: rows it finished), and the other paths' phases of `_run`
        self.phases = {**{f"{k}_{u}": 0 for k in ("step", "batched", "packed", "one_by_one") for u in ("s", "rows")},
                       "step_cpu_s": 0, "steps": 0, "packed_cpu_s": 0}
        self.steps = None
        if step_loop:
            self.steps = Steps(self.cache, self.cache.batch, self.cold_ok, budget_tokens=step_tokens,
                               chunk_tokens=step_chunk)
        self._flight: dict = {}  # memo key of a scheduled row -> the tags waiting for it (the first is its own)
        if self.cache.host is not None:  # start-up's captures are done: the host tier prepares its slabs meanwhile
            self.cache.host.start()

    def _warm_packed(self) -> float:
        """Run the packed forward (eager: nothing to capture) on dummy rows of a few lengths, planting and not, so
        that its compiled pieces settle on dynamic shapes and fla autotunes its varlen kernels now, before the
        first rows are served (measured on an H200, 9B: the first packed batch otherwise took 83 s). Seconds."""
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)

        def dummy(n: int):
            return (torch.randint(0, self.vocab_size, (n,), generator=gen).tolist(), [n - 1], [4])

        # lengths: the Triton kernels (fla's and ours) specialise on whether integer arguments such as the packed
        # token count are multiples of 16, so the sets cover both classes; then batches like agents' new pages
        # (1-8 rows of 1-5k tokens; a forward past plain_tokens splits): with only the first three sets, a first 4-
        # and 8-row batch each paid seconds of compilation while serving (bench/README.md, session 5)
        sizes = [(1100,), (3100, 2100), (700, 1500, 2600), (1117, 2203), (1600, 2405, 3003, 1571)]
        for k, count in enumerate((1, 2, 3, 4, 6, 8)):
            sizes.append(tuple(int(x) for x in torch.randint(1000, 5000, (count,), generator=gen)))
        for lens in sizes:
            rows = [dummy(n) for n in lens]
            plant = self.specialists is None and all(self.cache.eligible(n - 40, r[1]) for r, n in zip(rows, lens))
            self.plain.run(rows, [self.cache.plan(n - 40) for n in lens] if plant else None)
            if len(rows) > 1:
                self.plain.run(rows)  # the packed forward without planting
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = round(time.perf_counter() - t0, 2)
        log.info("warmed the packed forward up in %.1f s", seconds)
        return seconds

    def _size_cache(self, settings: CacheSettings, auto: bool, fraction: float | None, largest: int) -> Budget:
        """The cache's bound (statecache.budget): the caller's figure, else on CUDA a fraction of the memory free now
        (weights, static buffers and captured graphs are in place) less the largest forward's workspace, else the
        CPU default. Logged in MiB and in 4k-token states."""
        cfg, nbytes = self.model.cfg, torch.tensor([], dtype=self.dtype).element_size()
        free = workspace = None
        if auto and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # blocks cached after start-up's warm-ups and captures count as free (graphs keep theirs)
            free = device_free_bytes(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            workspace = max(forward_workspace_bytes(cfg, largest, nbytes), peak)
            check_fits(f"the largest forward ({largest} tokens)", workspace, free, "give the worker a device nothing "
                       "else holds, or lower STATECACHE_MAX_ROW_TOKENS")
            self._reserved0 = torch.cuda.memory_reserved(self.device)  # what rebudget counts this process's own from
        budget = cache_budget(cfg, nbytes, setting_mb=None if auto else settings.mb, free_bytes=free,
                              workspace_bytes=workspace or 0, fraction=DEFAULT_FRACTION if fraction is None else fraction,
                              stride=settings.stride, tail=settings.tail, align=settings.align)
        self.cache.s.mb = budget.mb
        self.cache.index.budget_bytes = budget.mb * 2**20
        mem = ""
        if self.device.type == "cuda":
            mem = (f"; torch allocated {torch.cuda.memory_allocated(self.device) / 2**20:.0f} MiB, reserved "
                   f"{torch.cuda.memory_reserved(self.device) / 2**20:.0f} MiB")
        log.info("%s%s; %s", budget.describe(), mem, self.cache.host_budget.describe())
        return budget

    @classmethod
    def from_settings(cls, settings=None, **kw) -> "Engine":
        """The engine a `statecache.settings.Settings` describes (default: `Settings.from_env()`); `kw` overrides.
        The cache's budget: `cache_mb` when set, else sized from the device (`cache_fraction` of its free memory)."""
        from .settings import Settings

        s = settings if settings is not None else Settings.from_env()
        args = dict(settings=s.cache_settings(), auto_budget=s.cache_mb is None, compile=s.compile, precapture=s.precapture,
                    cold_ok=load_policy(s.cold_ok), cache_fraction=s.cache_fraction, specialists=s.specialists,
                    batch=s.batch, home=s.home, step_tokens=s.step_tokens)
        if s.max_row_tokens is not None:
            args["max_row_tokens"] = s.max_row_tokens
        return cls(s.model, s.device, s.dtype, s.cache_mb, **{**args, **kw})

    def _batch_runner(self, max_batch: int, max_pos: int):
        """The batched-continuation runner (statecache.batch), or None when it cannot run here: CUDA graphs need its
        Triton kernels (fla's kernels object); eagerly (CPU) the torch loop serves. With specialists each sequence
        runs with its own route."""
        from .batch import BatchRunner

        try:
            return BatchRunner(self.model, self.kernels, max_slots=self.runner.max_slots, max_batch=max_batch,
                               max_pos=max_pos, pool=self.runner.pool, graphs=self.runner.use_graphs,
                               specialists=self.specialists)
        except ValueError as e:  # a model or device it cannot serve: the engine's other paths serve every row
            log.warning("no step loop: %s; every row takes the engine's other paths", e)
            return None
        except Exception:  # noqa: BLE001 - rows then run one at a time
            log.exception("no batched continuations")
            return None

    # ---- a batch --------------------------------------------------------------------------------------------------

    def answer(self, rows: list, waiting_rows: int = 0, *, on_result=None) -> list[dict]:
        """One result per row, in order: `submit` them all, then `step` until every one is answered. on_result(i,
        result): called as soon as row i's result is known (at submission for errors and memo answers, at the end of
        the step that finishes it otherwise). waiting_rows: rows queued behind these (the cold_ok policy's view)."""
        results: list[dict | None] = [None] * len(rows)

        def put(got) -> None:
            for i, res in got:
                results[i] = res
                if on_result is not None:
                    try:
                        on_result(i, res)
                    except Exception:  # noqa: BLE001 - the row is still in the returned list
                        log.exception("on_result failed for row %d", i)

        put(self.submit(rows, list(range(len(rows))), waiting_rows))
        while self.pending():
            put(self.step())
        return results  # type: ignore[return-value]

    def submit(self, rows: list, tags: list, waiting_rows: int = 0) -> list[tuple]:
        """Rows in, each with its caller's tag -> (tag, result) for the rows answered at once: bad rows (their
        error), memo answers and the rows the step loop does not take (without a step loop: run now through the
        engine's other paths). The others join the schedule; `step` answers
        them. A row equal to one already scheduled is answered with it (path "memo")."""
        if len(tags) != len(rows):
            raise ValueError(f"{len(tags)} tags for {len(rows)} rows")
        self.counts["batches"] += 1
        out: list = []
        todo = []  # (tag, row, memo key) for the other paths
        if self.steps is not None:
            self.steps.sched.backlog = max(0, int(waiting_rows or 0))
        for tag, raw in zip(tags, rows):
            self.counts["rows"] += 1
            got = self._prepare(0, raw)
            if isinstance(got, dict):  # its error result
                out.append((tag, got))
                continue
            row, key = got
            if (hit := self._memo(key)) is not None:
                out.append((tag, hit))
            elif key in self._flight:  # the same row again while it runs: answered with it
                self._flight[key].append(tag)
            elif self.steps is not None and self.steps.takes(row):
                self._flight[key] = [tag]
                self.steps.add(key, row)
            else:
                todo.append((tag, row, key))
        out += self._other_paths(todo, len(rows), waiting_rows)
        return out

    def pending(self) -> int:
        """Rows in the schedule (`step` has work)."""
        return self.steps.pending() if self.steps is not None else 0

    def step(self) -> list[tuple]:
        """Launch the schedule's next step and finish the one before it (statecache.step.Steps: the device runs one
        step while the host prepares the next) -> (tag, result) for each row that finished; a row the step could not
        run goes through the engine's other paths now (one at a time), except one that ran out of device memory
        alone (its `out_of_memory` error)."""
        if self.steps is None or not self.steps.pending():
            return []
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._reserved0 is not None and t0 >= self._recheck_at:
            self._recheck_at = t0 + MEMORY_CHECK_S
            self.recheck_memory()
        declined, launched = self.steps.sched.stats["declined"], self.steps.stats["steps"]
        done = self.steps.step()
        self.counts["declined"] += self.steps.sched.stats["declined"] - declined
        self._phase("step", len(done), t0, c0)
        self.phases["steps"] += self.steps.stats["steps"] - launched  # steps launched (a call may only finish one)
        out, again = [], []
        for key, ans in done:
            tags = self._flight.pop(key)
            if isinstance(ans, RowFailed):
                if ans.code == "retry":  # e.g. its checkpoint could not come back to the device: the other paths
                    again += [(tag, ans.row, key) for tag in tags]
                    continue
                res = self._error(ans.code, ans.message)
            else:
                res = self._result(ans)
                if ans.path == "plain":
                    self.counts["plain"] += 1
                    self.counts["plain_tokens"] += ans.computed
                self.memo.put(key, res)
            out.append((tags[0], res))
            out += [(tag, self._memo(key) or self._repeat(res)) for tag in tags[1:]]
        if again:
            out += self._other_paths(again, len(again), 0)
        return out

    def clear_schedule(self) -> list[tuple]:
        """Give up every row in the schedule (a step raised past its own isolation) -> the tags that waited on them."""
        if self.steps is not None:
            self.steps.clear()
        tags = [tag for waiting in self._flight.values() for tag in waiting]
        self._flight.clear()
        return tags

    def _repeat(self, res: dict) -> dict:
        if "probs" not in res:
            return dict(res)
        self.counts["memo"] += 1
        return dict(res, path="memo", reused=0, computed=0)

    def _other_paths(self, todo: list, batch_rows: int, waiting_rows: int) -> list[tuple]:
        """Rows (tag, row, memo key) through the paths before the step loop (`_run`), now -> (tag, result)."""
        if not todo:
            return []
        first: dict = {}
        items, repeats = [], []
        for k, (tag, row, key) in enumerate(todo):
            if key in first:
                repeats.append((k, first[key]))
            else:
                first[key] = k
                items.append((k, row, key))
        results: list = [None] * len(todo)
        self._run(items, batch_rows, waiting_rows, results)
        for k, j in repeats:
            results[k] = self._repeat(results[j])
        return [(todo[k][0], res) for k, res in enumerate(results)]

    def _prepare(self, i: int, raw):
        """One row checked (text rows tokenised, images decoded) -> (row, memo key), or its error result (a dict).
        A CheckedRow (`check_aside`) checked under this engine's limits is taken as it is: not tokenised again."""
        if isinstance(raw, CheckedRow):
            if raw.limits == self._limits():
                if raw.error is not None:
                    return self._error(*raw.error)
                return raw.row, row_key(raw.row["ids"], raw.row["slots"], raw.row["options"])
            raw = raw.raw
        try:
            row = check_row(raw, self.vocab_size, self.max_row_tokens, self.tokenizer, self.images, as_array=True,
                            answers=self.answer_tokens, bound=self._text_bound(self.tokenizer))
            if row.get("images"):
                from .vision import RowImages

                row["mm"] = RowImages(row["ids"], row["images"], self.embeddings, self.device)
        except RowError as e:
            return self._error(e.code, e.message)
        except Exception as e:  # noqa: BLE001 - a row never takes the worker down
            log.exception("row %d could not be prepared", i)
            return self._error("bad_row", f"{type(e).__name__}: {e}")
        key = row_key(row["ids"], row["slots"], row["options"])
        if "mm" in row:
            key = (key, row["mm"].digests)
        return row, key

    def _phase(self, name: str, rows: int, t0: float, c0: float | None = None) -> None:
        self.phases[f"{name}_s"] += time.perf_counter() - t0
        self.phases[f"{name}_rows"] += rows
        if c0 is not None:  # this thread's CPU seconds (a CUDA synchronisation that spins counts as CPU time too)
            self.phases[f"{name}_cpu_s"] += time.thread_time() - c0

    def _run(self, todo, batch_rows: int, waiting_rows: int, results) -> None:
        """Compute the distinct rows of a batch, short work first (see the module docstring):
        1. one batched call (statecache.batch) for every row of a state saved at its end and the first row of each
           grown state (it plants the state's end);
        2. a second batched call for the rows behind grown states (now hits);
        3. the plain path's forwards for the rows the cache cannot take and the first row of each new state the
           cold_ok policy lets plant (it plants): packed in arrival order (`PlainPath.forwards`); each forward's
           answers are handed back when it ends, and the rows behind its new states run batched right after it (now
           hits);
        4. one at a time through the cache: what a batch left, and everything when there is no batched runner."""
        groups, plain = self._groups(todo)
        pinned: list = []  # the checkpoints this batch's rows will restore, pinned in the index until the batch ends
        try:
            self._run_groups(groups, plain, batch_rows, waiting_rows, results, pinned)
        finally:
            for c in pinned:
                self.cache.index.unpin(c)

    def _run_groups(self, groups, plain, batch_rows: int, waiting_rows: int, results, pinned: list) -> None:
        """`_run` for rows grouped by state (`_groups`); the checkpoints found for them are pinned into `pinned`."""
        saved, grown, planting, chunked = [], [], [], []  # groups of rows (i, row, key)
        version, found = self.cache.index.version, {}  # memo key -> (checkpoint, index version): the first batched
        # call plans from these lookups instead of repeating them (while nothing is planted, evicted or touched)
        for members in groups.values():
            row = members[0][1]
            best = self.cache.index.lookup(row["mm"].keys if "mm" in row else row["ids"], limit=self._p(row))
            if best is not None:  # the batch's rows are taken: their states stay until they are read
                self.cache.index.pin(best)
                pinned.append(best)
            if best is not None and "mm" in row:  # image rows continue one at a time (multimodal positions)
                chunked.append(members)
            elif best is not None:
                (saved if best.pos == self._p(row) else grown).append(members)
                found.update((key, (best, version)) for _, _, key in members)  # a group shares its state's lookup
            elif self._plant_ok(members, batch_rows, waiting_rows):
                # with specialists a new state plants through the cache's chunked path (route-aware checkpoints)
                (chunked if self.specialists is not None else planting).append(members)
            else:
                self.counts["declined"] += 1
                plain += members
        later: list = []  # rows a batched call left
        follow: dict = {}  # memo key of a new state's first row -> the rows behind it (they continue once it planted)
        if self.cache.batch is not None:
            later += self._batched([m for g in saved for m in g] + [g[0] for g in grown], results, found)
            later += self._batched([m for g in grown for m in g[1:]], results)  # hits now, before the long forwards
            follow = {g[0][2]: g[1:] for g in planting if "mm" not in g[0][1] and len(g) > 1}
            chunked += [g[1:] for g in planting if "mm" in g[0][1]]
        else:
            chunked = saved + grown + chunked + [g[1:] for g in planting]
        later += self._plain(plain, results, [g[0] for g in planting], follow)
        for members in chunked + ([later] if later else []):
            self._one_by_one(members, results)

    def _one_by_one(self, members, results) -> None:
        """Rows through the cache one at a time (`_cached_group`); what it declines goes plain; a failure fails only
        these rows."""
        t0 = time.perf_counter()
        try:
            plain_later = self._cached_group(members, results)
        except RowError as e:  # an image that decoded when checked but not now
            plain_later = []
            for i, _, _ in members:
                if results[i] is None:
                    results[i] = self._error(e.code, e.message)
        except Exception as e:  # noqa: BLE001
            log.exception("cached path failed")
            plain_later = []
            for i, _, _ in members:
                if results[i] is None:
                    results[i] = self._error("internal", f"{type(e).__name__}: {e}")
        self._phase("one_by_one", len(members), t0)
        self._plain(plain_later, results)

    def _p(self, row) -> int:
        return self.cache.state_end(row["state_len"])

    def _limits(self) -> tuple:
        return self.vocab_size, self.max_row_tokens, id(self.tokenizer), id(self.images), id(self.answer_tokens)

    def _text_bound(self, tokenizer):
        """The TextBound (statecache.text) of this engine's tokenizer, found once per tokenizer (`tokenizer`: it or
        its copy, the same vocabulary)."""
        held = self.__dict__.get("_bound")
        if held is None or held[0] is not self.tokenizer:
            held = self._bound = (self.tokenizer, None if tokenizer is None else text_bound(tokenizer))
            log.info("text rows: %s", "no bound before tokenising (not a byte-level BPE)" if held[1] is None else
                     "a token covers at most %d letters or digits, %d whitespace, %d other ASCII, %d non-ASCII "
                     "characters (longer rows are too_long untokenised)" % held[1].per_token)
        return held[1]

    def check_aside(self, raw) -> CheckedRow | None:
        """A raw row checked (a text row tokenised) exactly as `answer` checks it, away from the engine's thread: a
        CheckedRow that `answer` then takes as it is (never tokenised twice), or None for a row with images (decoded
        on the engine's thread) and a row whose check raised something else than a RowError (the engine's thread
        gives its error). Safe beside the engine's thread: it reads only the vocabulary and the limits, and tokenises
        with a copy of the tokenizer of its own (a fast tokenizer's settings are not safe to share between threads);
        call it from one thread at a time (the worker's row thread, worker.prepare)."""
        if not isinstance(raw, dict) or raw.get("images"):
            return None
        held = self.__dict__.get("_aside")
        if held is None or held[0] is not self.tokenizer:
            import copy

            held = self._aside = (self.tokenizer, None if self.tokenizer is None else copy.deepcopy(self.tokenizer))
        limits = self._limits()
        try:
            row = check_row(raw, self.vocab_size, self.max_row_tokens, held[1], self.images, as_array=True,
                            answers=self.answer_tokens, bound=self._text_bound(held[1]))
        except RowError as e:
            return CheckedRow(None, (e.code, e.message), limits)
        except Exception:  # noqa: BLE001 - the engine's thread logs it and gives the error
            return None
        return CheckedRow(row, None, limits)

    def state_key(self, raw) -> tuple | None:
        """A row's state as the cache knows it, for routing (statecache.routing): (key tokens as an int64 array,
        p = its aligned end, state_len), as `_groups` and the index see them; None for a row the cache does not take
        (bad, not eligible) or one with images (their key tokens need the images decoded). raw: a raw row (checked
        here by `check_aside`, with its thread rules) or a CheckedRow."""
        checked = raw if isinstance(raw, CheckedRow) else self.check_aside(raw)
        if checked is None or checked.row is None:
            return None
        row = checked.row
        if not self.cache.eligible(row["state_len"], row["slots"]):
            return None
        return row["ids"], self._p(row), row["state_len"]

    def _batched(self, items, results, found=None) -> list:
        """Rows (i, row, memo key) that continue from saved states, through one StateCache.rows_batched call (each
        distinct row once) -> the rows it left (for the cache one at a time). found: memo key -> (checkpoint, index
        version) of the row's lookup (StateCache.rows_batched)."""
        todo, uniq = [], {}
        for i, row, key in items:
            if results[i] is not None:
                continue
            if (hit := self._memo(key)) is not None:
                results[i] = hit
            elif key in uniq:
                uniq[key][1].append(i)
            else:
                uniq[key] = (row, [i])
                todo.append(key)
        if not todo:
            return []
        t0 = time.perf_counter()
        try:
            answers = self.cache.rows_batched([(uniq[k][0]["ids"], uniq[k][0]["state_len"], uniq[k][0]["slots"],
                                                uniq[k][0]["options"]) for k in todo],
                                              None if not found else [found.get(k) for k in todo])
        except Exception:  # noqa: BLE001 - the rows go one at a time instead
            log.exception("batched rows failed")
            answers = [None] * len(todo)
        self._phase("batched", len(todo), t0)
        left = []
        for key, ans in zip(todo, answers):
            row, where = uniq[key]
            if ans is None:
                left += [(i, row, key) for i in where]
                continue
            res = self._result(ans)
            self.memo.put(key, res)
            for n, i in enumerate(where):
                results[i] = res if n == 0 else (self._memo(key) or dict(res, path="memo", reused=0, computed=0))
        return left

    def _groups(self, todo) -> tuple["OrderedDict[bytes, list]", list]:
        """Eligible rows by their aligned state tokens (rows that can share a checkpoint), in first-seen order;
        and the rows the cached path cannot take (for the plain path). The key is the bytes of the state's tokens
        as int64 (exact: equal bytes, equal tokens; a row's ids are an int64 array already, an image row's key
        tokens a list)."""
        groups: OrderedDict = OrderedDict()
        plain = []
        for item in todo:
            row = item[1]
            if not self.cache.eligible(row["state_len"], row["slots"]):
                plain.append(item)
                continue
            p = self._p(row)
            keys = row["mm"].keys if "mm" in row else row["ids"]
            groups.setdefault(as_ids(keys[:p]).tobytes(), []).append(item)
        return groups, plain

    def _plant_ok(self, members, batch_rows: int, waiting_rows: int) -> bool:
        """The cold_ok policy, asked once for a new state (the group's shared state)."""
        row = members[0][1]
        idx = self.cache.index
        ctx = ColdContext(state_tokens=self._p(row),
                          state_bytes=self.cache.state_bytes(row["state_len"]), budget_bytes=idx.budget_bytes,
                          used_bytes=idx.bytes, sharing_rows=len(members), batch_rows=batch_rows,
                          waiting_rows=max(0, int(waiting_rows or 0)), host_budget_bytes=idx.host_budget_bytes)
        return bool(self.cold_ok(ctx))

    def _cached_group(self, members, results) -> list:
        """Run a group's rows through the cache; returns those it declines (for the plain path)."""
        declined = []
        for i, row, key in members:
            if (hit := self._memo(key)) is not None:  # the same row twice in one batch
                results[i] = hit
                continue
            ans = self.cache.row(row["ids"], row["state_len"], row["slots"], row["options"], images=row.get("mm"))
            if ans is None:
                declined.append((i, row, key))
                continue
            res = self._result(ans)
            self.memo.put(key, res)
            results[i] = res
        return declined

    def _result(self, ans) -> dict:
        """A row's result from the cache's Answer (the route by its name, with specialists)."""
        res = {"probs": ans.probs, "path": ans.path, "reused": ans.reused, "computed": ans.computed}
        if ans.route is not None:
            res["route"] = self.specialists.names[ans.route]
        return res

    def _plain(self, items, results, planting=(), follow=None) -> list:
        """The plain path's forwards (statecache.plain) of `items` (nothing planted) and of `planting` (the first rows
        of new states: their checkpoints are planted, their path is "cold"), one forward at a time in the order
        `PlainPath.forwards` gives (packed in arrival order), each forward's answers handed back as soon as it ends. follow: memo key of a planting row -> the rows behind it,
        run batched right after their state is planted. Returns the rows those batched calls left."""
        unique: OrderedDict = OrderedDict()
        for i, row, key in planting:
            unique.setdefault(key, (row, [], True))[1].append(i)
        for i, row, key in items:
            unique.setdefault(key, (row, [], False))[1].append(i)
        if not unique:
            return []
        entries = list(unique.items())
        rows = [(r["ids"], r["slots"], r["options"], r.get("mm")) for _, (r, _, _) in entries]
        plans = [self._cold_plan(r) if plant else None for _, (r, _, plant) in entries]
        left: list = []
        for fwd in self.plain.forwards(rows):
            self._plain_forward([entries[k] for k in fwd], [rows[k] for k in fwd], [plans[k] for k in fwd], results)
            behind = [m for k in fwd for m in (follow or {}).get(entries[k][0], ())]
            if behind:
                left += self._batched(behind, results)
        return left

    def _cold_plan(self, row) -> list[int]:
        """The checkpoint positions a new state plants: the cache's plan, with its fork point (StateCache.fork_point:
        where it leaves a cached state's tokens) when it has one."""
        keys = row["mm"].keys if "mm" in row else row["ids"]
        return self.cache.plan(row["state_len"], fork=self.cache.fork_point(keys, self._p(row), 0))

    def _plain_forward(self, entries, rows, plans, results) -> None:
        """One forward of the plain path: entries (memo key, (row, result indices, plants)); a failure fails only
        its rows."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            outs, planted = self.plain.run(rows, plans)
        except RowError as e:  # an image that decoded when checked but not now: the rows of this forward fail
            for _, (_, idx, _) in entries:
                for i in idx:
                    results[i] = self._error(e.code, e.message)
            return
        except Exception as e:  # noqa: BLE001
            log.exception("plain path failed")
            for _, (_, idx, _) in entries:
                for i in idx:
                    results[i] = self._error("internal", f"{type(e).__name__}: {e}")
            return
        self._phase("packed", len(entries), t0, c0)
        for (key, (row, idx, plant)), (probs, route), pl in zip(entries, outs, planted):
            if plant:
                try:
                    keys = row["mm"].keys if "mm" in row else row["ids"]
                    self.cache.plant_planted(keys, len(row["ids"]), pl.snaps(), pl.K, pl.V)
                except Exception:  # noqa: BLE001 - the answer stands; only the planting is lost
                    log.exception("planting a packed row's checkpoints failed")
                res = {"probs": probs, "path": "cold", "reused": 0, "computed": len(row["ids"])}
            else:
                res = {"probs": probs, "path": "plain", "reused": 0, "computed": len(row["ids"])}
                self.counts["plain"] += 1
                self.counts["plain_tokens"] += len(row["ids"])
            if route is not None:
                res["route"] = self.specialists.names[route]
            self.memo.put(key, res)
            for k, i in enumerate(idx):
                results[i] = res if k == 0 else (self._memo(key) or dict(res, path="memo", reused=0, computed=0))

    def gpu_wait_s(self) -> float:
        """Seconds this engine's thread has spent blocked waiting for the GPU to finish forwards whose answers it reads
        (the chunk runner's, the batched runner's; not the plain path's packed forwards) since
        start-up: a row's time less this is its host work."""
        parts = [self.runner.stats, self.plain.stats] + ([self.cache.batch.stats] if self.cache.batch is not None else [])
        return sum(p.get("gpu_wait_s", 0.0) for p in parts)

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
        spec = {} if self.specialists is None else {"mispredict": c["mispredict"], "specialists": self.specialists.info()}
        return {**spec, **{k: v for k, v in self.counts.items() if k != "plain_tokens"}, "load_s": round(self.load_s, 3),
                "loaded_at": self.loaded_at, "precapture": self.precapture_info, "hits": c["hits"],
                "partial": c["partial"], "cold": c["cold"], "tokens_reused": c["tokens_reused"],
                "tokens_computed": c["tokens_computed"] + self.counts["plain_tokens"], "cache": c,
                "plain_graphs": dict(self.plain.stats, graphs=sum(g is not None for g in self.plain.graphs.values())),
                "budget": dataclasses.asdict(self.budget), "budget_rechecks": dict(self.memory), **self._device_memory(),
                "phases": {k: round(v, 3) if k.endswith("_s") else v for k, v in self.phases.items()},
                **({"steps": {**self.steps.stats, "seconds": {k: round(v, 3) for k, v in self.steps.seconds.items()},
                              "scheduler": dict(self.steps.sched.stats)}} if self.steps else {}),
                **({"vision": dict(self.embeddings.stats, cached=len(self.embeddings))} if self.embeddings else {})}

    def recheck_memory(self) -> int:
        """Re-size the cache's budget from the device's free memory now (statecache.budget.rebudget; CUDA, budget
        sized from the device): another process taking memory shrinks it, and what it no longer holds leaves the
        device (to the host tier where there is one) and goes back to the driver; memory given back grows it once it
        has stayed free for GROW_AFTER_S (a worker starting in a dead one's place gets it first).
        Returns the budget in MiB."""
        if self._reserved0 is None:
            return self.budget.mb
        free = device_free_bytes(self.device)
        mb = rebudget(self.budget_at_start, free, torch.cuda.memory_reserved(self.device) - self._reserved0)
        now = self.budget.mb
        self.memory["rechecks"] += 1
        if abs(mb - now) <= now // 50:  # within 2%: not worth a change
            self._grow_since = None
            return now
        if mb > now:  # memory given back: grown into only once it has stayed free for GROW_AFTER_S
            if self._grow_since is None:
                self._grow_since = _now()
                self.memory["grow_deferred"] += 1
                log.info("device memory free now %.0f MiB: the state cache's budget stays at %d MiB for %.0f s "
                         "(a worker starting beside this one may take it)", free / 2**20, now, GROW_AFTER_S)
            if _now() - self._grow_since < GROW_AFTER_S:
                return now
        self._grow_since = None
        index = self.cache.index
        index.budget_bytes = mb * 2**20
        self.cache.s.mb = mb
        self.budget = dataclasses.replace(self.budget, mb=mb, states_4k=self.budget_at_start.states_4k * mb
                                          / max(1, self.budget_at_start.mb), free_mb=free / 2**20, source="device, re-checked")
        if mb < now:
            self.memory["shrunk"] += 1
            self.cache.stats["evicted"] += len(index.evict())
            torch.cuda.empty_cache()  # what the cache let go of goes back to the driver, for the other process
        else:
            self.memory["grown"] += 1
        log.warning("device memory free now %.0f MiB: the state cache's budget goes from %d to %d MiB", free / 2**20,
                    now, mb)
        return mb

    def _device_memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        free, total = torch.cuda.mem_get_info(self.device)
        return {"device_memory_mb": {"allocated": mib(torch.cuda.memory_allocated(self.device)),
                                     "reserved": mib(torch.cuda.memory_reserved(self.device)),
                                     "peak_allocated": mib(torch.cuda.max_memory_allocated(self.device)),
                                     "free": mib(free), "total": mib(total)}}
