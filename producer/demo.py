"""The statecache demo: simulated agents ask questions through Redis; answers, latencies and cache hits scroll by.

    python -m producer.demo [--seconds 40] [--agents 4] [--worker auto|start|external] [--screenshots]

Each agent has a goal, a list of steps taken and a current page; its state is `goal | steps | page`. Between
questions its state repeats (another question about the same page), grows (more of the page appears at its
end) or changes in the middle (a step is taken: a new step line, a new page). Every answer prints with its
path (memo / hit / partial / cold / plain), the tokens reused and computed, and its latency; every few seconds
a summary line adds the hit rate and p50/p99 latency, and a second line the worker's own figures, read from
its Prometheus metrics (`--metrics-url`; the worker started here serves them on a free port).

What it starts, it stops: Redis at `REDIS_URL` when that answers, else a private `redis-server`; the worker
already serving the queue when its health key is there (`--worker auto`), else one started here on the
model of `STATECACHE_MODEL` (default: the built-in tiny model, whose random weights make the letters
meaningless; the paths and latencies are real). `--screenshots`: each state also shows a generated screenshot of
the page (a PNG drawn with PIL, referenced by the `<|image|>` placeholder); a worker started here then runs the tiny
model with a vision tower (`python -m statecache.dev.tiny --vision`) unless `STATECACHE_MODEL` names another.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from producer.client import AnswerTimeout, Client, RowRejected, WorkerError, text_row
from producer.local_redis import LocalRedis, answers, free_port
from statecache.protocol import health_key, redact
from statecache.redis_url import sync_client
from statecache.rows.images import PLACEHOLDER
from statecache.settings import Settings, child_env, is_set

ROOT = Path(__file__).resolve().parents[1]
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

GOALS = [
    "book a table for two near the park on Friday at seven",
    "buy a small jar of honey and a loaf of bread for delivery tomorrow",
    "find the train that leaves the station at nine and arrives before eleven",
    "fill in the form with the name and email address and send it",
    "check whether the library is open on Saturday afternoon",
]
PAGES = {
    "search results": "The search returned twelve items. Each item shows a name, a price like 12.99, a short "
    "description and a blue button to open it. A menu on the left filters by date and price.",
    "a shop": "The shop page lists bread, milk, apples and honey with their prices. A cart icon at the top shows "
    "three items. The checkout link is at the bottom of the page, below the list of offers.",
    "a form": "The form asks for a name, an email address and a date. Two fields are complete and one is empty. "
    "A send button waits at the end of the form; an error appears in red above it.",
    "a map": "The map shows the river, the station and the park. Three restaurants are marked near the park; "
    "the first has no free table, the second is far away, the third has a table at seven.",
    "an article": "The article describes the weather: clouds in the morning and sun in the afternoon. A long list "
    "of links follows it, with a search box at the top and a menu on the left.",
}
MORE = [
    "Scrolling down shows more items, each with a price and a button to open it.",
    "A message at the bottom says the page finished loading; a link leads back to the previous page.",
    "Further down there is a list of dates and times, and a box to type a number of people.",
]
ACTIONS = ["clicked the blue button", "typed the name into the field", "scrolled to the bottom", "went back",
           "opened the menu on the left", "searched for the item"]
QUESTIONS = [
    ("Which part of the page should the agent use next?", ["the blue button", "the menu", "the search box", "a link"]),
    ("Is the goal reached?", ["yes", "no"]),
    ("What should the agent do next?", ["click", "type", "scroll", "go back", "stop and report"]),
    ("Does the page show what the goal needs?", ["yes", "partly", "no"]),
]


class Agent:
    def __init__(self, name: str, rng: random.Random):
        self.name, self.rng = name, rng
        self.goal = rng.choice(GOALS)
        self.steps = [rng.choice(ACTIONS) for _ in range(rng.randint(6, 10))]
        self.page = rng.choice(list(PAGES))
        self.extra: list[str] = []

    def state(self) -> str:
        steps = "\n".join(f"{i + 1}. {self.name} {s}." for i, s in enumerate(self.steps))
        return f"Goal: {self.goal}.\nSteps taken:\n{steps}\nCurrent page ({self.page}):\n{PAGES[self.page]}" + "".join(
            "\n" + e for e in self.extra
        )

    def screenshot(self) -> bytes:
        """A PNG of the current page: its name, its text in lines, a block per extra line, and the step count."""
        import io

        from PIL import Image, ImageDraw

        im = Image.new("RGB", (320, 200), (245, 246, 248))
        d = ImageDraw.Draw(im)
        d.rectangle([0, 0, 320, 24], fill=(32, 56, 100))
        d.text((8, 6), f"{self.page} - step {len(self.steps)}", fill=(255, 255, 255))
        words = PAGES[self.page].split()
        for i in range(0, min(len(words), 48), 8):
            d.text((8, 32 + 2 * i), " ".join(words[i : i + 8]), fill=(30, 30, 30))
        for j, _ in enumerate(self.extra):
            d.rectangle([8 + 100 * j, 170, 100 + 100 * j, 192], fill=(60 + 60 * j, 120, 200))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        return buf.getvalue()

    def move(self) -> str:
        """Change the state for the next question: 'again', 'grows' or 'changes'."""
        r = self.rng.random()
        if r < 0.5:
            return "again"
        if r < 0.75 and len(self.extra) < len(MORE):
            self.extra.append(MORE[len(self.extra)])
            return "grows"
        self.steps.append(self.rng.choice(ACTIONS))
        self.page = self.rng.choice([p for p in PAGES if p != self.page])
        self.extra = []
        return "changes"


class Tally:
    def __init__(self):
        self.paths: Counter = Counter()
        self.latencies_ms: list[float] = []
        self.errors = 0
        self.t0 = time.monotonic()

    def add(self, result: dict, ms: float) -> None:
        self.paths[result["path"]] += 1
        self.latencies_ms.append(ms)

    def line(self) -> str:
        n = sum(self.paths.values())
        elapsed = time.monotonic() - self.t0
        reused = self.paths["memo"] + self.paths["hit"] + self.paths["partial"]
        lat = sorted(self.latencies_ms)
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: float("nan"))
        paths = " ".join(f"{p} {self.paths[p]}" for p in ("memo", "hit", "partial", "cold", "plain"))
        return (
            f"{elapsed:5.1f} s: {n} answers ({n / max(elapsed, 1e-9):.1f}/s), {self.errors} errors | {paths} | "
            f"reused a state {100 * reused / max(n, 1):.0f}% | latency p50 {pct(0.5):.0f} ms, p99 {pct(0.99):.0f} ms"
        )


def show(agent: Agent, how: str, question: tuple, result: dict, ms: float) -> str:
    probs = result["probs"][0]
    best = max(range(len(probs)), key=probs.__getitem__)
    return (
        f"  {agent.name:<5} {how:<8} {question[0][:44]:<44} -> {LETTERS[best]} {probs[best]:.2f}  "
        f"{result['path']:<7} reused {result['reused']:>5} computed {result['computed']:>5}  {ms:7.1f} ms"
        + (f"  route {result['route']}" if "route" in result else "")  # a worker serving specialists
    )


async def run_agent(client: Client, agent: Agent, until: float, tally: Tally, quiet: bool, shots: bool = False) -> None:
    how = "new"
    while time.monotonic() < until:
        question = agent.rng.choice(QUESTIONS)
        t0 = time.perf_counter()
        try:
            row = text_row(agent.state() + (f"\nScreenshot: {PLACEHOLDER}" if shots else ""), [question])
            if shots:
                row["images"] = [agent.screenshot()]
            result = await client.answer(row, timeout_s=max(5.0, until - time.monotonic() + 60))
        except (RowRejected, AnswerTimeout, WorkerError) as e:
            tally.errors += 1
            print(f"  {agent.name:<5} error: {e}", flush=True)
            return
        ms = 1e3 * (time.perf_counter() - t0)
        tally.add(result, ms)
        if not quiet:
            print(show(agent, how, question, result, ms), flush=True)
        how = agent.move()
        await asyncio.sleep(agent.rng.uniform(0.0, 0.2))  # the agent acts between questions


def scrape(url: str, timeout_s: float = 2.0) -> dict:
    """The worker's metrics at `url` as {name: value} and {name{label=value}: value} (histograms: _count, _sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def metrics_line(url: str | None) -> str:
    if not url:
        return "        (no worker metrics: pass --metrics-url)"
    try:
        m = scrape(url)
    except Exception as e:  # noqa: BLE001 - the demo goes on without them
        return f"        (no worker metrics at {url}: {e})"
    rows = {p: int(m.get(f"statecache:rows_total{{path={p}}}", 0)) for p in ("memo", "hit", "partial", "cold", "plain", "error")}
    reused, computed = m.get("statecache:tokens_reused_total", 0), m.get("statecache:tokens_computed_total", 0)
    batches = m.get("statecache:batch_size_rows_count", 0)
    return (
        f"        worker: {sum(rows.values())} rows ({' '.join(f'{p} {n}' for p, n in rows.items())}) in {int(batches)} batches "
        f"(mean {m.get('statecache:batch_size_rows_sum', 0) / max(batches, 1):.1f} rows) | tokens reused "
        f"{100 * reused / max(reused + computed, 1):.0f}% | cache {int(m.get('statecache:cache_checkpoints', 0))} checkpoints, "
        f"{m.get('statecache:cache_used_bytes', 0) / 2**20:.1f} of {m.get('statecache:cache_budget_bytes', 0) / 2**20:.0f} MiB, "
        f"{int(m.get('statecache:cache_evictions_total', 0))} evictions | waiting {int(m.get('statecache:queue_waiting_rows', 0))}"
        + (" | CACHE INERT" if m.get("statecache:cache_inert") else "")
    )


async def demo(redis_url: str, queue: str, agents: int, seconds: float, every_s: float, quiet: bool, seed: int,
               metrics_url: str | None = None, shots: bool = False) -> int:
    async with await Client.connect(redis_url, queue) as client:
        tally = Tally()
        until = time.monotonic() + seconds
        crowd = [Agent(name, random.Random(seed + i)) for i, name in enumerate(["ann", "bob", "cy", "dee", "eve", "fay", "gus", "hal"][:agents] + [f"a{i}" for i in range(8, agents)])]
        tasks = [asyncio.create_task(run_agent(client, a, until, tally, quiet, shots)) for a in crowd]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=every_s)
            print("--", tally.line(), flush=True)
            print(await asyncio.to_thread(metrics_line, metrics_url), flush=True)
        await asyncio.gather(*tasks)
    print("== done:", tally.line(), flush=True)
    print(await asyncio.to_thread(metrics_line, metrics_url), flush=True)
    return 1 if tally.errors or not tally.latencies_ms else 0


def worker_alive(redis_url: str, queue: str) -> bool:
    r = sync_client(redis_url)
    try:
        return bool(r.exists(health_key(queue)))
    finally:
        r.close()


@contextlib.contextmanager
def started_worker(redis_url: str, queue: str, ready_timeout_s: float, drain_s: float = 30.0, shots: bool = False):
    """`arq worker.WorkerSettings` on `queue`, ready (health key up); yields (process, metrics URL). `shots`: on
    the tiny model with a vision tower unless STATECACHE_MODEL names a model."""
    log = tempfile.NamedTemporaryFile(prefix="statecache-worker-", suffix=".log", delete=False)
    port = free_port()
    env = child_env(REDIS_URL=redis_url, STATECACHE_QUEUE=queue, STATECACHE_HEALTH_INTERVAL_S=1,
                    STATECACHE_METRICS_PORT=port, STATECACHE_DRAIN_S=drain_s)
    if shots and not env.get("STATECACHE_MODEL"):  # the tiny model with a vision tower
        env["STATECACHE_MODEL"] = subprocess.run([sys.executable, "-m", "statecache.dev.tiny", "--vision"], cwd=ROOT,
                                                 env=env, check=True, capture_output=True, text=True).stdout.strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    model = env.get("STATECACHE_MODEL") or "the built-in tiny model"
    print(f"starting the worker on {model} (log: {log.name}) ...", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "arq", "worker.WorkerSettings"], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not worker_alive(redis_url, queue):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the worker did not come up; its log ends:\n{tail}")
            time.sleep(0.1)
        print("worker ready", flush=True)
        yield proc, f"http://127.0.0.1:{port}/metrics"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(drain_s + 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="statecache-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=40.0, help="how long the agents ask (default 40)")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--worker", choices=["auto", "start", "external"], default="auto",
                   help="auto: use the worker serving the queue if there is one, else start one")
    env = Settings.from_env(warn_unknown=False)
    p.add_argument("--redis-url", default=env.redis_url if is_set("REDIS_URL") else None,
                   help="default: $REDIS_URL, else a private redis-server")
    p.add_argument("--queue", default=env.queue, help="default: $STATECACHE_QUEUE, else arq's default queue")
    p.add_argument("--metrics-url", default=None,
                   help="the worker's metrics (default: the worker started here; else http://localhost:$STATECACHE_METRICS_PORT/metrics)")
    p.add_argument("--every-s", type=float, default=5.0, help="summary line interval")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="wait this long for a worker to come up")
    p.add_argument("--quiet", action="store_true", help="summary lines only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--screenshots", action="store_true", help="rows carry a generated screenshot of the page")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url and answers(url):
            print(f"using Redis at {redact(url)}", flush=True)
        else:
            if url:
                print(f"no Redis answers at {redact(url)}; starting a private one", flush=True)
            url = stack.enter_context(LocalRedis()).url
            print(f"started a private Redis at {url}", flush=True)
        metrics_url = args.metrics_url
        if args.worker == "external" or (args.worker == "auto" and worker_alive(url, args.queue)):
            print(f"using the worker serving {args.queue}", flush=True)
            port = Settings.from_env(warn_unknown=False).metrics_port
            metrics_url = metrics_url or (f"http://localhost:{port}/metrics" if port else None)
        else:
            _, started_url = stack.enter_context(started_worker(url, args.queue, args.ready_timeout_s,
                                                                shots=args.screenshots))
            metrics_url = metrics_url or started_url
        return asyncio.run(demo(url, args.queue, args.agents, args.seconds, args.every_s, args.quiet, args.seed,
                                metrics_url, args.screenshots))


if __name__ == "__main__":
    sys.exit(main())
