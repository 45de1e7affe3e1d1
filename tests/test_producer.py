"""The producer side: the JSON-lines CLI and the demo, against a real Redis and a worker on the tiny model."""

import json

import pytest

from producer import cli, demo
from producer.local_redis import free_port
from statecache.engine import Engine
from tests.harness import InProcessWorker


@pytest.fixture(scope="module")
def engine():
    return Engine()

GOOD = {"ids": [1, 2, 3, 4], "state_len": 2, "slots": [3], "nopts": [3]}
TEXT = {"state": "the page shows a login form", "questions": [{"text": "Log in?", "options": ["yes", "no"]}]}


def test_cli_answers_a_file_in_order(redis_url, queue_name, tmp_path, capsys, engine):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join([json.dumps(GOOD), json.dumps({**GOOD, "nopts": [1]}), "{not json", "", json.dumps(TEXT)]) + "\n"
    )
    out = tmp_path / "out.jsonl"
    with InProcessWorker(redis_url, queue_name, lambda: engine):
        rc = cli.main([str(rows), "-o", str(out), "--redis-url", redis_url, "--queue", queue_name])
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and len(results) == 4
    assert results[0]["path"] == "plain" and len(results[0]["probs"][0]) == 3  # 2 tokens of state: not cached
    assert results[1]["error"]["code"] == "bad_nopts"
    assert results[2]["error"]["code"] == "bad_json" and "line 3" in results[2]["error"]["message"]
    assert len(results[3]["probs"][0]) == 2
    assert "4 rows, 2 errors" in capsys.readouterr().err


def test_cli_times_out_without_worker(redis_url, queue_name, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(GOOD) + "\n")
    assert cli.main([str(rows), "--redis-url", redis_url, "--queue", queue_name, "--timeout-s", "0.2"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "timeout"


def test_agents_repeat_grow_and_change():
    import random

    agent = demo.Agent("ann", random.Random(1))
    seen = {"again": 0, "grows": 0, "changes": 0}
    for _ in range(60):
        before = agent.state()
        how = agent.move()
        seen[how] += 1
        after = agent.state()
        if how == "again":
            assert after == before
        elif how == "grows":
            assert after.startswith(before) and len(after) > len(before)
        else:
            goal_and_steps = before.split("Current page")[0]
            assert after.startswith(goal_and_steps.rstrip("\n")) and after != before
    assert all(seen.values())


def test_demo_with_an_external_worker(redis_url, queue_name, capsys, engine):
    port = free_port()
    with InProcessWorker(redis_url, queue_name, lambda: engine, metrics_port=port):
        rc = demo.main(["--seconds", "3", "--every-s", "1", "--redis-url", redis_url, "--queue", queue_name,
                        "--metrics-url", f"http://127.0.0.1:{port}/metrics"])
        assert engine.stats()["hits"] + engine.stats()["memo"] > 0
    out = capsys.readouterr().out
    assert rc == 0 and f"using the worker serving {queue_name}" in out
    assert "== done:" in out and " cold " in out
    last = out.strip().splitlines()[-1]  # the summary read from the worker's metrics
    assert last.lstrip().startswith("worker: ") and "tokens reused" in last and "checkpoints" in last, last


def test_demo_starts_redis_and_the_worker(monkeypatch, capsys):
    """No REDIS_URL: the demo starts a private redis-server and a worker process on the tiny model, and stops both."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    rc = demo.main(["--seconds", "2", "--every-s", "1", "--agents", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "started a private Redis" in out and "worker ready" in out and "== done:" in out
    assert out.strip().splitlines()[-1].lstrip().startswith("worker: "), out
