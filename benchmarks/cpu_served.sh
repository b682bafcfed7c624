#!/usr/bin/env bash
# The CPU served target in one run: the real server under `bench serve` at concurrency C against the engine
# alone under `bench offline` at batch size C, same model, same corpus, natural lengths (the dummy's EOS
# clock) capped at FRAMES per segment. The server runs first, then stops, so the two never share the cores.
#   benchmarks/cpu_served.sh OUT [tiny|real]
# Env: C (8), FRAMES (256), DUR seconds for the served point (60), ROUNDS offline batches (3), PORT (8011).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: $0 OUT [tiny|real]}
SIZE=${2:-tiny}
C=${C:-8}; FRAMES=${FRAMES:-256}; DUR=${DUR:-60}; PORT=${PORT:-8011}
mkdir -p "$OUT"
python3 -m ttsserve.entrypoints.cli serve --device cpu --load-format dummy --dummy-size "$SIZE" --port "$PORT" \
    --swap-space 0 > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "localhost:$PORT/ready" > /dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { tail -5 "$OUT/server.log"; exit 1; }
    sleep 0.5
done
for _ in $(seq 600); do  # /ready comes first; a CPU server then compiles its decode step in the background
    curl -s "localhost:$PORT/metrics" | grep -qE "^ttsserve_engine_warm(\{[^}]*\})? 1" && break
    sleep 0.5
done
python3 -m ttsserve.entrypoints.cli bench serve --url "http://127.0.0.1:$PORT" --concurrency "$C" --duration "$DUR" \
    --num-requests 100000 --max-new-tokens "$FRAMES" --no-plots --no-progress --out "$OUT/serve" \
    > "$OUT/serve.txt" 2>&1
kill -INT $server; wait $server || true
trap - EXIT
# the server's CPU default (the whole decode step compiled); bench offline waits for it before timing
TTSSERVE_CPU_COMPILE=1 python3 -m ttsserve.entrypoints.cli bench offline --backend ttsserve --load-format dummy --dummy-size "$SIZE" --device cpu \
    --swap-space 0 --batch-sizes "$C" --frames "$FRAMES" --lengths natural --rounds "${ROUNDS:-3}" \
    --no-plots --no-progress --out "$OUT/offline" > "$OUT/offline.txt" 2>&1
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/serve/report.json"))["results"][0]["summary"]
o = json.load(open(f"{out}/offline/report.json"))["results"][0]["summary"]
print(f"served  c={s['load']:g}: {s['audio_seconds_per_s']:.2f} audio-s/s, TTFA p50/p99 "
      f"{s['ttfa_s']['p50']:.2f}/{s['ttfa_s']['p99']:.2f} s, {s['num_ok']}/{s['num_requests']} ok")
print(f"offline b={o['load']:g}: {o['audio_seconds_per_s']:.2f} audio-s/s, {o['num_ok']} requests")
print(f"served / offline = {s['audio_seconds_per_s'] / o['audio_seconds_per_s']:.2f} (target >= 0.80)")
EOF
