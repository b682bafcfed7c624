#!/usr/bin/env bash
# Data-parallel engine cores on one GPU host, in one device call: N=1 on the first GPU, then N=every GPU
# (or the counts in NS), each `ttsserve serve --device cuda --data-parallel-size N --api-server-count M`
# (real-size dummy, bf16), measured with `bench serve` pcm at 256*N concurrency and Poisson at 300*N req/s,
# then one core killed with SIGKILL mid-run under 256*N streams (every request's outcome counted, and the
# seconds until the killed core is back in /ready). Every step writes under OUT as it goes.
#   bash benchmarks/gpu_dp.sh OUT
# Env: NS ("1 <GPU count>"), API_PER_CORE (API servers per core, 12 for N=1 and at most 64 in all), DUR seconds
#      per point (20), CLIENT_PROCS load-generator processes per 256 streams (8, at most half the cores: with four at 512
#      streams one process's first chunks arrived together 2.5 s late on an H100 host), KILL=0 skips the kill run.
# Scaling efficiency = audio-s/s at N / (N x audio-s/s at N=1), from the two runs of the same call.
set -u
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TTSSERVE_CACHE="${TTSSERVE_CACHE:-/tmp/ttsserve-cache}"
GPUS=$(nvidia-smi --list-gpus | wc -l)
(date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc;
 python3 -c "import torch; print(torch.__version__)") > "$OUT/machine.txt" 2>&1
DUR=${DUR:-20}
port=8000

start_server() {  # N M LOG
    python3 -m ttsserve.entrypoints.cli serve --device cuda --load-format dummy --dummy-size real --port $port \
        --data-parallel-size "$1" --api-server-count "$2" > "$3" 2>&1 &
    server=$!
    t0=$SECONDS
    for _ in $(seq 480); do
        [ "$(curl -sf localhost:$port/ready | python3 -c 'import json,sys; print(sum(c["ready"] for c in json.load(sys.stdin)["cores"]))' 2>/dev/null)" = "$1" ] && break
        kill -0 $server 2>/dev/null || break
        sleep 0.5
    done
    echo "N=$1: all cores ready after $((SECONDS - t0)) s"
    for _ in $(seq 240); do  # the deferred CUDA graphs are captured after /ready: measure warm cores
        w=$(curl -s localhost:$port/metrics | grep -E "^ttsserve_engine_warm[{ ]")
        [ -n "$w" ] && ! grep -qvE " 1(\.0)?$" <<< "$w" && break
        sleep 0.5
    done
    echo "N=$1: all cores warm after $((SECONDS - t0)) s"
}

for n in ${NS:-1 $GPUS}; do
    m=$(( n * ${API_PER_CORE:-12} )); [ $m -gt 64 ] && m=64
    procs=$(( n * ${CLIENT_PROCS:-8} )); [ $procs -gt $(( $(nproc) / 2 )) ] && procs=$(( $(nproc) / 2 ))
    d="$OUT/n$n"; mkdir -p "$d"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) start_server "$n" "$m" "$d/server.log"
    timeout 300 python3 -m ttsserve.entrypoints.cli bench serve --url http://127.0.0.1:$port \
        --concurrency $(( 256 * n )) --client-procs $procs --duration "$DUR" --num-requests 1000000 \
        --no-plots --no-progress --response-format pcm --out "$d/pcm" > "$d/pcm.txt" 2>&1
    echo "N=$n pcm@$(( 256 * n )) rc=$?"; tail -12 "$d/pcm.txt" | head -6
    timeout 300 python3 -m ttsserve.entrypoints.cli bench serve --url http://127.0.0.1:$port \
        --qps $(( 300 * n )) --client-procs $procs --duration "$DUR" --num-requests 1000000 \
        --no-plots --no-progress --response-format pcm --out "$d/poisson" > "$d/poisson.txt" 2>&1
    echo "N=$n poisson@$(( 300 * n )) rc=$?"; tail -12 "$d/poisson.txt" | head -6
    if [ "${KILL:-1}" = 1 ] && [ "$n" -gt 1 ]; then
        timeout 300 python3 -m ttsserve.entrypoints.cli bench serve --url http://127.0.0.1:$port \
            --concurrency $(( 256 * n )) --client-procs $procs --duration "$DUR" --num-requests 1000000 \
            --no-plots --no-progress --response-format pcm --out "$d/kill" > "$d/kill.txt" 2>&1 &
        bench=$!
        sleep $(( DUR / 3 ))
        victim=$(curl -s localhost:$port/ready | python3 -c 'import json,sys; print(json.load(sys.stdin)["cores"][-1]["pid"])')
        kill -9 "$victim"; t_kill=$SECONDS
        until [ "$(curl -s localhost:$port/ready | python3 -c 'import json,sys; c=json.load(sys.stdin)["cores"][-1]; print(c["ready"] and c["pid"] != '"$victim"')' 2>/dev/null)" = True ]; do
            sleep 0.2; [ $((SECONDS - t_kill)) -gt 120 ] && break
        done
        echo "N=$n killed core $((n - 1)) (pid $victim): back in /ready after $((SECONDS - t_kill)) s" | tee "$d/kill_restart.txt"
        wait $bench; tail -12 "$d/kill.txt" | head -8
    fi
    curl -s localhost:$port/metrics | grep -E '^ttsserve_(engine_steps|num_requests_waiting|engine_outstanding)' > "$d/metrics.txt"
    kill -INT $server; wait $server
done
