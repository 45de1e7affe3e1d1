"""Compile and autotune caches that survive restarts: torch.compile (Inductor), Triton kernels and Triton's
autotuning results (fla's kernels autotune through Triton) are kept under the statecache home.

`use_persistent_caches()` points TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at `$STATECACHE_HOME/compile/...`
(default home: ~/.cache/statecache) and turns on TRITON_CACHE_AUTOTUNING, each only where the environment does
not set it already; it must run before the first compile or kernel launch. Knows nothing of the model.
"""

from __future__ import annotations

from pathlib import Path

from statecache.settings import setdefault_env, statecache_home


def use_persistent_caches(home: str | Path | None = None) -> dict[str, str]:
    """Set the cache variables that are unset; returns every one of them as it now stands."""
    base = Path(home if home is not None else statecache_home()) / "compile"
    wanted = {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "TRITON_CACHE_DIR": str(base / "triton"),
              "TRITON_CACHE_AUTOTUNING": "1"}
    for name, value in setdefault_env(wanted).items():
        if name.endswith("_DIR"):
            Path(value).mkdir(parents=True, exist_ok=True)
    return setdefault_env(wanted)
