"""The routing's moves (worker.routing: assign, take, hand back, recover, the orphan scan, arq's start and finish of
a job) as a hypothesis state machine against a real Redis and the real Lua scripts, run by real `Router` objects, with
worker deaths (SIGKILL: the process gone, its heartbeat expiring later), pauses (SIGSTOP: the heartbeat expires, the
worker comes back), stops (SIGTERM: stop, drain, close) interleaved anywhere. arq's own steps on a worker's private
queue (start: the in-progress mark; finish: the result stored, the id off its queue; the after-job hook) are the few
Redis commands arq sends, written out here.

The invariant, after every step: every id without a result is in QUEUE, and either ready there and in no private
queue, or parked there and in exactly one private queue; a stopping worker's queue holds only ids it had started
before it was told to stop; an ASSIGN or MOVE that succeeded put the id on a live worker's queue. And once any
running worker has beaten and scanned for orphans (`settle`): every parked id without a result is on the queue of a
worker whose process runs (live, or draining what it started)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis as redis_sync
import redis.asyncio as redis_async
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from statecache.cache.routing import FingerprintLedger
from statecache.protocol import (IN_PROGRESS_KEY_PREFIX, JOB_KEY_PREFIX, RESULT_KEY_PREFIX, draining_key, live_key,
                                 private_queue, workers_key)
from statecache.settings import Settings
from tests.harness import IdleGpu, answer_job
from worker.routing import PARKED_MS, Router


def make_machine(url: str):
    class RoutingMoves(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.q = f"statecache:moves:{uuid.uuid4().hex[:10]}"
            self.r = redis_sync.Redis.from_url(url)
            self.ar = redis_async.Redis.from_url(url)
            self.settings = Settings(redis_url=url, queue=self.q, metrics_port=0, route_ttl_s=60, route_grace_s=0,
                                     route_shed_rows=1000, health_interval_s=1)
            self.routers: dict[str, Router] = {}
            self.state: dict[str, str] = {}  # worker -> running | stopping | paused | dead
            self.started: dict[str, set[str]] = {}  # worker -> ids it has started (its arq's in-progress marks)
            self.before_stop: dict[str, set[str]] = {}  # stopping worker -> ids started before the stop
            self.ids: list[str] = []

        def run_after(self):
            pass

        def run(self, coro):
            return self.loop.run_until_complete(coro)

        def teardown(self):
            self.run_after()
            keys = list(self.r.scan_iter(match=f"*{self.q}*")) + [k for j in self.ids for k in (
                JOB_KEY_PREFIX + j, RESULT_KEY_PREFIX + j, IN_PROGRESS_KEY_PREFIX + j)]
            if keys:
                self.r.delete(*keys)
            self.run(self.ar.aclose())
            self.loop.close()
            self.r.close()

        def workers(self, *states: str) -> list[str]:
            return sorted(w for w, s in self.state.items() if s in states)

        def pick(self, data, *states: str) -> str | None:
            ws = self.workers(*states)
            return data.draw(st.sampled_from(ws)) if ws else None

        def queue_of(self, w: str) -> set[str]:
            return {m.decode() for m in self.r.zrange(private_queue(self.q, w), 0, -1)}

        # ---- producers and workers coming and going ----------------------------------------------------------------

        @rule()
        def enqueue(self):
            j = uuid.uuid4().hex[:12]
            self.r.set(JOB_KEY_PREFIX + j, answer_job(len(self.ids)))
            self.r.zadd(self.q, {j: int(time.time() * 1000) - 1000})
            self.ids.append(j)

        @precondition(lambda self: len(self.state) < 5)
        @rule()
        def start_worker(self):
            w = f"w{len(self.state)}"
            self.routers[w] = Router(self.ar, self.settings, w, IdleGpu(), FingerprintLedger(64))
            self.state[w], self.started[w] = "running", set()
            self.run(self.routers[w].beat())

        @rule(data=st.data())
        def sigkill(self, data):
            """The process ends; its heartbeat stays until it expires (`expire`)."""
            w = self.pick(data, "running", "stopping")
            if w:
                self.state[w] = "dead"

        @rule(data=st.data())
        def expire(self, data):
            """A heartbeat's TTL runs out: a dead worker's, or a paused (SIGSTOPped) one's."""
            w = self.pick(data, "dead", "paused", "running")
            if w:
                self.r.delete(live_key(self.q, w), draining_key(self.q, w))
                if self.state[w] == "running":
                    self.state[w] = "paused"

        @rule(data=st.data())
        def resume(self, data):
            """SIGCONT: the paused worker's loop beats again; what it had started it still runs."""
            w = self.pick(data, "paused")
            if w:
                self.state[w] = "running"
                self.run(self.routers[w].beat())

        @rule(data=st.data())
        def sigterm(self, data):
            w = self.pick(data, "running")
            if w:
                self.run(self.routers[w].stop())
                self.state[w] = "stopping"
                self.before_stop[w] = set(self.started[w])

        @rule(data=st.data())
        def close(self, data):
            """arq's drain is over: its jobs are cancelled (the in-progress marks go, the ids stay on its queue), then
            on_shutdown closes the router and the process exits."""
            w = self.pick(data, "stopping")
            if w:
                for j in self.started[w]:
                    self.r.delete(IN_PROGRESS_KEY_PREFIX + j)
                self.started[w] = set()
                self.run(self.routers[w].close())
                self.state[w] = "dead"

        # ---- the router's moves ---------------------------------------------------------------------------------

        @rule(data=st.data())
        def beat(self, data):
            w = self.pick(data, "running", "stopping")
            if w:
                self.run(self.routers[w].beat())

        @rule(data=st.data())
        def dispatch(self, data):
            """A round of dispatch from a view that may be stale (the last beat's live list, any workers in it)."""
            w = self.pick(data, "running")
            if w:
                router = self.routers[w]
                router.live = sorted(set(router.live) | set(data.draw(st.sets(st.sampled_from(sorted(self.state))))))
                before = {v: self.queue_of(v) for v in self.state}
                self.run(router.dispatch())
                for v in self.state:
                    if self.queue_of(v) - before[v]:
                        assert self.r.exists(live_key(self.q, v)), f"an id went to {v}, which is not live"

        @rule(data=st.data())
        def assign_from_an_older_view(self, data):
            """One ASSIGN of a dispatch whose view of the live workers was read before a death (any worker)."""
            w = self.pick(data, "running")
            ready = [m.decode() for m in self.r.zrangebyscore(self.q, "-inf", int(time.time() * 1000))]
            if w and ready:
                j = data.draw(st.sampled_from(sorted(ready)))
                target = data.draw(st.sampled_from(sorted(self.state)))
                if self.run(self.routers[w].assign(j, target)) == 1:
                    assert self.r.exists(live_key(self.q, target)), f"{j} went to {target}, which is not live"

        @rule(data=st.data())
        def take(self, data):
            w = self.pick(data, "running", "stopping")
            if w:
                router = self.routers[w]
                router.live = sorted(self.state)
                before = self.queue_of(w)
                self.run(router.take_idle())
                if self.queue_of(w) - before:
                    assert self.r.exists(live_key(self.q, w)), f"{w} took ids while not live"

        @rule(data=st.data())
        def hand_back(self, data):
            w = self.pick(data, "stopping")
            if w:
                self.run(self.routers[w].hand_back())

        @rule(data=st.data())
        def orphans(self, data):
            w = self.pick(data, "running", "stopping")
            if w:
                self.run(self.routers[w].recover_orphans(set()))

        @rule(data=st.data())
        def lose_the_workers_set(self, data):
            """Redis came back from a snapshot taken before the workers set held everyone (or a hand's DEL)."""
            if data.draw(st.booleans()):
                self.r.delete(workers_key(self.q))

        # ---- arq on a worker's own queue ----------------------------------------------------------------------

        @rule(data=st.data())
        def arq_start(self, data):
            w = self.pick(data, "running", "stopping")
            if w is None:
                return
            q = private_queue(self.q, w)
            ready = [m.decode() for m in self.r.zrangebyscore(q, "-inf", int(time.time() * 1000))]
            if self.state[w] == "stopping" or not ready:
                return  # arq stops picking jobs at the signal
            j = data.draw(st.sampled_from(sorted(ready)))
            with self.r.pipeline() as p:  # arq's start: WATCH the mark, check it and the score, MULTI PSETEX
                p.watch(IN_PROGRESS_KEY_PREFIX + j)
                if p.exists(IN_PROGRESS_KEY_PREFIX + j) or not p.zscore(q, j):
                    return
                p.multi()
                p.psetex(IN_PROGRESS_KEY_PREFIX + j, 60_000, b"1")
                p.execute()
            self.started[w].add(j)

        @rule(data=st.data())
        def arq_finish(self, data):
            """arq's finish_job (result stored, the id off its own queue, the mark gone), then its after_job_end hook
            (`Router.finished`), or a death between the two."""
            w = self.pick(data, "running", "stopping")
            if w is None or not self.started[w]:
                return
            j = data.draw(st.sampled_from(sorted(self.started[w])))
            self.started[w].discard(j)
            with self.r.pipeline() as p:
                p.set(RESULT_KEY_PREFIX + j, b"done", px=600_000)
                p.delete(IN_PROGRESS_KEY_PREFIX + j, JOB_KEY_PREFIX + j)
                p.zrem(private_queue(self.q, w), j)
                p.execute()
            if data.draw(st.booleans()):
                self.run(self.routers[w].finished(j))

        # ---- what must hold ---------------------------------------------------------------------------------------

        @invariant()
        def every_unanswered_id_is_parked_on_one_queue_or_ready(self):
            queues = {w: self.queue_of(w) for w in self.state}
            for j in self.ids:
                if self.r.exists(RESULT_KEY_PREFIX + j):
                    continue
                score = self.r.zscore(self.q, j)
                on = [w for w, ids in queues.items() if j in ids]
                assert score is not None, f"{j} (no result) left QUEUE; on {on}"
                if score >= PARKED_MS:
                    assert len(on) == 1, f"{j} parked, on {on}"
                else:
                    assert not on, f"{j} ready in QUEUE and on {on}"
            for w in self.workers("stopping"):
                assert queues[w] <= self.before_stop[w], f"{w} got ids after it was told to stop"

        @invariant()
        def settled_every_parked_id_is_on_a_running_workers_queue(self):
            ws = self.workers("running", "stopping")
            if not ws:
                return
            router = self.routers[ws[0]]
            self.run(router.beat())
            self.run(router.recover_orphans(set()))
            for w in self.state:
                if self.state[w] in ("running", "stopping"):
                    continue
                left = {j for j in self.queue_of(w) if not self.r.exists(RESULT_KEY_PREFIX + j)}
                # a paused worker's queue goes back once its heartbeat lapsed; a dead one's likewise
                if not self.r.exists(live_key(self.q, w)) and not self.r.exists(draining_key(self.q, w)):
                    assert not left, f"{sorted(left)} stay on {w} ({self.state[w]}, no heartbeat) after a settle"

    return RoutingMoves


def test_routing_moves_keep_every_unanswered_id_on_one_live_queue_or_parked(redis_url):
    machine = make_machine(redis_url)
    steps = []
    machine.run_after = lambda self: steps.append(1)
    run_state_machine_as_test(machine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))
    print(f"{len(steps)} machines run")


@pytest.mark.parametrize("_", [0])
def test_a_stale_view_never_assigns_to_a_dead_worker(redis_url, _):
    """The defect's own sequence (issue 32, 1): worker b dies, a recovers it (b leaves the workers set), then a
    dispatch from a's older view (b still live in it) must not put an id on b's queue, where nobody would look."""
    machine = make_machine(redis_url)()
    try:
        machine.start_worker()
        machine.start_worker()
        a, b = machine.routers["w0"], "w1"
        machine.run(a.beat())
        assert sorted(a.live) == ["w0", "w1"]
        machine.state[b] = "dead"
        machine.r.delete(live_key(machine.q, b))
        stale = list(a.live)
        machine.run(a.beat())  # recovers b
        for _ in range(20):
            machine.enqueue()
        a.live = stale
        machine.run(a.dispatch())
        assert not machine.queue_of(b)
        machine.every_unanswered_id_is_parked_on_one_queue_or_ready()
    finally:
        machine.teardown()
