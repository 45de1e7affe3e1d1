"""bench/startup_parts.py on this machine: its child times each step in the worker's order, and each step's imports
are the ones -X importtime wrote before that step's marker."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_steps_come_in_order_with_their_own_imports(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "startup_parts.py"), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "startup_parts.json").read_text())
    steps = list(res["steps_s"])
    assert steps[:3] == ["import torch", "import worker.jobs", "import statecache.engine"]
    assert steps.index("import transformers") < steps.index("tokenizer load") < steps.index("kernels_for")
    assert all(s >= 0 for s in res["steps_s"].values()) and res["process_s"] >= sum(res["steps_s"].values())
    mods = {name: [r["module"] for r in rows] for name, rows in res["imports"].items()}
    assert mods["import torch"][0] == "torch"  # the slowest import of that step is torch itself, and only there
    assert "torch" not in mods["import transformers"] and mods["import transformers"][0] == "transformers"
    assert "import torch" in p.stdout and "tokenizer load" in p.stdout
