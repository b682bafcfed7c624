#!/usr/bin/env bash
# The vocoder's fusions (on unless TTSSERVE_VOCODER_FUSED=0: the ConvNeXt blocks' GELU in the GEMM epilogue, the
# ISTFT head as Triton kernels; docs/DEPLOY.md) checked and measured in one device call, each part writing as it goes:
#   bash benchmarks/gpu_vocoder_fused.sh OUT
# 1. GPU tests with the fusions on (the kernels against the torch path, the device stage against the CPU stage);
# 2. micro-benchmarks: benchmarks/istft_micro.py, benchmarks/convnext_micro.py --shapes 512x24;
# 3. served, interleaved: gpu_ab.sh with A = TTSSERVE_VOCODER_FUSED=0 (the torch ISTFT, a separate GELU), B = the
#    default, SERVE_ARGS (default --kv-cache-dtype fp8) at POINTS (default pcm:512), ROUNDS (default 1: A B A), DUR
#    (12) seconds a point, no run starting past DEADLINE (default 560) seconds from this script's start;
# 4. with PARTS containing "offline": bench offline 512 x 10 s and 1 x 10 s with and without the fusions.
# Env: PARTS (default "tests micro serve").
set -u
OUT=${1:?usage: $0 OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TTSSERVE_CACHE="${TTSSERVE_CACHE:-/tmp/ttsserve-cache}"
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/ttsserve-pycache}"
parts=" ${PARTS:-tests micro serve} "
ARGS=${SERVE_ARGS:---kv-cache-dtype fp8}
(date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
 nproc; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > "$OUT/machine.txt" 2>&1
if [[ $parts == *" tests "* ]]; then
    TTSSERVE_VOCODER_FUSED=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_triton_istft.py \
        tests/gpu/test_triton_convnext.py tests/audio/test_audio_stage_device.py > "$OUT/gputests.txt" 2>&1
    echo "gpu tests rc=$?"; tail -1 "$OUT/gputests.txt"
fi
if [[ $parts == *" micro "* ]]; then
    timeout 60 python3 benchmarks/istft_micro.py --json "$OUT/istft_micro.json" > "$OUT/istft_micro.txt" 2>&1
    echo "istft_micro rc=$?"; cat "$OUT/istft_micro.txt"
    timeout 90 python3 benchmarks/convnext_micro.py --shapes 512x24 --json "$OUT/convnext_micro.json" \
        > "$OUT/convnext_micro.txt" 2>&1
    echo "convnext_micro rc=$?"
fi
if [[ $parts == *" serve "* ]]; then
    A_ENV="TTSSERVE_VOCODER_FUSED=0" DEADLINE=$(( ${DEADLINE:-560} - SECONDS )) bash benchmarks/gpu_ab.sh "$OUT/ab" \
        "$ARGS" "$ARGS" "${POINTS:-pcm:512}" "${ROUNDS:-1}"
fi
if [[ $parts == *" offline "* ]]; then
    for fused in 0 1; do
        TTSSERVE_VOCODER_FUSED=$fused timeout 240 python3 -m ttsserve.entrypoints.cli bench offline --device cuda \
            --load-format dummy --dummy-size real --dtype bfloat16 $ARGS --batch-sizes 1,512 --frames 469 \
            --lengths fixed --rounds 2 --no-plots --no-progress --out "$OUT/offline_fused$fused" \
            > "$OUT/offline_fused$fused.txt" 2>&1
        echo "bench offline fused=$fused rc=$?"; grep "^| ttsserve" "$OUT/offline_fused$fused.txt"
    done
fi
