#!/bin/bash
# A/B of the CPU thread wait policy on 2 pinned cores, idle and beside one busy process:
#   bash benchmarks/cpu_thread_policy.sh [CORES=0,1] [ROUNDS=2] [FRAMES=120]
# Each line: the policy, the scenario, and benchmarks/cpu_breakdown.py's ms per step (bf16 + int8, real size).
CORES=${1:-0,1}; ROUNDS=${2:-2}; FRAMES=${3:-120}
BUSY_CORE=${CORES##*,}
run() {  # $1: scenario, $2: env assignment, $3: threads
  out=$(taskset -c "$CORES" env $2 PYTHONPATH=$PWD python3 benchmarks/cpu_breakdown.py --dtype bfloat16 \
    --quantization int8 --threads "$3" --frames "$FRAMES" 2>&1 | grep -E 'ms per step' | tr '\n' ' ')
  echo "$1 | $2 threads=$3 | $out"
}
PYTHONPATH=$PWD python3 -c "from ttsserve.model.dummy_cache import cached_dummy_checkpoint as c; c('real')" >/dev/null 2>&1
for scenario in idle busy; do
  if [ $scenario = busy ]; then taskset -c "$BUSY_CORE" python3 -c "while True: pass" & BUSY=$!; fi
  for r in $(seq "$ROUNDS"); do
    for policy in "OMP_WAIT_POLICY=PASSIVE:2" "GOMP_SPINCOUNT=20000:2" "OMP_WAIT_POLICY=PASSIVE:1"; do
      run "$scenario r$r" "${policy%%:*}" "${policy##*:}"
    done
  done
  if [ $scenario = busy ]; then kill $BUSY; fi
done
