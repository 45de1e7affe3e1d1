"""The worker's Prometheus metrics (`STATECACHE_METRICS_PORT`, `GET /metrics`), named as operators know them from
vLLM and SGLang (`<engine>:<what>_<unit>`).

Per row, from the results the GPU thread hands back (so the counts equal the rows answered):
  statecache:rows_total{path}                 rows answered, by path (memo, hit, partial, cold, plain; error)
  statecache:row_errors_total{code}           rows answered with an error result, by code
  statecache:tokens_reused_total              tokens restored from saved states
  statecache:tokens_computed_total            tokens run through the model
  statecache:batch_size_rows                  histogram: rows per engine call
  statecache:row_latency_seconds{path}        histogram: enqueue to answer, by path
  statecache:queue_time_seconds               histogram: enqueue to the row reaching the model
  statecache:engine_time_seconds              histogram: the engine time of the batch the row was in
From the last `engine.stats()` snapshot (read defensively: absent keys read as 0):
  statecache:cache_used_bytes, statecache:cache_budget_bytes (the sized budget, statecache.cache.budget),
  statecache:cache_budget_states_4k, statecache:cache_checkpoints, statecache:cache_evictions_total,
  statecache:graph_captures_total, statecache:graph_capture_seconds_total (the batched runner's graphs;
  precapture included), statecache:batched_forwards_total, statecache:batched_sequences_total (batched
  continuations, statecache.run.batch), statecache:engine_load_seconds (weights), statecache:precapture_seconds,
  statecache:device_memory_bytes{kind} (allocated, reserved, peak_allocated, free, total; CUDA only),
  statecache:cache_tier_bytes{tier}, statecache:cache_tier_checkpoints{tier} (device, host),
  statecache:cache_restores_total{tier}, statecache:cache_tier_evictions_total{tier,reason},
  statecache:cache_host_copies_back_total, statecache:cache_host_copy_back_seconds_total,
  statecache:cache_tokens_lost_total (recomputed though a cached state shared them: no checkpoint there)
From the worker:
  statecache:queue_waiting_rows               ready jobs in Redis nobody took + rows queued for the GPU thread
  statecache:worker_ready                     1 once the engine is built (graphs captured) and jobs are taken
  statecache:redis_up                         0 while Redis does not answer
  statecache:routed_rows_total{reason}        rows this worker's dispatcher sent on (worker.routing): to the worker
                                              holding their state (affinity), to their home (home), away from a
                                              backed-up worker (shed), to the least loaded (least_loaded)
  statecache:rows_shed_total                  of those, rows kept off the worker that held (or was home to) their state
  statecache:rows_taken_total                 rows this worker took, idle, from another worker's queue
  statecache:workers_live                     live workers on this queue, as this worker last saw them
  statecache:cache_inert                      1 when nothing was planted or reused over the last
                                              `inert_rows` rows the cache was asked about, or it has no budget
                                              (also a warning in the log)

Knows prometheus_client and the shape of results and engine stats; does not know Redis, arq or the model.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("statecache.worker")

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
INERT_ROWS = 200  # the cache is inert when this many rows it was asked about planted and reused nothing


def _num(d: Any, *keys: str) -> float:
    """d[k0][k1]... as a number, 0 when any level is missing or not a number."""
    for k in keys:
        if not isinstance(d, dict):
            return 0.0
        d = d.get(k)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else 0.0


def engine_figures(stats: dict) -> dict:
    """The figures the metrics and the demo read from `engine.stats()`."""
    stats = stats if isinstance(stats, dict) else {}
    cache = stats.get("cache", {})
    budget = _num(stats, "budget", "mb") * 2**20 or _num(cache, "budget_bytes") or _num(cache, "mb") * 2**20
    return {
        "cache_used_bytes": _num(cache, "bytes"),
        "cache_budget_bytes": budget,
        "cache_budget_states_4k": _num(stats, "budget", "states_4k"),
        "cache_checkpoints": _num(cache, "checkpoints"),
        "cache_evictions": _num(cache, "evicted"),
        "graph_captures": _num(stats, "batch", "captures"),
        "graph_capture_seconds": _num(stats, "batch", "capture_s"),
        "batched_forwards": _num(stats, "batch", "forwards"),
        "batched_sequences": _num(stats, "batch", "sequences"),
        "engine_load_seconds": _num(stats, "load_s"),
        "precapture_seconds": _num(stats, "precapture", "batch", "seconds"),
        "device_memory_bytes": {k: _num(stats, "device_memory_mb", k) * 2**20
                                for k in ("allocated", "reserved", "peak_allocated", "free", "total")
                                if isinstance(stats.get("device_memory_mb"), dict) and k in stats["device_memory_mb"]},
        # rows the cache was asked about, and of those the ones that planted or reused a state
        "cache_rows": _num(cache, "rows"),
        "cache_used_rows": _num(cache, "hits") + _num(cache, "partial") + _num(cache, "cold"),
        # the two tiers (statecache.cache.index, statecache.cache.tiers): per tier its bytes and checkpoints, restores by tier,
        # copies back and their milliseconds, evictions by tier and reason, tokens lost for want of a checkpoint
        "tier_bytes": {"device": _num(cache, "bytes"), "host": _num(cache, "host_bytes")},
        "tier_checkpoints": {"device": _num(cache, "device_checkpoints"), "host": _num(cache, "host_checkpoints")},
        "tier_restores": {"device": _num(cache, "restored_device"), "host": _num(cache, "restored_host")},
        "host_copies_back": _num(cache, "host", "copies_up"),
        "host_copy_back_seconds": _num(cache, "host", "up_ms") / 1e3,
        "tier_evictions": {(tier, reason): _num(cache, "tiers", key) for tier, reason, key in (
            ("device", "to_host", "demoted"), ("device", "dropped", "dropped_device"), ("host", "dropped", "dropped_host"),
            ("device", "replaced", "replaced"))},
        "tokens_lost_no_checkpoint": _num(cache, "tokens_lost"),
    }


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        f = engine_figures(self._stats() or {})
        for name, doc in (("cache_used_bytes", "bytes the state cache holds"),
                          ("cache_budget_bytes", "the state cache's budget in bytes"),
                          ("cache_budget_states_4k", "new 4k-token states the cache's budget holds"),
                          ("cache_checkpoints", "saved states the cache holds"),
                          ("engine_load_seconds", "seconds the engine took to load its weights"),
                          ("precapture_seconds", "seconds the start-up capture of CUDA graphs took")):
            yield GaugeMetricFamily(f"statecache:{name}", doc, value=f[name])
        for name, key, doc in (("cache_evictions", "cache_evictions", "saved states evicted from the cache"),
                               ("graph_captures", "graph_captures", "CUDA graphs captured"),
                               ("graph_capture_seconds", "graph_capture_seconds", "seconds spent capturing CUDA graphs"),
                               ("batched_forwards", "batched_forwards", "batched forwards of rows continuing saved states"),
                               ("batched_sequences", "batched_sequences", "rows run in batched forwards")):
            yield CounterMetricFamily(f"statecache:{name}", doc, value=f[key])
        for name, key, doc in (("cache_tier_bytes", "tier_bytes", "bytes the state cache holds, by tier"),
                               ("cache_tier_checkpoints", "tier_checkpoints", "saved states the cache holds, by tier")):
            g = GaugeMetricFamily(f"statecache:{name}", doc, labels=["tier"])
            for tier, value in f[key].items():
                g.add_metric([tier], value)
            yield g
        restores = CounterMetricFamily("statecache:cache_restores", "rows continued from a saved state, by the tier it was on",
                                       labels=["tier"])
        for tier, value in f["tier_restores"].items():
            restores.add_metric([tier], value)
        yield restores
        ev = CounterMetricFamily("statecache:cache_tier_evictions", "saved states leaving a tier, by tier and reason "
                                 "(to_host: moved to the host tier; dropped; replaced by a new one of the same tokens)",
                                 labels=["tier", "reason"])
        for (tier, reason), value in f["tier_evictions"].items():
            ev.add_metric([tier, reason], value)
        yield ev
        for name, key, doc in (("cache_host_copies_back", "host_copies_back", "saved states copied back from the host tier"),
                               ("cache_host_copy_back_seconds", "host_copy_back_seconds", "seconds those copies took"),
                               ("cache_tokens_lost", "tokens_lost_no_checkpoint",
                                "tokens recomputed that a cached state shared with the row: no checkpoint at the deepest "
                                "shared position")):
            yield CounterMetricFamily(f"statecache:{name}", doc, value=f[key])
        if f["device_memory_bytes"]:
            mem = GaugeMetricFamily("statecache:device_memory_bytes", "the device's memory, by kind", labels=["kind"])
            for kind, value in f["device_memory_bytes"].items():
                mem.add_metric([kind], value)
            yield mem

    def describe(self):
        return []


class WorkerMetrics:
    def __init__(self, engine_stats: Callable[[], dict] = dict, inert_rows: int = INERT_ROWS):
        r = self.registry = CollectorRegistry()
        self.rows = Counter("statecache:rows", "rows answered, by path (error: an error result)", ["path"], registry=r)
        self.row_errors = Counter("statecache:row_errors", "rows answered with an error result, by code", ["code"], registry=r)
        self.tokens_reused = Counter("statecache:tokens_reused", "tokens restored from saved states", registry=r)
        self.tokens_computed = Counter("statecache:tokens_computed", "tokens run through the model", registry=r)
        self.batch_rows = Histogram("statecache:batch_size_rows", "rows per engine call", buckets=BATCH_BUCKETS, registry=r)
        self.latency = Histogram("statecache:row_latency_seconds", "enqueue to answer, by path", ["path"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("statecache:queue_time_seconds", "enqueue to the row reaching the model",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.engine_time = Histogram("statecache:engine_time_seconds", "engine time of the batch a row was in",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("statecache:queue_waiting_rows", "ready jobs in Redis nobody took + rows queued for the GPU thread",
                             registry=r)
        self.routed = Counter("statecache:routed_rows", "rows this worker's dispatcher sent on, by reason", ["reason"],
                              registry=r)
        self.shed = Counter("statecache:rows_shed", "rows kept off the worker holding their state (backed up)", registry=r)
        self.taken = Counter("statecache:rows_taken", "rows taken, idle, from another worker's queue", registry=r)
        self.workers_live = Gauge("statecache:workers_live", "live workers on this queue", registry=r)
        self.ready = Gauge("statecache:worker_ready", "1 once the engine is built, graphs captured, and jobs are taken", registry=r)
        self.redis_up = Gauge("statecache:redis_up", "1 while Redis answers", registry=r)
        self.inert = Gauge("statecache:cache_inert", "1 when the cache planted and reused nothing lately, or has no budget",
                           registry=r)
        for path in ("memo", "hit", "partial", "cold", "plain", "error"):
            self.rows.labels(path)  # every path present from the start, at 0
        self.redis_up.set(1)
        r.register(_EngineCollector(engine_stats))
        self.inert_rows = inert_rows
        self._timing = {"rows": 0, "queue_s": 0.0, "at_model_s": 0.0, "engine_s": 0.0}  # running sums (timing())
        self._since_use = (0.0, 0.0)  # (cache rows, used rows) when the cache last planted or reused
        self._inert_logged = False
        self.server = None

    # --- updates (any thread: prometheus_client's metrics are thread-safe) --------------------------------

    def batch(self, results: list, stats: dict) -> None:
        """After an engine call: its size and the cache's state."""
        self.batch_rows.observe(len(results))
        self._check_inert(stats)

    def row(self, result: Any, enqueued_at: float | None, reached_at: float, engine_s: float, done_at: float) -> None:
        """One row answered (`*_at`: time.time())."""
        if isinstance(result, dict) and "error" in result:
            path = "error"
            err = result["error"]
            self.row_errors.labels(str(err.get("code") if isinstance(err, dict) else "unknown")).inc()
        else:
            path = str(result.get("path", "unknown")) if isinstance(result, dict) else "unknown"
            self.tokens_reused.inc(max(0, int(result.get("reused", 0) or 0)))
            self.tokens_computed.inc(max(0, int(result.get("computed", 0) or 0)))
        self.rows.labels(path).inc()
        if reached_at:
            self.engine_time.observe(engine_s)
        if enqueued_at:
            self.latency.labels(path).observe(max(0.0, done_at - enqueued_at))
            if reached_at:
                self.queue_time.observe(max(0.0, reached_at - enqueued_at))
                t = self._timing
                t["rows"] += 1
                t["queue_s"] += max(0.0, reached_at - enqueued_at)
                t["at_model_s"] += max(0.0, done_at - reached_at)
                t["engine_s"] += engine_s

    def timing(self) -> dict:
        """Mean seconds per answered row since start: enqueue to reaching the model (`queue_s`), reaching it to the
        job holding its answer (`at_model_s`: the engine's work and the hand-back to the event loop) and the engine
        time of its batch (or until it was answered early: `engine_s`). Where a row's latency goes, in one look."""
        t = dict(self._timing)
        n = t.pop("rows")
        return {"rows": n, **{f"{k}_mean": round(v / n, 4) if n else None for k, v in t.items()}}

    def _check_inert(self, stats: dict) -> None:
        f = engine_figures(stats)
        rows, used = f["cache_rows"], f["cache_used_rows"]
        last_rows, last_used = self._since_use
        if used > last_used or rows < last_rows:
            self._since_use = (rows, used)
            last_rows = rows
        reason = None
        if f["cache_budget_bytes"] <= 0:
            reason = "the cache has no budget (STATECACHE_CACHE_MB=0?)"
        elif rows - last_rows >= self.inert_rows:
            reason = f"the last {int(rows - last_rows)} rows the cache was asked about planted and reused nothing"
        self.inert.set(1 if reason else 0)
        if reason and not self._inert_logged:
            log.warning("the state cache is inert: %s; rows run uncached (path plain; raise STATECACHE_CACHE_MB?)", reason)
        self._inert_logged = bool(reason)

    # --- serving ------------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str) -> int | None:
        """Serve /metrics on `addr`:`port` (port 0: not at all); the port, or None when it could not be bound."""
        if not port:
            return None
        from prometheus_client import start_http_server

        try:
            self.server, _ = start_http_server(port, addr, registry=self.registry)
        except OSError as e:
            log.warning("metrics not served: %s port %d: %s", addr, port, e)
            return None
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
