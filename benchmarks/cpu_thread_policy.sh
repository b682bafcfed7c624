#!/bin/bash
# The CPU thread wait policy, A/B, on this machine's cores idle and beside one busy process:
#   bash benchmarks/cpu_thread_policy.sh [ROUNDS=2] [FRAMES=120] [DTYPE=bfloat16] [QUANT=int8]
# Policies: the default (GOMP_SPINCOUNT=20000, threads adapted by runner/cpu_contention.py), the same spin with
# 2 threads fixed, OMP_WAIT_POLICY=PASSIVE with 2 threads, 1 thread. Each line: scenario, policy, and
# benchmarks/cpu_breakdown.py's wall ms per step (batch 1, real size) with the thread monitor's state.
ROUNDS=${1:-2}; FRAMES=${2:-120}; DTYPE=${3:-bfloat16}; QUANT=${4:-int8}
BUSY=
trap '[ -n "$BUSY" ] && kill "$BUSY" 2>/dev/null' EXIT
run() {  # $1: scenario, $2: env assignment, $3: threads ("auto": the policy's, monitored)
  local targ=()
  [ "$3" != auto ] && targ=(--threads "$3")
  out=$(env "$2" PYTHONPATH="$PWD" python3 benchmarks/cpu_breakdown.py --dtype "$DTYPE" --quantization "$QUANT" \
    "${targ[@]}" --frames "$FRAMES" 2>&1 | grep -E 'ms per step wall|monitor' | tr '\n' ' ')
  echo "$1 | $2 threads=$3 | load $(cut -d' ' -f1 /proc/loadavg) | $out"
}
for scenario in idle busy; do
  if [ $scenario = busy ]; then python3 -c "while True: pass" & BUSY=$!; sleep 1; fi
  for r in $(seq "$ROUNDS"); do
    for policy in "GOMP_SPINCOUNT=20000:auto" "GOMP_SPINCOUNT=20000:2" "OMP_WAIT_POLICY=PASSIVE:2" "OMP_WAIT_POLICY=PASSIVE:1"; do
      run "$scenario r$r" "${policy%%:*}" "${policy##*:}"
    done
  done
  if [ $scenario = busy ]; then kill "$BUSY"; BUSY=; fi
done
