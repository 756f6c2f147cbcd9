#!/bin/bash
# On the GPU machine: the learner's step at the Kimi-Linear shape (train_step_gpu.py's packed 8K row),
# an earlier tree against this checkout, alternately in one device call, so both see the same card.
# Here first:   mkdir -p .cache/ab && git archive -o .cache/ab/base.tar BASE_REV
# Then:         run(command="bash benchmarks/gpu_setup/ab_learner_step.sh", carry=[".gpu_bundle", ".cache/ab"])
# Logs and JSON under $OUT; $OUT/triton.tgz (fla's autotuning, ~230 s the first time) carried back in as
# .cache/ab/triton.tgz skips that in the next call. ITERS (default 10) steps are timed per run, ROUNDS
# (default 2) runs of each tree; the last run also profiles a step after its timing (kernels and ops by
# GPU time, the host's enqueue time) unless PROFILE=0. ROUNDS=1 fits a fresh machine's call with room to spare.
set -u
REPO=$(pwd)
bash benchmarks/gpu_setup/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
. /tmp/site/env.sh
[ -f .cache/ab/base.tar ] || { echo "ab_learner_step: .cache/ab/base.tar missing (git archive it here)"; exit 2; }
mkdir -p /tmp/base "$REPO/.cache/triton_gpu" && tar -xf .cache/ab/base.tar -C /tmp/base
[ -f .cache/ab/triton.tgz ] && tar -xzf .cache/ab/triton.tgz -C "$REPO/.cache/triton_gpu"
nvidia-smi --query-gpu=name --format=csv,noheader
ARGS="--preset kimi-linear-48b --set num_hidden_layers=4 num_experts=64 --seq 8192 --batch 1 --packed agentic
      --configs fast --no-checks --iters ${ITERS:-10}"
run() {  # label, tree[, profile]
  local t0
  t0=$(date +%s)
  (cd "$2/benchmarks" && PYTHONPATH=/tmp/site:$2 python3 train_step_gpu.py $ARGS ${3---no-profile} \
     --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1)
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s: $(grep -E "ms/step|host:|kernel time" "$OUT/$1.log" | tail -3 | tr '\n' ' ')"
}
ROUNDS=${ROUNDS:-2}
run_this_tree() { if [ "$1" = "$ROUNDS" ] && [ "${PROFILE:-1}" != 0 ]; then run "head$1" "$REPO" ""; else run "head$1" "$REPO"; fi; }
for r in $(seq 1 "$ROUNDS"); do
  # FIRST=head: this tree first (when the call may run out before the base's turn)
  [ "${FIRST:-base}" = head ] && run_this_tree "$r"
  run "base$r" /tmp/base
  [ "$r" = 1 ] && tar -czf "$OUT/triton.tgz" -C "$REPO/.cache/triton_gpu" .
  [ "${FIRST:-base}" = head ] || run_this_tree "$r"
done
