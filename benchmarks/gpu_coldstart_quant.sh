#!/usr/bin/env bash
# One device call for the GPU cold start (before / after the compile caches are warm) and quantization
# (engine throughput and memory with and without quantization). Every step writes under OUT as it goes.
#   bash benchmarks/gpu_coldstart_quant.sh OUT [DEVICE]
# The cold-start half starts the real server: the machine needs the package's dependencies (FastAPI, uvicorn,
# ...; `pip install -e .`). On the lent H200 they were missing, so only the quantization half ran there.
set -u
OUT=${1:?usage: $0 OUT [DEVICE]}
DEVICE=${2:-cuda}
mkdir -p "$OUT"
# Fresh compile caches: run 0 below is a first start on a bare machine (Dockerfile.gpu keeps these in the
# cache volume, so a container restart is like run 1).
export TORCHINDUCTOR_CACHE_DIR="$OUT/../ttsserve-inductor-cache" TRITON_CACHE_DIR="$OUT/../ttsserve-triton-cache"
export TTSSERVE_CACHE="$OUT/../ttsserve-dummy-cache"
rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR" "$TTSSERVE_CACHE"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; python3 -c "import torch; print(torch.__version__)") > "$OUT/machine.txt" 2>&1
# Run 0: no dummy checkpoint cached, no compile cache. Run 1: both cached.
timeout "${COLDSTART_TIMEOUT:-130}" python3 -m ttsserve.bench.coldstart --runs 2 --label "$DEVICE real dummy" \
    -- --load-format dummy --dummy-size real --device "$DEVICE" > "$OUT/coldstart.txt" 2> "$OUT/coldstart.log"
echo "coldstart rc=$?"; cat "$OUT/coldstart.txt"
timeout "${QUANT_TIMEOUT:-120}" python3 benchmarks/quant_engine.py --out "$OUT" --device "$DEVICE" \
    ${QUANT_ARGS:-} > "$OUT/quant_engine.txt" 2> "$OUT/quant_engine.log"
echo "quant rc=$?"; cat "$OUT/quant_engine.txt"
