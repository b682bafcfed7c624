#!/usr/bin/env bash
# Offline throughput/latency of the ttsserve engine vs the HuggingFace-style baseline, side by side, on the
# real-size model (random weights unless a checkpoint is found: speed and memory figures are real either way).
# Usage: benchmarks/offline.sh [cpu|cuda] [extra `ttsserve bench offline` flags...]
# Writes benchmarks/results/<timestamp>-offline/{report.json,report.md,*.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
device="${1:-cpu}"
shift || true
if [ "$device" = cpu ]; then
    # 128 frames = 2.7 s of audio per request; no swap pool on CPU (the device memory IS host memory)
    defaults=(--batch-sizes 1,8,32 --frames 128 --swap-space 0)
else
    defaults=(--batch-sizes 1,8,32,128 --frames 256)
fi
exec python3 -m ttsserve.entrypoints.cli bench offline --backend both --load-format "${LOAD_FORMAT:-auto}" --dummy-size real \
    --device "$device" "${defaults[@]}" "$@"
