"""The engine: rows in (`submit`), answered a step at a time (`step`); the one object the worker's GPU thread drives.

`submit(rows, tags)` checks each row (text rows tokenised; a CheckedRow, checked beside the engine's thread by
`check_aside`, is taken as it is), answers bad rows and exact repeats (the memo) at once, and hands the rest to the
step loop (statecache.step.Steps over statecache.sched.Scheduler): a row equal to one already scheduled waits for its
answer. `step()` runs one step: the scheduler fills a token budget with hits, grown states and chunks of new pages,
the batched runner (statecache.run.batch) runs them as packed forwards, each sequence from its own state, and the rows
whose last piece ran are answered; states are planted as their pieces pass their checkpoint positions, and a row
whose state another row is computing waits for it. Whether a new state is planted is the `cold_ok` policy's decision
(statecache.cache.policy), asked once per new state; `waiting_rows` (the caller's view of its queue) only informs it.
`answer(rows)` is both, stepped until every row is answered (what `statecache score` and the tests use).

Rows with images (checkpoints with a vision tower: statecache.rows.images, statecache.run.images) go through the step loop too:
their memo and group keys include each image's content hash, the index knows their states by key tokens, and a piece
holding image tokens runs in an eager forward of its own. So do rows with specialists (`specialists=`: every result
then names its `route`): each runs with a route, guessed until its router has spoken over the whole row, and one the
router disagrees with runs again with the router's route (statecache.step). A row whose checkpoint could not be
brought back (`retry`) is scheduled again, in the end from nothing; a row with more answer slots at one position than a piece holds runs
as several rows of the same tokens, its answers put back together (`_split`). `uncached(rows)` runs rows through the
same step loop without the cache (no lookup, no planting, no memo): what a cached answer must equal.

A bad row gets an error result; a failing forward fails only its row (the step loop halves it until the failing
piece stands alone). Not thread-safe: one thread drives it.
Knows nothing of Redis or asyncio.
"""
from __future__ import annotations

import dataclasses
import logging
import string
import time

import torch

from statecache.cache.budget import (Budget, DeviceTooSmall, cache_budget, check_fits,
                                     device_free_bytes, forward_workspace_bytes, rebudget)
from statecache.cache.config import CacheSettings
from statecache.cache.policy import ColdPolicy, PlantWhenItFits, load_policy
from statecache.cache.store import Answer, StateCache
from statecache.kernels.dispatch import kernels_for
from statecache.model.config import load_config
from statecache.model.forward import Qwen35
from statecache.model.loader import load_weights
from statecache.model.specialists import load_specialists
from statecache.protocol import error_result
from statecache.rows.check import CheckedRow, RowError, check_row
from statecache.rows.memo import Memo, row_key
from statecache.rows.text import answer_tokens, text_bound
from statecache.run.batch import CHUNK, MAX_PIECE, TOKENS, BatchRunner, bucket
from statecache.run.compile_cache import use_persistent_caches
from statecache.sched import slots_at_one_position
from statecache.step import BUDGET_TOKENS, CHUNK_TOKENS, STEP_LOG_FIELDS, RowFailed, Steps

log = logging.getLogger("statecache.engine")
LETTERS = list(string.ascii_uppercase)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


MEMORY_CHECK_S = 2.0  # how often a step re-checks the device's free memory (statecache.cache.budget.rebudget)
# how long memory given back must stay free before the budget grows into it: a worker started in place of one that
# died (a rolling restart, a crash loop's next try) loads its weights and sizes its cache within about a minute
# (57 s with warm compile caches on an H100, bench/README.md); a survivor growing at once took that memory and the
# new worker refused to start (s41_run3)
GROW_AFTER_S = 120.0
# a row given back by its step (`retry`: its checkpoint could not come back to the device budget, which the other
# restores of that step held) is looked up and scheduled again this many times, then runs once from nothing
RETRIES_CACHED = 4
MEMO_ENTRIES = 4096  # answers kept by memo key: a job delivered again is answered without running
MAX_ROW_TOKENS = 32768  # the longest row by default (STATECACHE_MAX_ROW_TOKENS)


def _now() -> float:
    return time.monotonic()


class _Laps:
    """Start-up's clock: each call records the seconds since the last one under its name (in `into`)."""

    def __init__(self, into: dict[str, float]):
        self.into, self.t0 = into, time.perf_counter()
        self.last = self.t0

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round(now - self.last, 3)
        self.last = now

    def total(self) -> float:
        return self.last - self.t0


class Engine:
    def __init__(self, model_dir=None, device: str | None = None, dtype: str | None = None, *,
                 settings: CacheSettings | None = None, specialists=None, cold_ok: ColdPolicy | None = None,
                 compile: bool | None = None, precapture: bool = False, batch: int = 64,
                 max_row_tokens: int = MAX_ROW_TOKENS, step_tokens: int = BUDGET_TOKENS, step_chunk: int = CHUNK_TOKENS,
                 busy_tokens: int | None = None):
        """The model (a checkpoint folder; default: the built-in tiny model) on `device` in `dtype`; the cache as
        `settings` says (its budget None, the default: sized from the device's free memory once the forwards are in
        place); a specialists folder; the policy for which new states are planted; torch.compile of the elementwise
        kernels (default: on CUDA) and CUDA graphs captured before serving; the step loop's shape (sequences a
        forward, longest row, tokens a step, a new page's chunk; `busy_tokens`: a step's tokens while the engine holds
        most of `batch` rows, statecache.step.Steps). `from_settings` builds it from the service's `Settings`."""
        if model_dir is None:
            from statecache.dev.tiny import tiny_model_dir

            model_dir = tiny_model_dir()
        self.model_dir = str(model_dir)
        self.device = torch.device(device or default_device())
        # seconds of each part of building the engine, in order (logged at the end, in `stats`: where start-up goes)
        self.startup_s: dict[str, float] = {}
        lap = _Laps(self.startup_s)
        if self.device.type == "cuda":
            use_persistent_caches()  # before anything compiles or autotunes (from_settings names the home first)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r}: use float32 or bfloat16")
        self.dtype = getattr(torch, dtype)
        import transformers  # noqa: F401 - its import timed apart from the tokenizer's load (load_tokenizer's)
        lap("transformers")
        self.tokenizer = load_tokenizer(self.model_dir)
        ids = self.tokenizer.convert_tokens_to_ids(LETTERS)
        unk = self.tokenizer.unk_token_id
        if any(i is None or (unk is not None and i == unk) for i in ids):
            raise ValueError(f"the tokenizer in {self.model_dir} lacks single tokens for the letters A-Z")
        self.letter_ids: list[int] = list(ids)  # what a token row's `nopts` reads: the first letters, bare
        # a text row's slots read the letters as the tokenizer writes them there (" A" after a cue): found once, checked
        self.answer_tokens = answer_tokens(self.tokenizer)
        lap("tokenizer")
        # specialists (a folder, statecache.model.specialists.folder): checked in full before the model's weights load
        self.specialists = None if specialists is None else load_specialists(
            specialists, load_config(self.model_dir), self.device, self.dtype)
        try:
            weights = load_weights(self.model_dir, self.letter_ids, self.device, self.dtype)
        except torch.OutOfMemoryError as e:
            free = device_free_bytes(self.device)
            raise DeviceTooSmall(f"the weights of {self.model_dir} in {dtype} did not fit {self.device} "
                                 f"({(free or 0) / 2**20:.0f} MiB free after the attempt): give the worker a device "
                                 f"nothing else holds, or a larger one ({str(e).splitlines()[0][:300]})") from None
        self.loaded_at = time.time()  # wall clock: start-up is measured from here (bench/load_bench.py)
        lap("weights")
        self.load_s = self.startup_s["weights"]  # the specialists' and the weights' load
        self.model = Qwen35(weights)
        if compile is None:  # fused elementwise kernels on the GPU (measured on an H200, 9B shape: bench/README.md)
            compile = self.device.type == "cuda"
        if compile:
            self.model.compile_elementwise()
        self.vocab_size = weights.cfg.vocab_size
        lap("compile")
        self.kernels = kernels_for(self.device, compile)  # on CUDA: the Triton kernels' import, two kernel checks
        lap("kernels")
        settings = settings or CacheSettings()
        if settings.align % CHUNK:
            raise ValueError(f"the cache's alignment {settings.align} must be a multiple of {CHUNK} (the delta rule's "
                             "chunk, where the step loop keeps states)")
        if batch < 1:
            raise ValueError(f"batch {batch}: the step loop runs at least one sequence a forward")
        # the step loop's runner takes rows up to the longest a row may be (its key span only sizes kernel splits);
        # its forwards hold at most a step's tokens (a question piece longer than the step runs alone: a longest piece)
        top = max(step_tokens, busy_tokens or 0, MAX_PIECE)
        self.runner = self._batch_runner(max(4, settings.max_slots), batch, max_row_tokens, bucket(top, TOKENS) or top)
        st = self.runner.st
        self.cache = StateCache(settings, self.device, checkpoint_bytes=st.checkpoint_bytes(),
                                position_bytes=st.position_bytes())
        # image rows (a checkpoint with a vision tower and an image processor): known before start-up captures
        from statecache.rows.images import ImageSupport

        self.images = ImageSupport.for_model(self.model_dir, self.tokenizer)
        lap("runner")
        self.precapture_info = None
        if precapture and self.runner.use_graphs:
            self.precapture_info = {"batch": self.runner.precapture()}
            log.info("precaptured %d batch graphs in %.1f s", self.precapture_info["batch"]["graphs"],
                     self.precapture_info["batch"]["seconds"])
        lap("precapture")
        # image rows: the vision tower loads before the cache's budget is sized from the memory left
        self.embeddings = None
        if self.images is not None:
            from statecache.model.vision import VisionTower
            from statecache.run.images import Embeddings

            self.embeddings = Embeddings(self.images, VisionTower.from_checkpoint(self.model_dir, self.device, self.dtype))
        self._reserved0: int | None = None  # set by _size_cache where the budget comes from the device
        self.budget = self._size_cache(settings, self.runner.max_tokens)
        self.budget_at_start = self.budget
        self.memory = {"rechecks": 0, "shrunk": 0, "grown": 0, "grow_deferred": 0}  # the budget re-checked while serving
        self._grow_since: float | None = None  # when the free memory first allowed a larger budget (recheck_memory)
        self._recheck_at = 0.0
        self.memo = Memo(MEMO_ENTRIES)
        self.max_row_tokens = max_row_tokens
        self.cold_ok: ColdPolicy = cold_ok if cold_ok is not None else PlantWhenItFits()
        self.counts = {"rows": 0, "memo": 0, "plain": 0, "errors": 0, "batches": 0, "plain_tokens": 0, "declined": 0,
                       "retried": 0, "split": 0}
        # wall seconds of `step` calls, the rows they finished, this thread's CPU seconds in them and steps launched
        self.phases = {"step_s": 0, "step_rows": 0, "step_cpu_s": 0, "steps": 0}
        self.steps = Steps(self.cache, self.runner, self.cold_ok, budget_tokens=step_tokens, chunk_tokens=step_chunk,
                           busy_tokens=busy_tokens, rows_held=batch)
        self._flight: dict = {}  # memo key of a scheduled row -> the tags waiting for it (the first is its own)
        self._wholes: dict = {}  # a split row's key -> its _Whole (its parts in the schedule: `_schedule`)
        self._retried: dict = {}  # key of a row given back -> its tries so far (`step`)
        if self.cache.host is not None:  # start-up's captures are done: the host tier prepares its slabs meanwhile
            self.cache.host.start()
        lap("budget")
        log.info("engine built in %.1f s (%s)", lap.total(),
                 ", ".join(f"{name} {sec:.1f} s" for name, sec in self.startup_s.items()))

    def _size_cache(self, settings: CacheSettings, largest: int) -> Budget:
        """The cache's bound (statecache.cache.budget): the settings' figure, else on CUDA a fraction of the memory free
        now (weights, static buffers and captured graphs are in place) less the largest forward's workspace, else the
        CPU default. Logged in MiB and in 4k-token states."""
        cfg, nbytes = self.model.cfg, torch.tensor([], dtype=self.dtype).element_size()
        free = workspace = None
        auto = settings.mb is None
        if auto and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # blocks cached after start-up's warm-ups and captures count as free (graphs keep theirs)
            free = device_free_bytes(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            workspace = max(forward_workspace_bytes(cfg, largest, nbytes), peak)
            check_fits(f"the largest forward ({largest} tokens)", workspace, free, "give the worker a device nothing "
                       "else holds, or lower STATECACHE_MAX_ROW_TOKENS")
            self._reserved0 = torch.cuda.memory_reserved(self.device)  # what rebudget counts this process's own from
        budget = cache_budget(cfg, nbytes, setting_mb=settings.mb, free_bytes=free,
                              workspace_bytes=workspace or 0, fraction=settings.fraction,
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
        The cache's budget: `cache_mb` when set, else sized from the device (`cache_fraction` of its free memory).
        The home (the tiny model, the compile caches) is the settings' own."""
        from statecache.settings import Settings

        s = settings if settings is not None else Settings.from_env()
        if torch.device(s.device or default_device()).type == "cuda":
            use_persistent_caches(s.home)  # before the engine compiles anything
        model = s.model
        if model is None:
            from statecache.dev.tiny import tiny_model_dir

            model = tiny_model_dir(s.home)
        args = dict(settings=s.cache_settings(), compile=s.compile, precapture=s.precapture,
                    cold_ok=load_policy(s.cold_ok), specialists=s.specialists, batch=s.step_sequences,
                    step_tokens=s.step_tokens, busy_tokens=s.step_tokens_busy)
        if s.max_row_tokens is not None:
            args["max_row_tokens"] = s.max_row_tokens
        return cls(model, s.device, s.dtype, **{**args, **kw})

    def _batch_runner(self, max_slots: int, max_batch: int, max_keys: int, max_tokens: int) -> BatchRunner:
        """The step loop's runner (statecache.run.batch): CUDA graphs over statecache's Triton kernels where they serve
        this model and device, else the same forwards eagerly (the CPU; a model whose shapes the Triton kernels do not
        take runs eagerly on the GPU too, slowly). With specialists each sequence runs with its own route."""
        kw = dict(max_slots=max_slots, max_batch=max_batch, max_tokens=max_tokens, max_pos=max_keys,
                  specialists=self.specialists)
        try:
            return BatchRunner(self.model, self.kernels, **kw)
        except ValueError as e:
            log.warning("the batched runner runs eagerly: %s", e)
            return BatchRunner(self.model, self.kernels, graphs=False, triton=False, **kw)

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
        error) and memo answers. The others join the schedule; `step` answers them. A row equal to one already
        scheduled is answered with it (path "memo")."""
        if len(tags) != len(rows):
            raise ValueError(f"{len(tags)} tags for {len(rows)} rows")
        self.counts["batches"] += 1
        out: list = []
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
            else:
                self._flight[key] = [tag]
                self._schedule(key, row)
        return out

    def uncached(self, rows: list, *, results: bool = False) -> list:
        """Each row's probabilities (one list per slot) from the same step loop without the cache: no lookup, nothing
        planted, no memo; what a cached answer must equal (results=True: each row's whole result, its route with
        specialists). Runs on an empty schedule; a bad row raises ValueError."""
        if self.pending():
            raise RuntimeError("uncached() needs an empty schedule (step the rows in it to their end first)")
        for i, raw in enumerate(rows):
            got = self._prepare(i, raw)
            if isinstance(got, dict):
                raise ValueError(f"row {i}: {got}")
            key = _Uncached(i)
            self._flight[key] = [i]
            self._schedule(key, got[0], fresh=True)
        out: list = [None] * len(rows)
        while self.pending():
            for i, res in self.step():
                out[i] = res
        for i, res in enumerate(out):
            if "probs" not in res:
                raise RuntimeError(f"row {i} failed: {res}")
        return out if results else [res["probs"] for res in out]

    def pending(self) -> int:
        """Rows in the schedule (`step` has work)."""
        return self.steps.pending()

    def _schedule(self, key, row: dict, fresh: bool = False) -> None:
        """A checked row into the step loop; one with more slots at one position than a piece holds as parts."""
        if slots_at_one_position(row["slots"]) > self.runner.max_slots:
            self.counts["split"] += 1
            parts = _split(row, self.runner.max_slots)
            self._wholes[key] = _Whole([idx for idx, _ in parts])
            for k, (_, part) in enumerate(parts):
                self.steps.add(_Part(key, k), part, fresh=fresh)
            return
        self.steps.add(key, row, fresh=fresh)

    def step(self) -> list[tuple]:
        """Launch the schedule's next step and finish the one before it (statecache.step.Steps: the device runs one
        step while the host prepares the next) -> (tag, result) for each row that finished. A row whose run was
        given back (`retry`: its checkpoint could not come back to the device) is scheduled again (RETRIES_CACHED
        times, then from nothing; given back once more, it fails)."""
        if not self.steps.pending():
            return []
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._reserved0 is not None and t0 >= self._recheck_at:
            self._recheck_at = t0 + MEMORY_CHECK_S
            self.recheck_memory()
        declined, launched = self.steps.sched.stats["declined"], self.steps.stats["steps"]
        done = self.steps.step()
        self.counts["declined"] += self.steps.sched.stats["declined"] - declined
        self.phases["steps"] += self.steps.stats["steps"] - launched  # steps launched (a call may only finish one)
        out = []
        for key, ans in done:
            if isinstance(ans, RowFailed) and ans.code == "retry":
                tries = self._retried.get(key, 0)
                if tries <= RETRIES_CACHED:  # looked up again (the restores it competed with are done), then fresh
                    self.counts["retried"] += 1
                    self._retried[key] = tries + 1
                    self.steps.add(key, ans.row, fresh=tries == RETRIES_CACHED)
                    continue
            self._retried.pop(key, None)
            if isinstance(key, _Part):
                key, ans = self._joined(key, ans)
                if key is None:
                    continue
            tags = self._flight.pop(key)
            if isinstance(ans, RowFailed):
                res = self._error("internal" if ans.code == "retry" else ans.code, ans.message)
            else:
                res = self._result(ans)
                if isinstance(key, _Uncached):
                    out.append((tags[0], res))
                    continue
                if ans.path == "plain":
                    self.counts["plain"] += 1
                    self.counts["plain_tokens"] += ans.computed
                self.memo.put(key, res)
            out.append((tags[0], res))
            out += [(tag, self._memo(key) or self._repeat(res)) for tag in tags[1:]]
        self._phase("step", len(out), t0, c0)
        return out

    def _joined(self, part: "_Part", ans):
        """A part of a split row finished -> (the whole's key, its Answer or RowFailed) once every part has, else
        (None, None)."""
        whole = self._wholes[part.key]
        whole.got[part.k] = ans
        if any(a is None for a in whole.got):
            return None, None
        del self._wholes[part.key]
        failed = [a for a in whole.got if isinstance(a, RowFailed)]
        if failed:
            return part.key, failed[0]
        probs: list = [None] * sum(len(idx) for idx in whole.slots)
        for idx, a in zip(whole.slots, whole.got):
            for j, pr in zip(idx, a.probs):
                probs[j] = pr
        first = whole.got[0]
        return part.key, Answer(probs, first.path, first.reused, sum(a.computed for a in whole.got), whole.got[-1].route)

    def clear_schedule(self) -> list[tuple]:
        """Give up every row in the schedule (a step raised past its own isolation) -> the tags that waited on them."""
        self.steps.clear()
        tags = [tag for waiting in self._flight.values() for tag in waiting]
        self._flight.clear()
        self._wholes.clear()
        self._retried.clear()
        return tags

    def _repeat(self, res: dict) -> dict:
        if "probs" not in res:
            return dict(res)
        self.counts["memo"] += 1
        return dict(res, path="memo", reused=0, computed=0)

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
                from statecache.run.images import RowImages

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

    def _p(self, row) -> int:
        return self.cache.state_end(row["state_len"])

    def _limits(self) -> tuple:
        return self.vocab_size, self.max_row_tokens, id(self.tokenizer), id(self.images), id(self.answer_tokens)

    def _text_bound(self, tokenizer):
        """The TextBound (statecache.rows.text) of this engine's tokenizer, found once per tokenizer (`tokenizer`: it or
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
        """A row's state as the cache knows it, for routing (statecache.cache.routing): (key tokens as an int64 array,
        p = where its deepest checkpoint sits, state_len), as `_groups` and the index see them; None for a row the
        cache does not take (bad, not eligible) or one with images (their key tokens need the images decoded). raw: a raw row (checked
        here by `check_aside`, with its thread rules) or a CheckedRow."""
        checked = raw if isinstance(raw, CheckedRow) else self.check_aside(raw)
        if checked is None or checked.row is None:
            return None
        row = checked.row
        if not self.cache.eligible(row["state_len"], row["slots"]):
            return None
        return row["ids"], self._p(row), row["state_len"]

    def _result(self, ans) -> dict:
        """A row's result from the cache's Answer (the route by its name, with specialists)."""
        res = {"probs": ans.probs, "path": ans.path, "reused": ans.reused, "computed": ans.computed}
        if ans.route is not None:
            res["route"] = self.specialists.names[ans.route]
        return res

    def gpu_wait_s(self) -> float:
        """Seconds this engine's thread has spent blocked waiting for the GPU to finish forwards whose answers it reads
        since start-up: a row's time less this is its host work."""
        return self.runner.stats.get("gpu_wait_s", 0.0)

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
                "loaded_at": self.loaded_at, "startup_s": dict(self.startup_s), "precapture": self.precapture_info,
                "hits": c["hits"], "partial": c["partial"], "cold": c["cold"], "tokens_reused": c["tokens_reused"],
                "tokens_computed": c["tokens_computed"] + self.counts["plain_tokens"], "cache": c,
                "batch": dict(self.runner.stats, failed=self.runner.failures[:3]),
                "budget": dataclasses.asdict(self.budget), "budget_rechecks": dict(self.memory), **self._device_memory(),
                "phases": {k: round(v, 3) if k.endswith("_s") else v for k, v in self.phases.items()},
                "steps": {**self.steps.stats, "seconds": {k: round(v, 3) for k, v in self.steps.seconds.items()},
                          "scheduler": dict(self.steps.sched.stats)},
                **({"vision": dict(self.embeddings.stats, cached=len(self.embeddings))} if self.embeddings else {})}

    def details(self) -> dict:
        """What a look inside adds to `stats()`, apart from it because the worker snapshots `stats()` after every
        batch: the last steps the loop ran (statecache.step.Steps.log: their shapes and device times, by
        STEP_LOG_FIELDS) and, on CUDA, the caching allocator's calls to the driver (a request it could not serve from
        its blocks frees them and asks again, `alloc_retries`; freeing device memory waits for the whole device,
        `device_frees` and `syncs`: the stalls the allocator puts between steps)."""
        out: dict = {"step_log": {"fields": list(STEP_LOG_FIELDS), "steps": [list(x) for x in self.steps.log]}}
        if self.device.type == "cuda":
            ms = torch.cuda.memory_stats_as_nested_dict(self.device)
            out["allocator"] = {"alloc_retries": ms.get("num_alloc_retries", 0), "ooms": ms.get("num_ooms", 0),
                                "device_allocs": ms.get("num_device_alloc", 0),
                                "device_frees": ms.get("num_device_free", 0), "syncs": ms.get("num_sync_all_streams", 0)}
        return out

    def recheck_memory(self) -> int:
        """Re-size the cache's budget from the device's free memory now (statecache.cache.budget.rebudget; CUDA, budget
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


@dataclasses.dataclass(frozen=True)
class _Uncached:
    """The key of a row `uncached` runs: its index there (never a memo key)."""

    i: int


@dataclasses.dataclass(frozen=True)
class _Part:
    """The key of part k of a split row (`_split`) whose own key is `key`."""

    key: object
    k: int


@dataclasses.dataclass
class _Whole:
    slots: list  # per part, the indices of the row's slots it answers
    got: list = dataclasses.field(default_factory=list)  # per part, its Answer or RowFailed once finished

    def __post_init__(self):
        self.got = [None] * len(self.slots)


def _split(row: dict, max_slots: int) -> list[tuple[list[int], dict]]:
    """A row with more than max_slots slots at one position as parts of the same tokens, each holding at most
    max_slots slots at any position (the k-th slot at a position goes to part k // max_slots): [(the row's slot
    indices it answers, the part)]. The parts share their state: the first plants it, the others continue from it."""
    seen: dict = {}
    parts: dict = {}
    for j, s in enumerate(row["slots"]):
        k = seen.get(int(s), 0)
        seen[int(s)] = k + 1
        parts.setdefault(k // max_slots, []).append(j)
    out = []
    for k in sorted(parts):
        idx = parts[k]
        out.append((idx, dict(row, slots=[row["slots"][j] for j in idx], options=[row["options"][j] for j in idx])))
    return out
