#!/usr/bin/env bash
# One device call: the GPU tests of the new paths, the staggered closed-loop engine benchmark,
# then the real HTTP server under `ttsserve bench serve` (closed loop, natural-length corpus, pcm and mp3).
# Every step writes under OUT as it goes, so a call cut short still returns what it measured.
#   bash benchmarks/gpu_served.sh OUT
# Env: TESTS=0 skips the tests, STAG=0 the engine benchmark, SERVE=0 the server; SERVE_ARGS adds server flags,
#      FORMATS (default pcm:32,128,256) format:concurrencies[:client processes[:seconds]] items, e.g. "pcm:128:1 pcm:128:4
#      mp3:128" (client processes default to CLIENT_PROCS, 4: one Python client saturates), DUR seconds per point,
#      STAG_VARIANTS / STAG_CONC / STAG_SECONDS / STAG_FRAMES the engine benchmark's.
# Examples. Engine points over decode-burst variants, then served points with 8 API servers:
#   TESTS=0 SERVE=0 STAG_VARIANTS=pipelined-k4,pipelined,pipelined-k8 STAG_SECONDS=10 STAG_FRAMES=60,256 \
#       bash benchmarks/gpu_served.sh OUT
#   TEST_FILES="tests/gpu tests/sample/test_sampler.py tests/audio/test_audio_stage_device.py tests/model/test_gpt_parity.py" STAG=0 \
#       SERVE_ARGS="--api-server-count 8" FORMATS="pcm:128 pcm:256 mp3:128" DUR=20 bash benchmarks/gpu_served.sh OUT
# Served points, one server each (the mp3 test of `benchmarks/mp3_encode_speed.py` is separate):
#   TESTS=0 STAG=0 SERVE_ARGS="--api-server-count 8" FORMATS="mp3:128 pcm:128 pcm:256" DUR=20 bash benchmarks/gpu_served.sh OUT
#   TESTS=0 STAG=0 SERVE_ARGS="--api-server-count 12" FORMATS="mp3:128 pcm:128" DUR=20 bash benchmarks/gpu_served.sh OUT
# Served points with 8 API servers (pcm:128 twice, then pcm:256), and
# the engine alone per tree with TTFA in steps: python3 benchmarks/staggered.py --out DIR --concurrency 128 --seconds 10 \
#     --variants pipelined,pipelined-fc4 --frames 60,256   (an older tree: run its own copy of the script, and run
#     `python3 -m ttsserve.entrypoints.cli serve` from inside a tree's directory: -m puts the working directory first on sys.path)
# Profiling (py-spy attached by hand to the engine core during the last point):
#   TESTS=0 STAG=0 SERVE_ARGS="--api-server-count 8" FORMATS="pcm:128:4:20 pcm:128:4:20 pcm:256:4:12" \
#       bash benchmarks/gpu_served.sh OUT
# A fresh server's first waves (also run with --api-server-count 12 and FORMATS="mp3:128:4:20 pcm:128:4:20"):
#   TESTS=0 STAG=0 SERVE_ARGS="--api-server-count 8" FORMATS="pcm:128:4:20 pcm:128:4:20 pcm:256:4:12 mp3:128:4:12" \
#       bash benchmarks/gpu_served.sh OUT
set -u
point=0
# MONITOR=1 (default): in mid-point, GPU utilization sampled every 200 ms for 5 s, one `top` of the host's
# processes and, with SPY=1 and py-spy installed, 8 s of the engine core's stacks (benchmarks/spy_summary.py reads them).
monitor() {  # monitor PREFIX SECONDS
    sleep $(( $2 / 2 ))
    timeout 5 nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -lms 200 > "$1.gpu_util.csv" 2>&1 &
    top -b -n 1 -w 200 | head -45 > "$1.top.txt" 2>&1
    if [ "${SPY:-0}" = 1 ] && command -v py-spy > /dev/null; then
        pid=$(curl -s localhost:8000/ready | python3 -c "import json,sys; print(json.load(sys.stdin)['cores'][0]['pid'])" 2>/dev/null)
        [ -n "$pid" ] && py-spy record --pid "$pid" --duration 8 --rate 200 --nonblocking --format raw -o "$1.core.raw" > /dev/null 2>&1
    fi
    wait
}
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TTSSERVE_CACHE="${TTSSERVE_CACHE:-/tmp/ttsserve-cache}"
(date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
 nproc; python3 -c "import torch; print(torch.__version__)") > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TEST_FILES:-tests/gpu} \
        > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
fi
if [ "${STAG:-1}" = 1 ]; then
    timeout "${STAG_TIMEOUT:-200}" python3 benchmarks/staggered.py --out "$OUT" \
        --concurrency "${STAG_CONC:-128}" --seconds "${STAG_SECONDS:-15}" \
        --variants "${STAG_VARIANTS:-eager-vocoder,graphs,graphs-cadence4}" --frames "${STAG_FRAMES:-140,600}" \
        > "$OUT/staggered.txt" 2> "$OUT/staggered.log"
    echo "staggered rc=$?"; cat "$OUT/staggered.txt"
fi
if [ "${SERVE:-1}" = 1 ]; then
    python3 -m ttsserve.entrypoints.cli serve --device cuda --load-format dummy --dummy-size real --port 8000 \
        ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do
        curl -sf localhost:8000/ready > /dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break
        sleep 0.5
    done
    echo "server ready after ${SECONDS}s (script clock)"
    for _ in $(seq 240); do  # the deferred CUDA graphs are captured after /ready: measure the warm server
        w=$(curl -s localhost:8000/metrics | grep -E "^ttsserve_engine_warm[{ ]")
        [ -n "$w" ] && ! grep -qvE " 1(\.0)?$" <<< "$w" && break
        sleep 0.5
    done
    echo "server warm after ${SECONDS}s (script clock)"
    for spec in ${FORMATS:-pcm:32,128,256}; do  # format:concurrencies[:client processes[:seconds]]
        IFS=: read -r fmt conc procs dur <<< "$spec"
        procs=${procs:-${CLIENT_PROCS:-4}}
        name="serve_${fmt}_c${conc//,/-}_p${procs}_$((++point))"
        [ "${MONITOR:-1}" = 1 ] && monitor "$OUT/$name" "${dur:-${DUR:-25}}" &
        timeout "${SERVE_TIMEOUT:-300}" python3 -m ttsserve.entrypoints.cli bench serve --url http://127.0.0.1:8000 \
            --concurrency "$conc" --client-procs "$procs" --duration "${dur:-${DUR:-25}}" --num-requests 100000 \
            --no-plots --no-progress --response-format "$fmt" --out "$OUT/$name" > "$OUT/$name.txt" 2>&1
        echo "bench serve $spec rc=$?"; tail -12 "$OUT/$name.txt" | head -6
    done
    curl -s localhost:8000/metrics | grep -E "^ttsserve_(step|engine|vocoder|graph)" | head -40 > "$OUT/metrics.txt"
    kill -INT $server; wait $server
    tail -5 "$OUT/server.log"
fi
