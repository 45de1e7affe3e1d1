"""Every setting of statecache, one typed object read from the environment in one place.

`Settings.from_env()` reads `REDIS_URL` and the `STATECACHE_*` variables (each field's `env` metadata), checks
their types and warns about `STATECACHE_*` variables it does not know (a typo would otherwise be ignored).
Everything else takes a `Settings` (or the values in it) as arguments: this is the only module of the
project that reads `os.environ` (tests/test_rules.py checks that). The settings table in docs/SETTINGS.md
lists these fields exactly (also checked).

Knows the variables, their types and defaults; knows nothing of the engine, arq or Redis beyond the names.
The cache's own defaults are those of statecache.cache.config.CacheSettings (torch-free, read here).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from statecache.cache.config import CacheSettings
from statecache.protocol import JOB_TIMEOUT_S, QUEUE_NAME, redact

log = logging.getLogger("statecache.settings")
PREFIX = "STATECACHE_"


def _f(default: Any, env: str, doc: str):
    return field(default=default, metadata={"env": env, "doc": doc})


@dataclass(frozen=True)
class Settings:
    # --- Redis and the queue
    redis_url: str = _f("redis://localhost:6379/0", "REDIS_URL", "Redis of the queue: any URL redis-py reads (redis://, rediss:// for TLS, unix://; password and user in the URL or as ?password=, ?username=)")
    queue: str = _f(QUEUE_NAME, "STATECACHE_QUEUE", "arq queue the worker serves (default: arq's own default queue)")
    # --- the model and the engine
    model: str | None = _f(None, "STATECACHE_MODEL", "Hugging Face Qwen3.5 checkpoint folder (default: the built-in tiny model)")
    device: str | None = _f(None, "STATECACHE_DEVICE", "cuda or cpu (default: cuda when available)")
    dtype: str | None = _f(None, "STATECACHE_DTYPE", "float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    home: str | None = _f(None, "STATECACHE_HOME", "where the built-in tiny model is written (default: ~/.cache/statecache)")
    engine: str = _f("statecache.engine:Engine.from_settings", "STATECACHE_ENGINE",
                     "import path `module:callable` that builds the engine; called with this Settings object")
    cold_ok: str = _f("", "STATECACHE_COLD_OK", "import path of the cold_ok policy (default: statecache.cache.policy.PlantWhenItFits)")
    compile: bool | None = _f(None, "STATECACHE_COMPILE", "torch.compile the elementwise kernels (default: on cuda)")
    precapture: bool = _f(True, "STATECACHE_PRECAPTURE", "capture every CUDA graph before serving (no-op on the CPU)")
    specialists: str | None = _f(None, "STATECACHE_SPECIALISTS", "specialists folder (router and one LoRA adapter per route; docs/SPECIALISTS.md; default: none)")
    batch: int = _f(64, "STATECACHE_BATCH", "most sequences (rows' pieces) one step's forward runs, at least 1 (a worker's never more than max_jobs)")
    max_row_tokens: int | None = _f(None, "STATECACHE_MAX_ROW_TOKENS", "longest row accepted, in tokens (default: the engine's)")
    step_tokens: int = _f(2048, "STATECACHE_STEP_TOKENS", "tokens one engine step runs at most (hits, grown states and new pages' chunks together): larger steps give more rows/s on a busy GPU, smaller ones answer hits sooner")
    step_tokens_busy: int = _f(3072, "STATECACHE_STEP_TOKENS_BUSY", "tokens a step runs at most while the engine holds three quarters of the rows a worker takes (max_jobs) or more: rows queue, and fuller steps answer more of them a second (a value below step_tokens counts as step_tokens)")
    # --- the state cache
    cache_mb: int | None = _f(None, "STATECACHE_CACHE_MB", "state cache budget in MiB; 0 turns the cache off (default: from the device)")
    cache_fraction: float = _f(CacheSettings.fraction, "STATECACHE_CACHE_FRACTION", "share of free device memory the cache may take when CACHE_MB is unset")
    host_cache_mb: int | None = _f(None, "STATECACHE_HOST_CACHE_MB", "host-memory tier for the states the device budget cannot keep, in MiB (on cuda pinned in 256 MiB slabs, one registered beside each forward after start-up, and kept); 0 turns it off (default: half the host's MemAvailable, at most 256 GiB; logged at start-up)")
    cache_stride: int = _f(CacheSettings.stride, "STATECACHE_CACHE_STRIDE", "a checkpoint at every multiple of this many tokens (0: none)")
    # --- the worker
    # 24: with steps of step_tokens_busy from 18 rows held, 64 agents 68.6-69.5 rows/s on an H100 against 66.0-66.6
    # with 2048-token steps and 16 jobs, p99 2.1-2.25 s (bench/README.md, "Busy steps through the worker"); more rows
    # than steps serve answer hits first and starve new pages (32 jobs: the same rows/s, p99 2.8 s)
    max_jobs: int = _f(24, "STATECACHE_MAX_JOBS", "jobs one worker takes from Redis at once; the rest wait there for any worker")
    poll_delay_s: float = _f(0.01, "STATECACHE_POLL_DELAY_S", "the routers poll the agents' queue, and arq each worker's own queue, this often (a job producer.Client enqueues wakes the routers at once)")
    job_timeout_s: float = _f(JOB_TIMEOUT_S, "STATECACHE_JOB_TIMEOUT_S", "a job's limit; a row not at the model by half of it goes back to the queue, never failed for waiting")
    drain_s: float = _f(30.0, "STATECACHE_DRAIN_S", "on SIGTERM: finish rows in flight for up to this long, then exit")
    health_interval_s: float = _f(5.0, "STATECACHE_HEALTH_INTERVAL_S", "the health key is refreshed this often")
    engine_stuck_s: float = _f(60.0, "STATECACHE_ENGINE_STUCK_S", "the engine counts as stuck when one step (a batch, or a piece of a long one) runs this long: the health key and worker_ready stop, the rows waiting go back to the queue (their tries kept) and the worker exits with status 70 (keep it under JOB_TIMEOUT_S; 0: never)")
    metrics_addr: str = _f("127.0.0.1", "STATECACHE_METRICS_ADDR", "address the metrics listen on (0.0.0.0: every interface, as in docker/compose.yaml)")
    metrics_port: int = _f(9400, "STATECACHE_METRICS_PORT", "Prometheus metrics on this port (0: off)")
    worker_id: str = _f("", "STATECACHE_WORKER_ID", "this worker's name among the workers of one queue (default: host name, process id and a random suffix)")
    route_ttl_s: float = _f(10.0, "STATECACHE_ROUTE_TTL_S", "a worker's heartbeat and advertised states expire this long after it stops refreshing them; its queued jobs then go to the others")
    route_shed_rows: int = _f(8, "STATECACHE_ROUTE_SHED_ROWS", "a row goes to the least loaded worker instead of the one holding its state when that one has this many more rows queued")
    route_grace_s: float = _f(5.0, "STATECACHE_ROUTE_GRACE_S", "an idle worker takes rows from another's queue that have waited this long")
    max_job_bytes: int = _f(16 * 2**20, "STATECACHE_MAX_JOB_BYTES", "larger job payloads are refused before decoding")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, warn_unknown: bool = True, **overrides: Any) -> "Settings":
        """The settings in `environ` (default: the process environment), then `overrides` (field names)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"], "").strip()
            if raw:
                values[f.name] = _parse(f.metadata["env"], raw, f.type)
        if warn_unknown:
            for name in unknown_variables(env):
                log.warning("unknown setting %s ignored (known: see `statecache.settings.Settings` or docs/SETTINGS.md)", name)
        return cls(**{**values, **overrides})

    def __repr__(self) -> str:  # the dataclass's own, less REDIS_URL's password (statecache.protocol.redact)
        shown = (f"{f.name}={repr(redact(self.redis_url) if f.name == 'redis_url' else getattr(self, f.name))}"
                 for f in dataclasses.fields(self))
        return f"Settings({', '.join(shown)})"

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    @property
    def step_sequences(self) -> int:
        """The most sequences one step's forward runs in a worker: `batch`, but never more than the rows a worker
        holds (`max_jobs`, one row a job; a row is one sequence of a step): forwards of more are never run, so their
        CUDA graphs are not captured (fewer graphs, a shorter start-up)."""
        return max(1, min(self.batch, self.max_jobs))

    def cache_settings(self) -> CacheSettings:
        """The cache's settings (statecache.cache.config.CacheSettings): these budgets and stride, the rest (tail,
        alignment, the shortest state cached, the most slots a cached row has) its own constants."""
        kw: dict[str, Any] = dict(stride=self.cache_stride, mb=self.cache_mb, fraction=self.cache_fraction)
        if self.host_cache_mb is not None:
            kw["host_mb"] = self.host_cache_mb
        return CacheSettings(**kw)


def _parse(name: str, raw: str, typ: Any) -> Any:
    t = str(typ)
    try:
        if "bool" in t:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if "int" in t:
            return int(raw)
        if "float" in t:
            return float(raw)
        return raw
    except ValueError:
        kind = "bool" if "bool" in t else "int" if "int" in t else "float"
        raise ValueError(f"{name}={raw!r} is not a valid {kind}") from None


def env_names() -> dict[str, str]:
    """Environment variable -> field name."""
    return {f.metadata["env"]: f.name for f in dataclasses.fields(Settings)}


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    known = env_names()
    return sorted(k for k in env if k.startswith(PREFIX) and k not in known)


def table() -> list[tuple[str, str, Any, str]]:
    """(variable, field, default, what it does) for every setting, as docs/SETTINGS.md lists them."""
    return [(f.metadata["env"], f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(Settings)]


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    return f"`{value}`"


def markdown_table() -> str:
    """The settings table of docs/SETTINGS.md (tests/test_rules.py checks that file carries exactly this)."""
    lines = ["| variable | setting | default | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{env}` | `{name}` | {_show(default)} | {doc} |" for env, name, default, doc in table()]
    return "\n".join(lines)


def statecache_home() -> Path:
    """``$STATECACHE_HOME`` alone (the tiny model's and the compile caches' folder), else ``~/.cache/statecache``,
    without reading or checking the other settings."""
    return Path(os.environ.get("STATECACHE_HOME") or Path.home() / ".cache" / "statecache")


def setdefault_env(values: Mapping[str, str]) -> dict[str, str]:
    """Set each variable of `values` the environment leaves unset (other libraries' settings, e.g. the compile
    caches' folders: statecache.run.compile_cache); returns each as it now stands."""
    for name, value in values.items():
        if not os.environ.get(name):
            os.environ[name] = value
    return {name: os.environ[name] for name in values}


def is_set(name: str) -> bool:
    """Whether the environment sets `name` (to something not blank)."""
    return bool(os.environ.get(name, "").strip())


def child_env(**overrides: Any) -> dict[str, str]:
    """This process's environment with `overrides` (variable names), for a worker started as a subprocess."""
    return {**os.environ, **{k: str(v) for k, v in overrides.items() if v is not None}}
