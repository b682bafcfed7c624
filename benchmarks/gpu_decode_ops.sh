#!/usr/bin/env bash
# The decode ops modes ($TTSSERVE_DECODE_OPS, runner/decode_ops.py) side by side in one device call: device time
# per step under a served-like load (gpu_step_profile.py) and `ttsserve serve` to /ready (bench coldstart, caches
# warm: the first start of the call fills them and is reported apart), real-size dummy, bf16:
#   bash benchmarks/gpu_decode_ops.sh OUT
# Env: MODES (default "compile triton triton-compiled-sampler triton-eager-sampler"), PARTS (default "profile cold";
# "offline": bench offline at OFFLINE_BATCHES, default 1,4, x 10 s per mode), CONCURRENCY
# (default 256,512), COLD_RUNS (default 1 per mode and capture choice), BACKGROUND (default "0 1": every graph
# before /ready, then --background-graph-capture), SERVE_ARGS (serve flags, default --api-server-count 12).
set -u
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TTSSERVE_CACHE="${TTSSERVE_CACHE:-/tmp/ttsserve-cache}"
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/ttsserve-pycache}"
MODES=${MODES:-compile triton triton-compiled-sampler triton-eager-sampler}
parts=" ${PARTS:-profile cold} "
(date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc;
 python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > "$OUT/machine.txt" 2>&1
if [[ $parts == *" cold "* ]]; then  # fills the caches every mode reads (dummy checkpoint, bytecode, kernels)
    timeout 200 python3 -m ttsserve.bench.coldstart --runs 1 -- --device cuda --load-format dummy --dummy-size real \
        ${SERVE_ARGS:---api-server-count 12} > "$OUT/coldstart_fill.txt" 2>&1
fi
for mode in $MODES; do
    export TTSSERVE_DECODE_OPS=$mode
    if [[ $parts == *" profile "* ]]; then
        timeout 150 python3 benchmarks/gpu_step_profile.py --out "$OUT/profile_$mode" --concurrency "${CONCURRENCY:-256,512}" \
            --seconds 2 > "$OUT/profile_$mode.txt" 2>&1
        echo "profile $mode rc=$?"; grep -E "^@" "$OUT/profile_$mode.txt"
    fi
    if [[ $parts == *" cold "* ]]; then
        for bg in ${BACKGROUND:-0 1}; do
            flag=$([ "$bg" = 1 ] && echo --background-graph-capture || echo --no-background-graph-capture)
            log="$OUT/coldstart_${mode}_bg$bg"
            timeout 200 python3 -m ttsserve.bench.coldstart --runs "${COLD_RUNS:-1}" --until-warm --log-dir "$log" \
                --label "$mode $flag" -- --device cuda --load-format dummy --dummy-size real \
                ${SERVE_ARGS:---api-server-count 12} $flag > "$log.txt" 2>&1
            echo "coldstart $mode $flag rc=$?"; grep -E "^run|cold start" "$log.txt"
        done
    fi
    if [[ $parts == *" offline "* ]]; then  # one 10-s utterance end to end: where launches per frame count most
        timeout 150 python3 -m ttsserve.entrypoints.cli bench offline --device cuda --load-format dummy --dummy-size real \
            --dtype bfloat16 --batch-sizes "${OFFLINE_BATCHES:-1,4}" --frames 469 --lengths fixed --rounds 3 --no-plots \
            --no-progress --out "$OUT/offline_$mode" > "$OUT/offline_$mode.txt" 2>&1
        echo "offline $mode rc=$?"; grep -A4 "^| backend" "$OUT/offline_$mode.txt" | tail -2
    fi
done
