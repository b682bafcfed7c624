#!/usr/bin/env bash
# HTTP load test of a running server (start one first, e.g. `ttsserve serve --load-format dummy`):
# streaming PCM from /v1/audio/speech at 1, 4 and 16 concurrent clients, then Poisson arrivals.
# Usage: benchmarks/serve.sh [URL] [extra `ttsserve bench serve` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
url="${1:-http://127.0.0.1:8000}"
shift || true
exec python3 -m ttsserve.entrypoints.cli bench serve --url "$url" --concurrency 1,4,16 --qps 0.5,1,2 --num-requests 32 \
    --duration 120 --max-new-tokens 256 "$@"
