"""House rules checked on the source: import directions, one module reads the environment, one settings object
that docs/SETTINGS.md documents exactly, one wire protocol; the README stays short and the docs' links resolve."""

import ast
import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from statecache import protocol
from statecache.settings import Settings, markdown_table, unknown_variables

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("statecache", "worker", "producer")


def sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package,forbidden", [("statecache", {"worker", "producer"}), ("worker", {"producer"}),
                                               ("producer", {"worker"})])
def test_import_directions(package, forbidden):
    bad = {str(p.relative_to(ROOT)): imported_top_levels(p) & forbidden for p in sources(package)}
    assert not {k: v for k, v in bad.items() if v}


def _statecache_imports() -> dict[str, set[str]]:
    """statecache's modules -> the statecache modules each imports anywhere (lazy imports inside functions too)."""
    mods = {}
    for p in sources("statecache"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def module_of(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                t = module_of(name)
                # a package's __init__ is not an import of the package by its own modules
                if t is not None and t != m and not (mods[t].name == "__init__.py" and m.startswith(t + ".")):
                    out.add(t)
        edges[m] = out
    return edges


def test_no_import_circles_in_statecache():
    """No module of statecache reaches itself through imports, lazy ones (inside functions) included: shared pieces
    live in a lower module instead."""
    edges = _statecache_imports()
    circles = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], set()
        while stack:
            m, path = stack.pop()
            for t in sorted(edges[m]):
                if t == start:
                    circles.append(" -> ".join(path + [t]))
                elif t not in seen:
                    seen.add(t)
                    stack.append((t, path + [t]))
    assert not circles, circles[:5]


# statecache's subpackages and what each must not import (lazy imports included): every arrow runs down, from the
# engine and its step loop (the top) through run/ and sched/ to the cache, rows, the model and its kernels.
TOP = {"engine", "step", "cli"}
LAYER_RULES = {
    "kernels": {"model", "rows", "cache", "sched", "run", "dev"} | TOP,
    "model": {"rows", "cache", "sched", "run", "dev"} | TOP,  # the model knows nothing of rows or the cache
    "rows": {"model", "kernels", "cache", "sched", "run", "dev"} | TOP,
    "cache": {"run", "sched", "rows", "kernels", "dev"} | TOP,  # the store of states runs nothing
    "sched": {"run", "model", "kernels", "rows", "dev"} | TOP,  # plans without tensors (and without torch, below)
    "run": {"cache", "sched", "dev"} | TOP,  # runs what it is handed; which states are kept is not its business
    "dev": {"cache", "sched", "run", "rows"} | TOP,
}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_statecache_arrows_run_down():
    """Each subpackage imports only the ones below it (LAYER_RULES): e.g. cache/ nothing of run/, model/ and kernels/
    nothing of rows/ or cache/. A new subpackage must be given its place here."""
    edges = _statecache_imports()
    layers = {_layer(m) for m in edges if m.count(".")}
    packages = {p.name for p in (ROOT / "statecache").iterdir() if (p / "__init__.py").exists()}
    assert packages - {"sched"} <= set(LAYER_RULES) and "sched" in LAYER_RULES, packages - set(LAYER_RULES)
    bad = sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                 if _layer(t) in LAYER_RULES.get(_layer(m), set()) and _layer(t) != _layer(m))
    assert bad == [], bad
    assert {"kernels", "model", "rows", "cache", "sched", "run", "dev"} <= layers


def test_the_library_loads_without_the_service():
    """Importing every statecache module (the CLI included) loads neither the worker nor the producer."""
    mods = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sources("statecache")]
    code = "import sys\n" + "".join(f"import {m}\n" for m in mods if not m.endswith("__main__")) + (
        "bad = [m for m in sys.modules if m.split('.')[0] in ('worker', 'producer')]\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})


def test_one_module_reads_the_environment():
    readers = []
    for package in PACKAGES:
        for p in sources(package):
            text = p.read_text()
            if re.search(r"os\.environ|getenv\(|from os import environ", text) and p != ROOT / "statecache/settings.py":
                readers.append(str(p.relative_to(ROOT)))
    assert readers == []


def test_settings_doc_lists_every_setting_exactly():
    doc = (ROOT / "docs/SETTINGS.md").read_text()
    assert markdown_table() in doc
    documented = set(re.findall(r"^\| `((?:STATECACHE_|REDIS_)[A-Z_]+)` \|", doc, re.M))
    assert documented == {f.metadata["env"] for f in dataclasses.fields(Settings)}


README_MAX_BYTES = 12 * 1024  # the README is for users; the reference lives in docs/


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move reference to docs/"


def test_doc_links_point_at_files():
    """Every relative link in README.md and docs/*.md names a file or folder that exists (anchors not checked)."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # same-page anchor, or a URL (https:, mailto:)
                continue
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_rows_doc_names_every_error_code():
    text = (ROOT / "docs/ROWS.md").read_text()
    assert [c for c in protocol.ERROR_CODES if f"| `{c}` |" not in text] == []


def test_the_scheduler_plants_no_closer_than_the_runner_keeps_states():
    """run/ may not import cache/ (LAYER_RULES), so the two gaps are two constants: the scheduler's (no checkpoint
    planted closer than MIN_ADVANCE past where a piece starts) must cover the runner's (a state kept inside a piece
    lies at least SNAP_GAP inside it, past the conv's W - 1 inputs)."""
    from statecache.cache.index import MIN_ADVANCE
    from statecache.run.batch import SNAP_GAP

    assert MIN_ADVANCE >= SNAP_GAP


def test_cache_defaults_agree_with_the_cache():
    from statecache.cache.config import CacheSettings

    s, c = Settings(), CacheSettings()
    assert s.cache_settings() == c  # unset, every field is the cache's own default (the budget sized later)
    assert dataclasses.asdict(Settings(cache_stride=1024, host_cache_mb=0).cache_settings()) == {
        **dataclasses.asdict(c), "stride": 1024, "host_mb": 0}
    assert dataclasses.asdict(Settings(cache_mb=7).cache_settings())["mb"] == 7
    assert Settings().cache_settings().mb is None is c.mb  # unset: sized from the device at start-up
    assert Settings(cache_fraction=0.25).cache_settings().fraction == 0.25


def test_settings_from_the_environment(caplog):
    env = {"STATECACHE_CACHE_MB": "64", "STATECACHE_PRECAPTURE": "off", "STATECACHE_QUEUE": "q1",
           "STATECACHE_JOB_TIMEOUT_S": "2.5", "STATECACHE_CAHCE_MB": "1", "REDIS_URL": "redis://h:1/2", "OTHER": "x"}
    with caplog.at_level(logging.WARNING, "statecache.settings"):
        s = Settings.from_env(env)
    assert (s.cache_mb, s.precapture, s.queue, s.job_timeout_s, s.redis_url) == (64, False, "q1", 2.5, "redis://h:1/2")
    assert "STATECACHE_CAHCE_MB" in caplog.text and unknown_variables(env) == ["STATECACHE_CAHCE_MB"]
    with pytest.raises(ValueError, match="STATECACHE_MAX_JOBS='many' is not a valid int"):
        Settings.from_env({"STATECACHE_MAX_JOBS": "many"})
    with pytest.raises(ValueError, match="STATECACHE_COMPILE='maybe' is not a valid bool"):
        Settings.from_env({"STATECACHE_COMPILE": "maybe"})
    assert Settings().queue == "arq:queue"  # arq's default queue: a bare enqueue_job reaches the worker


def test_engine_is_built_from_the_settings():
    from statecache.cache.policy import PlantWhenItFits
    from statecache.engine import Engine

    s = Settings(cache_mb=3, cache_stride=1024, max_row_tokens=999, batch=4,
                 cold_ok="statecache.cache.policy:PlantWhenItFits", cache_fraction=0.5)
    e = Engine.from_settings(s)
    assert (e.cache.s.mb, e.cache.s.stride, e.max_row_tokens) == (3, 1024, 999)
    assert e.budget.mb == 3 and e.runner.max_batch == 4
    assert isinstance(e.cold_ok, PlantWhenItFits) and e.cache.s.fraction == 0.5
    unset = Engine.from_settings(Settings(batch=8, cache_stride=1024))  # no CACHE_MB: the budget is the device's
    assert unset.runner.max_batch == 8 and unset.cache.s.stride == 1024 and unset.budget.mb == Engine().budget.mb


def test_every_row_error_code_is_in_the_protocol():
    codes = set()
    for path in (ROOT / "statecache").rglob("*.py"):
        codes |= set(re.findall(r'RowError\("([a-z_]+)"', path.read_text()))
    assert codes and codes <= set(protocol.ERROR_CODES)


def test_the_demo_subcommand_lives_outside_the_library(capsys):
    """`statecache demo` is dispatched by producer.console (the console script), `statecache score` by the library."""
    from producer import console

    with pytest.raises(SystemExit) as e:
        console.main(["demo", "--help"])
    assert e.value.code == 0 and "--agents" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        console.main(["score", "--help"])
    assert e.value.code == 0 and "--no-precapture" in capsys.readouterr().out


def test_agent_side_and_worker_settings_load_without_torch():
    """An agent service importing `producer` (or arq's CLI loading the worker's settings) does not load torch."""
    code = "import sys, producer, producer.cli, worker.settings\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})


def test_the_scheduler_is_torch_free():
    """statecache.sched imports no torch anywhere (lazy imports inside functions too), and importing all of it loads
    none: the scheduler's tests and bench/step_sim.py run without it."""
    pkg = ROOT / "statecache" / "sched"
    mods = sorted(pkg.rglob("*.py"))
    assert mods
    for p in mods:
        assert "torch" not in imported_top_levels(p), p
    code = ("import sys\nimport statecache.sched\n" + "".join(f"import statecache.sched.{p.stem}\n" for p in mods
                                                              if p.stem != "__init__")
            + "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
