"""bench/load_bench.py's trace and its unbounded-cache reference (the benchmark itself runs on the device)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _step_sim():
    """bench/step_sim.py as a module (with load_bench, whose trace it replays)."""
    _bench()
    spec = importlib.util.spec_from_file_location("step_sim", ROOT / "bench" / "step_sim.py")
    S = importlib.util.module_from_spec(spec)
    sys.modules["step_sim"] = S
    spec.loader.exec_module(S)
    return S


def _bench():
    spec = importlib.util.spec_from_file_location("load_bench", ROOT / "bench" / "load_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_unbounded_reuse_by_hand():
    L = _bench()
    rng = random.Random(0)
    state = [rng.randrange(100, 500) for _ in range(300)]
    rows = [L.Row(0, state + [1, 2], 300, [301], [2]),  # new
            L.Row(0, state + [3, 4, 5], 300, [302], [3]),  # same state: its end, 300
            L.Row(0, state + [7] * 100 + [1], 400, [400], [2]),  # grown: the old state's end, 300
            L.Row(0, state[:150] + [9] * 250 + [1], 400, [400], [2]),  # middle change at 150 -> 128
            L.Row(1, state + [1], 300, [300], [2])]  # another agent: never shares
    assert L.unbounded_reuse(rows) == [0, 300, 300, 128, 0]


def test_trace_shape():
    L = _bench()
    tr = L.AgentTrace(3, seed=5, vocab=(10, 1000), min_state=2000, max_state=6000)
    rows = tr.interleaved(120)
    assert rows == L.AgentTrace(3, seed=5, vocab=(10, 1000)).interleaved(120)  # seeded
    for r in rows:
        assert 2000 <= r.state_len <= 6000 and 10 <= len(r.ids) - r.state_len <= 90
        assert 1 <= len(r.slots) <= 2 and all(r.state_len <= s < len(r.ids) for s in r.slots)
        assert all(10 <= t < 1000 for t in r.ids) and all(2 <= k <= 6 for k in r.nopts)
    moves = sum((a.moves for a in tr.agents), L.Counter())
    assert moves["grow"] > moves["replace"] > 0
    reuse = L.unbounded_reuse(rows)
    assert sum(reuse) > 0.8 * sum(r.state_len for r in rows[3:]) * 0.8


def test_steady_summary_leaves_the_warm_up_out():
    """Latency counts the rows sent after the warm-up; rows/s the answers that came after it, over the timed stretch;
    the whole run is kept beside (`from_start`)."""
    L = _bench()

    def rec(sent, ms, path="hit", error=None):
        r = L.Record(0, 100, 110, ms, path, sent_s=sent, done_s=sent + ms / 1e3, error=error)
        r.ideal = r.reused = 0
        return r

    records = [rec(0.0, 10500, "cold"),  # a synchronised first visit: sent in the warm-up, answered after it
               rec(1.0, 100), rec(4.5, 100),  # both in the warm-up
               rec(9.5, 1000, "partial"),  # sent in the warm-up, answered in the timed stretch
               rec(11.0, 200), rec(12.0, 300), rec(13.0, 100, error="AnswerTimeout")]
    s = L.steady_summary(records, 20.0, 10.0)
    assert s["rows"] == 2 and s["failed"] == 1 and s["paths"]["hit"] == 2 and s["paths"].get("cold", 0) == 0
    assert s["latency"]["p99_ms"] == 300.0
    assert s["rows_per_s"] == round(4 / 10.0, 3)  # the cold, the partial and the two hits answered after 10 s
    assert s["from_start"]["rows"] == 6 and s["from_start"]["latency"]["p99_ms"] == 10500.0
    assert s["from_start"]["rows_per_s"] == round(6 / 20.0, 3)
    whole = L.steady_summary(records, 20.0, 0.0)
    assert whole["rows"] == 6 and "from_start" not in whole


def test_new_page_rows_are_each_new_pages_first_question():
    """Row.new_page marks exactly the first row of an agent's first visit and of each visit after its page was
    replaced: the row whose state shares no earlier row's page (the rows `latency_new_page` counts)."""
    L = _bench()
    tr = L.AgentTrace(2, seed=7, vocab=(10, 1000), min_state=2000, max_state=6000)
    rows = tr.interleaved(200)
    last: dict[int, list[int]] = {}
    for r in rows:
        state = r.ids[: r.state_len]
        prev = last.get(r.agent)
        continues = prev is not None and state[: len(prev)] == prev  # the same state, or grown at its end
        assert r.new_page == (not continues), (r.agent, r.state_len)
        last[r.agent] = state
    assert 0 < sum(r.new_page for r in rows) < len(rows) / 4
    recs = [L.Record(r.agent, r.state_len, len(r.ids), 100.0 + 900.0 * r.new_page, "partial", new_page=r.new_page)
            for r in rows]
    for rec in recs:
        rec.ideal = rec.reused = 0
    s = L.summarise(recs, 10.0)
    assert s["latency_new_page"]["n"] == sum(r.new_page for r in rows) and s["latency_new_page"]["p50_ms"] == 1000.0


def test_tokens_computed_a_row_and_device_time_a_token():
    """tokens_computed_per_row: the answered rows' tokens less those reused, a row; device_us_per_computed_token: GPU
    busy over rows/s times that (None without a GPU or rows)."""
    L = _bench()
    recs = []
    for n, reused in ((1000, 900), (500, 0), (2000, 1900)):
        r = L.Record(0, n - 10, n, 50.0, "hit")
        r.ideal, r.reused = reused, reused
        recs.append(r)
    failed = L.Record(0, 90, 100, 50.0, None, error="AnswerTimeout")
    failed.ideal = failed.reused = 0
    s = L.summarise(recs + [failed], 10.0)
    assert s["tokens_computed_per_row"] == round((100 + 500 + 100) / 3)  # 233; the failed row counts nothing
    s["gpu_busy_pct"] = 50.0
    assert L.device_us_per_token(s) == round(0.5 * 1e6 / (0.3 * 233), 1)
    assert L.device_us_per_token({**s, "gpu_busy_pct": None}) is None
    assert L.summarise([], 10.0)["tokens_computed_per_row"] is None


def test_padding_reads_the_runner_counts():
    L = _bench()
    s = {"worker_stats": {"engine": {"batch": {"tokens": 1500, "padded_tokens": 2048}}}}
    assert L.padding(s) == "1500 / 2048 (26.8% padding)"
    assert L.padding({"worker_stats": {"engine": {}}}) is None
    s["worker_stats"]["engine"]["batch"]["buckets"] = {"1536": [1, 1100], "512": [1, 400]}
    assert L.padding(s) == "1500 / 2048 (26.8% padding); by bucket 1536: 1 forwards 28.4%, 512: 1 forwards 21.9%"


def test_load_bench_reads_the_device_idle_between_steps_off_the_step_log():
    """load_bench's device_idle: the gaps between steps (statecache.step.STEP_LOG_FIELDS' gap_ms) against the steps'
    device time, over a config's own last steps; the first step's gap (None) left out; a log without gaps gives
    None."""
    L = _bench()
    from statecache.step import STEP_LOG_FIELDS

    f = list(STEP_LOG_FIELDS)
    step = lambda ms, gap: [dict(device_ms=ms, gap_ms=gap).get(k, 1) for k in f]  # noqa: E731
    log = [step(50.0, None), step(50.0, 0.5), step(40.0, 10.0), step(30.0, 2.0)]
    cfg = {"worker_stats": {"engine": {"step_log": {"fields": f, "steps": log}}}}
    assert L.device_idle(cfg) == {"steps": 3, "idle_pct": round(100 * 12.5 / 132.5, 2), "gap_p50_ms": 2.0,
                                  "gaps_over_1ms": 2}
    assert L.device_idle(cfg, 2) == {"steps": 2, "idle_pct": round(100 * 12 / 82, 2), "gap_p50_ms": 10.0,
                                     "gaps_over_1ms": 2}
    assert L.device_idle(cfg, 0) is None  # no step of this config logged
    cfg["worker_stats"]["engine"]["step_log"] = {"fields": f[:-1], "steps": [r[:-1] for r in log]}
    assert L.device_idle(cfg) is None  # a tree before gap_ms


def test_the_simulator_plants_fork_points_as_the_engine_does():
    """bench/step_sim.py replays load_bench's trace through the real scheduler; a new page after the same goal and
    steps restores the agent's shared head from the checkpoint planted where an earlier new page left it (the fork
    point, statecache.cache.index.CheckpointIndex.fork_point), as the engine does, so hardly a row is cold beside the agents' first
    visits (here 8 of 1,578 rows; without the fork points 134 of 1,255)."""
    S = _step_sim()
    model, _ = S.fit()
    agents = S.Agents(4, S.trace_seed(0, 0), 0.02, 16)
    S.run_steps(agents, model, 20.0, 2048, 512, 512, True)
    paths = [p for _, _, p, _, _ in agents.records]
    assert len(paths) > 1000 and paths.count("cold") < 0.02 * len(paths), paths.count("cold")
    assert paths.count("partial") > 0.2 * len(paths)


def test_the_simulator_reads_its_cost_model_off_the_steps_a_worker_logged(tmp_path):
    """step_sim --fit-log: a step's device ms is the median of the logged steps of its padded tokens (buckets of
    fewer than LOG_BUCKET_STEPS steps left out), linear between buckets, the smallest's below them and the last two's
    slope above them; the model charges a step at its token bucket."""
    import json

    S = _step_sim()
    from statecache.step import STEP_LOG_FIELDS

    rng = random.Random(3)
    log, n = [], S.LOG_BUCKET_STEPS | 1  # steps a bucket, an odd count
    for padded, ms in ((256, 10.0), (512, 16.0), (1024, 29.0), (2048, 57.0)):
        for k in range(n):  # a median of ms, whatever else the steps hold
            log.append([rng.randint(1, 8), padded - 7, padded, rng.randint(1, padded), rng.uniform(0.1, 20),
                        ms + (k - n // 2) * rng.uniform(0.1, 0.5)])
    log.append([1, 3000, 3072, 3000, 1.0, 500.0])  # one step alone is no point of the table
    cfg = {"worker_stats": {"engine": {"step_log": {"fields": list(STEP_LOG_FIELDS), "steps": log}}}}
    (tmp_path / "results.json").write_text(json.dumps({"worker": {"configs": {"16": cfg}}}))
    model, info = S.fit_log([tmp_path / "results.json"])
    assert info["steps"] == 4 * n + 1 and model.padded
    assert [(k, round(ms, 6)) for k, ms in model.table] == [(256, 10.0), (512, 16.0), (1024, 29.0), (2048, 57.0)]
    assert model.graph_ms([(0, 200), (4000, 50)]) == 10.0  # 250 tokens: the 256 bucket
    assert model.graph_ms([(0, 40)]) == 10.0  # below the table: its first point
    assert model.table_ms(768) == 22.5 and model.table_ms(3072) == 85.0  # between points; above: the last slope
    with pytest.raises(SystemExit, match="token buckets"):
        cfg["worker_stats"]["engine"]["step_log"]["steps"] = log[:n] + log[-1:]
        (tmp_path / "results.json").write_text(json.dumps({"worker": {"configs": {"16": cfg}}}))
        S.fit_log([tmp_path / "results.json"])


def test_the_simulators_busy_budget_gives_fuller_steps_only_while_the_scheduler_holds_that_many_rows():
    """step_sim --busy-budget TOKENS@ROWS: a step planned while the scheduler holds at least ROWS rows gets TOKENS;
    with ROWS beyond what the agents can send the steps are those of the plain budget, with ROWS 1 they are fuller."""
    S = _step_sim()
    model, _ = S.fit()

    def per_step(busy):
        agents = S.Agents(16, S.trace_seed(0, 0), 0.02, 16)
        return S.run_steps(agents, model, 6.0, 1024, 512, 512, True, busy_budget=busy)["tokens_per_step"]

    plain, never, always = per_step(None), per_step((3072, 10**6)), per_step((3072, 1))
    assert never == plain and always > 1.2 * plain, (plain, never, always)


def test_the_simulator_fits_the_gpu_threads_host_time_from_the_engines_step_seconds(tmp_path):
    """step_sim --host-ms fit: launch (plan + restore + forward) and finish (the turn's busy time less launch and the
    waits for the device, `read` and `wait`) a step, each a + b * pieces, from each config's counters less the config's
    before it (the worker's counters run from its start). A run before `wait` was counted had it inside `done`: there
    `done` less `plant` is taken as the wait, and the fit is the same."""
    import json

    S = _step_sim()

    def counters(steps, launch_ms, finish_ms, read_ms, wait_ms, wait_in_done):
        sec = {"plan": 0.1 * launch_ms * steps / 1e3, "restore": 0.2 * launch_ms * steps / 1e3,
               "forward": 0.7 * launch_ms * steps / 1e3, "read": read_ms * steps / 1e3, "evict": 0.0}
        if wait_in_done:  # planting is host time inside done
            sec.update(done=(wait_ms + 0.5) * steps / 1e3, plant=0.5 * steps / 1e3)
        else:
            sec.update(wait=wait_ms * steps / 1e3, done=0.5 * steps / 1e3, plant=0.5 * steps / 1e3)
        return sec, (launch_ms + finish_ms + read_ms + wait_ms) * steps / 1e3

    def fit(wait_in_done):
        configs, total, acc = {}, {"steps": 0, "pieces": 0, "busy": 0.0}, {}
        for agents, steps, per in (("4", 1000, 2.0), ("16", 500, 6.0), ("64", 400, 10.0)):
            sec, busy = counters(steps, 3.0 + 1.5 * per, 2.5 + 1.75 * per, 7.0, 9.0 / per, wait_in_done)
            acc = {k: acc.get(k, 0.0) + sec[k] for k in sec}
            total = {"steps": total["steps"] + steps, "pieces": total["pieces"] + steps * per,
                     "busy": total["busy"] + busy}
            configs[agents] = {"worker_stats": {
                "engine": {"steps": {"steps": total["steps"], "pieces": total["pieces"], "seconds": dict(acc)}},
                "worker": {"busy_s": total["busy"]}}}
        out = tmp_path / f"{wait_in_done}" / "load1664" / "results.json"
        out.parent.mkdir(parents=True)
        out.write_text(json.dumps({"worker": {"configs": configs}}))
        return S.host_fit([out])

    for wait_in_done in (False, True):
        host, points = fit(wait_in_done)
        assert [round(1e3 * h, 6) for h in host] == [3.0, 2.5, 1.5, 1.75]
        assert [(round(k, 6), round(la, 6), round(fi, 6)) for _, k, la, fi in points] == [
            (2.0, 6.0, 6.0), (6.0, 12.0, 13.0), (10.0, 18.0, 20.0)]
        assert all(label.endswith("(done as wait)") == wait_in_done for label, *_ in points), points


def test_the_simulators_gpu_thread_puts_its_host_time_on_a_lone_rows_path():
    """With the GPU thread's host time (run_steps host_s), one agent's row waits for its step's launch and finish
    beside the device: each hit takes that much longer than with the host off the path, and the device idles for it."""
    S = _step_sim()
    model, _ = S.fit()

    def run(host):
        agents = S.Agents(1, S.trace_seed(0, 0), 0.0)
        info = S.run_steps(agents, model, 10.0, 2048, 512, 512, True, host_s=host)
        hits = sorted(b - a for a, b, p, _, _ in agents.records if p == "hit")
        return hits[len(hits) // 2], info["busy_s"] / info["end_s"]

    (free, busy_free), (held, busy_held) = run(None), run((0.004, 0.003, 0.001, 0.001))
    assert abs(held - free - 0.009) < 0.002, (free, held)  # launch 4 + 1 a piece, finish 3 + 1: one piece a step
    assert busy_held < busy_free
