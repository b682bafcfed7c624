#!/usr/bin/env bash
# Two server configurations measured interleaved on one machine (A, B, A, B, ...): the spread between runs follows
# the host's speed from minute to minute (docs/benchmarks-history.md), so a flag's effect is only read from
# neighbouring runs of one lease. Each run is a fresh `ttsserve serve` (benchmarks/gpu_targets.sh's serve part,
# DUR seconds a point), its reports under OUT/<a|b><round>; benchmarks/ab_summary.py then prints one line per run
# and point (audio-s/s, TTFA, steps/s, host ms a step waiting for the device) and each B run against the mean of
# the A runs beside it, and writes OUT/ab.json.
#   bash benchmarks/gpu_ab.sh OUT "ARGS_A" "ARGS_B" [POINTS (pcm:512)] [ROUNDS (2)]
# e.g. bash benchmarks/gpu_ab.sh /tmp/ab "--kv-cache-dtype fp8" "--kv-cache-dtype fp8 --audio-stream"
# Env: DUR (12), RUN_TIMEOUT (seconds a run may take, 150), MODEL_ARGS as gpu_targets.sh's; DEADLINE (seconds
# from the start, 560): no run starts that could not end before it, so a device call's limit never cuts one off;
# A_TREE: another checkout of the repo (`git worktree add DIR REV`, or `git archive REV | tar -x -C DIR`) whose
# package and gpu_targets.sh serve the A runs, to measure a code change rather than a flag (ARGS_A may then equal
# ARGS_B); A_ENV / B_ENV: environment assignments for the A / B servers (e.g. B_ENV="TTSSERVE_VOCODER_FUSED=1");
# PARTS=offline: each run is gpu_targets.sh's bench offline part instead (1 and OFFLINE_BATCH x 10 s, the ARGS as
# its engine flags; POINTS unused), e.g. PARTS=offline A_ENV=TTSSERVE_DECODE_GEMV=0 bash benchmarks/gpu_ab.sh OUT
# "--kv-cache-dtype fp8" "--kv-cache-dtype fp8".
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: $0 OUT ARGS_A ARGS_B [POINTS] [ROUNDS]}
A=${2?ARGS_A}
B=${3?ARGS_B}
POINTS=${4:-pcm:512}
ROUNDS=${5:-2}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
printf 'a\t%s\nb\t%s\npoints\t%s\na_tree\t%s\na_env\t%s\nb_env\t%s\n' "$A" "$B" "$POINTS" "${A_TREE:-}" "${A_ENV:-}" \
    "${B_ENV:-}" > "$OUT/ab_args.tsv"
t0=$SECONDS
run() {  # NAME ARGS
    left=$(( ${DEADLINE:-560} - (SECONDS - t0) ))
    t=${RUN_TIMEOUT:-150}
    if [ "$left" -lt "$t" ]; then echo "$1: skipped ($left s left before the deadline)"; return; fi
    tree=$REPO run_env=${B_ENV:-}
    case "$1" in a*) tree=${A_TREE:-$REPO} run_env=${A_ENV:-} ;; esac
    # shellcheck disable=SC2086 # run_env: VAR=VALUE words
    (cd "$tree" && env $run_env PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" PARTS="${PARTS:-serve}" \
        SERVE_POINTS="$POINTS" DUR="${DUR:-12}" SERVE_ARGS="$2" OFFLINE_ARGS="$2" timeout "$t" \
        bash benchmarks/gpu_targets.sh "$OUT/$1") > "$OUT/$1.log" 2>&1
    echo "$1 ($2): rc=$?"
    # a server a timeout cut off must not hold the port or the GPU for the next run
    pkill -INT -f 'entrypoints.cli serve' 2> /dev/null && sleep 3
    pkill -9 -f 'entrypoints.cli serve' 2> /dev/null
}
for r in $(seq "$ROUNDS"); do
    run "a$r" "$A"
    run "b$r" "$B"
done
run "a$((ROUNDS + 1))" "$A"  # B's every run between two A runs
python3 "$REPO/benchmarks/ab_summary.py" "$OUT" | tee "$OUT/ab.txt"
