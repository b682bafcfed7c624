#!/usr/bin/env bash
# The H200 headline table in one device call, every figure as JSON under OUT (real-size dummy, bf16):
#   bash benchmarks/gpu_targets.sh OUT
# 1. cold start: `ttsserve serve` to /ready (and to warm: graphs deferred past /ready captured) with caches warm (COLD_RUNS starts; the first fills the caches
#    a fresh machine lacks: dummy checkpoint, Triton / inductor, Python bytecode), bench/coldstart.py's JSON;
# 2. served: one server (`--api-server-count 12` + SERVE_ARGS), then `bench serve` at each SERVE_POINTS item
#    (format:concurrency or format:qps<rate>, optionally :client processes), DUR seconds each, CLIENT_PROCS
#    load-generator processes unless the point names its own (its report then under serve_FMT_LOAD_pN); neither:
#    bench serve's default (one per 32 streams or 50 req/s, at most half the cores: 8 at 512 on 16 cores);
# 3. offline: `bench offline` 1 x 10 s and OFFLINE_BATCH x 10 s;
# 4. targets.json: every headline target checked against those reports (benchmarks/targets_summary.py).
# Env: PARTS (default "cold serve offline"; "variant" adds a second server with VARIANT_ARGS, default
#      --first-chunk-lookahead-frames 16, at VARIANT_POINTS, default "pcm:128 pcm:512", under OUT/variant, and
#      with "offline" also bench offline 1 x 10 s with those flags; VARIANT_POINTS= (empty): that offline run
#      only) picks the parts;
#      SERVE_ARGS, SERVE_POINTS, DUR, WARMUP (2: each point also reports the TTFA of the requests sent after
#      that many seconds), COLD_RUNS, OFFLINE_BATCH, OFFLINE_ARGS (engine flags of the offline part alone, e.g.
#      "--num-scheduler-steps 16"); SPY=1: a py-spy profile of the engine core
#      mid-point (spy_*.raw, benchmarks/spy_summary.py reads them); PROFILE=1: a torch profiler trace of the
#      engine core over PROFILE_S (4) seconds of each server's first point from PROFILE_AT (0.5) seconds into it
#      (the default: its fresh first wave; later: the steady state)
#      (traces/*.json.gz via POST /start_profile and /stop_profile, and trace_summary.py's reading beside it);
#      FRESH_TRITON=1: each server starts with an empty Triton cache, as on a new machine (targets.json counts
#      the kernels its log says were compiled while serving). Each part writes as it goes, so a call cut short
#      keeps what it measured.
set -u
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TTSSERVE_CACHE="${TTSSERVE_CACHE:-/tmp/ttsserve-cache}"
# a read-only torch install has no bytecode cache: without this every start recompiles torch's sources (~20 s)
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/ttsserve-pycache}"
CLI="python3 -m ttsserve.entrypoints.cli"
MODEL_ARGS=${MODEL_ARGS:---device cuda --load-format dummy --dummy-size real}
(date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
 nproc; python3 -c "import torch; print(torch.__version__)") > "$OUT/machine.txt" 2>&1
parts=" ${PARTS:-cold serve offline} "

if [[ $parts == *" cold "* ]]; then
    timeout 300 python3 -m ttsserve.bench.coldstart --runs "${COLD_RUNS:-2}" --until-warm --log-dir "$OUT/coldstart_logs" --label "serve, 12 API servers" -- \
        $MODEL_ARGS --api-server-count 12 ${SERVE_ARGS:-} > "$OUT/coldstart.txt" 2>&1
    tail -1 "$OUT/coldstart.txt" > "$OUT/coldstart.json"
    grep -E "^run|cold start" "$OUT/coldstart.txt"
fi

profile() {  # DIR: with PROFILE=1, a torch profiler trace of the engine core over PROFILE_S seconds of the load
    # from PROFILE_AT (0.5) seconds into it (the server runs with $TTSSERVE_TORCH_PROFILER_DIR=DIR/traces),
    # summarised by trace_summary.py
    sleep "${PROFILE_AT:-0.5}"
    curl -s -X POST localhost:8000/start_profile > /dev/null
    sleep "${PROFILE_S:-4}"
    curl -s -X POST localhost:8000/stop_profile > "$1/traces/stop_profile.json"
    for _ in $(seq 240); do  # the core writes the trace on a thread: PATH.part.* until it is complete
        ls "$1"/traces/*.json.gz > /dev/null 2>&1 && ! ls "$1"/traces/*.part.* > /dev/null 2>&1 && break
        sleep 0.5
    done
    for t in "$1"/traces/*.json.gz; do
        [ -e "$t" ] && python3 benchmarks/trace_summary.py "$t" > "${t%.json.gz}.summary.txt"
    done
}

spy() {  # OUT.raw: with SPY=1 and py-spy installed, 6 s of the engine core's stacks mid-point (spy_summary.py)
    command -v py-spy > /dev/null || return
    sleep $(( ${DUR:-20} / 2 ))
    pid=$(curl -s localhost:8000/ready | python3 -c "import json,sys; print(json.load(sys.stdin)['cores'][0]['pid'])")
    py-spy record --pid "$pid" --duration 6 --rate 200 --nonblocking --format raw -o "$1" > /dev/null 2>&1
}

serve_points() {  # DIR "SERVE FLAGS" "POINTS": one warm server, then bench serve at each point, reports under DIR
    mkdir -p "$1"; echo "$2" > "$1/serve_args.txt"
    [ "${PROFILE:-0}" = 1 ] && mkdir -p "$1/traces" && export TTSSERVE_TORCH_PROFILER_DIR="$1/traces"
    # FRESH_TRITON=1: an empty Triton cache for this server, as on a new machine (what compiles shows in the log)
    [ "${FRESH_TRITON:-0}" = 1 ] && export TRITON_CACHE_DIR="$(mktemp -d /tmp/triton-fresh-XXXX)"
    $CLI serve $MODEL_ARGS --port 8000 --api-server-count 12 $2 > "$1/server.log" 2>&1 &
    unset TTSSERVE_TORCH_PROFILER_DIR
    first=1
    server=$!
    for _ in $(seq 400); do
        curl -sf localhost:8000/ready > /dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break
        sleep 0.5
    done
    for _ in $(seq 240); do  # graphs deferred past /ready (engine/deferred_capture.py): measure the warm server
        w=$(curl -s localhost:8000/metrics | grep -E "^ttsserve_engine_warm[{ ]")
        [ -n "$w" ] && ! grep -qvE " 1(\.0)?$" <<< "$w" && break
        sleep 0.5
    done
    echo "server ($2) warm after ${SECONDS}s (script clock)"
    for point in $3; do
        IFS=: read -r fmt load procs <<< "$point"
        if [[ $load == qps* ]]; then load_args="--qps ${load#qps}"; else load_args="--concurrency $load"; fi
        n=${procs:-${CLIENT_PROCS:-}}  # unset: bench serve's own (one per 32 streams or 50 req/s, <= cores / 2)
        [ "${SPY:-0}" = 1 ] && spy "$1/spy_${fmt}_${load}${procs:+_p$procs}.raw" &
        if [ "${PROFILE:-0}" = 1 ] && [ $first = 1 ]; then profile "$1" & profiler=$!; fi
        first=0
        timeout 200 $CLI bench serve --url http://127.0.0.1:8000 $load_args ${n:+--client-procs $n} \
            --duration "${DUR:-20}" --warmup-s "${WARMUP:-2}" --num-requests 100000 --no-plots --no-progress \
            --response-format "$fmt" \
            --out "$1/serve_${fmt}_${load}${procs:+_p$procs}" > "$1/serve_${fmt}_${load}${procs:+_p$procs}.txt" 2>&1
        echo "bench serve $point rc=$?"; grep -A2 "^| load | ok" "$1/serve_${fmt}_${load}${procs:+_p$procs}.txt" | tail -1
    done
    [ -n "${profiler:-}" ] && wait "$profiler"  # the trace is written by the server: keep it up until then
    profiler=
    kill -INT $server; wait $server
}

if [[ $parts == *" serve "* ]]; then
    serve_points "$OUT" "${SERVE_ARGS:-}" "${SERVE_POINTS:-pcm:512 pcm:256 pcm:128 mp3:256 pcm:qps400}"
fi
variant_args=${VARIANT_ARGS:---first-chunk-lookahead-frames 16}
variant_points=${VARIANT_POINTS-pcm:128 pcm:512}  # set but empty: no variant server (its offline run only)
if [[ $parts == *" variant "* && -n $variant_points ]]; then  # the same points on a server with other flags
    serve_points "$OUT/variant" "$variant_args" "$variant_points"
fi

offline() {  # DIR "ENGINE FLAGS" BATCH: bench offline at 469 frames (10 s) a request, under DIR/offline_bBATCH
    mkdir -p "$1"
    timeout 240 $CLI bench offline $MODEL_ARGS $2 --dtype bfloat16 --batch-sizes "$3" --frames 469 \
        --lengths fixed --rounds 2 --no-plots --no-progress --out "$1/offline_b$3" > "$1/offline_b$3.txt" 2>&1
    echo "bench offline batch $3 ($2) rc=$?"; grep -h "bench.offline: ttsserve batch" "$1/offline_b$3.txt"
    tail -4 "$1/offline_b$3.txt"
}
if [[ $parts == *" offline "* ]]; then
    echo "${OFFLINE_ARGS:-}" > "$OUT/offline_args.txt"
    for b in 1 "${OFFLINE_BATCH:-512}"; do offline "$OUT" "${OFFLINE_ARGS:-}" "$b"; done
    # the variant's flags on one 10-s utterance too (its first audio), when the variant part runs
    if [[ $parts == *" variant "* ]]; then
        offline "$OUT/variant" "$variant_args" 1
        echo "$variant_args" > "$OUT/variant/serve_args.txt"
    fi
fi

# every target, met or not, as one JSON (what benchmarks/results/gpu/ keeps)
python3 benchmarks/targets_summary.py "$OUT" > "$OUT/targets.json" && echo "targets: $OUT/targets.json"
