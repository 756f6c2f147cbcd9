#!/usr/bin/env bash
# Issue 41's device call in one command, from the repo's root on a fresh GPU machine (bundle carried):
#   run(command="bash benchmarks/gpu_setup/run_gpu_learns.sh [overrides...]", carry=[".gpu_bundle"])
# Installs the bundle, runs smoke.py (SMOKE=0 skips it), then `rl train configs/gpu_learns.yaml`
# under `timeout $TRAIN_LIMIT` (default 480 s), its log in $OUT/train.log as it goes, then copies the
# run's metrics.jsonl and eval_*.json to $OUT and prints each GRPO step's reward, time split,
# samples/s, gpu/busy_frac (whole step and its parts) and learner MFU. Everything lands under $OUT,
# so a call cut by its limit still brings back what ran.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_learns_out}; mkdir -p "$OUT"
T0=$(date +%s)
bash benchmarks/gpu_setup/install.sh "${BUNDLE:-.gpu_bundle}" || exit 1
. /tmp/site/env.sh
export KIMI_KDA_BACKEND=${KIMI_KDA_BACKEND:-fla_recurrent}   # no minutes of fla autotuning in a short run
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } | tee "$OUT/card.txt"
if [ "${SMOKE:-1}" = 1 ]; then
  timeout 60 python3 benchmarks/gpu_setup/smoke.py >"$OUT/smoke.txt" 2>&1
  echo "smoke rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/smoke.txt"; tail -8 "$OUT/smoke.txt"
fi
echo "train starts at $(( $(date +%s) - T0 )) s"
# grep must not hold the log back in its buffer (a pipe): --line-buffered
timeout -k 20 "${TRAIN_LIMIT:-480}" rl train configs/gpu_learns.yaml logging.progress=false "$@" 2>&1 \
  | grep --line-buffered -v 'logging.cc\|core_worker.cc' | tee "$OUT/train.log"
echo "train ended at $(( $(date +%s) - T0 )) s"
R=$(ls -d runs/gpu-learns-* 2>/dev/null | tail -1)
[ -n "$R" ] || exit 1
cp "$R"/metrics.jsonl "$R"/eval_before.json "$R"/eval_after.json "$OUT"/ 2>/dev/null
python3 - "$R/metrics.jsonl" <<'PY'
import json, sys
keys = ["rollout/reward", "time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/learner_idle_frac",
        "throughput/samples_per_s", "gpu/busy_frac", "gpu/busy_frac_rollout", "gpu/busy_frac_learner",
        "gpu/busy_frac_sync", "train/mfu"]
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "rollout/reward" in r:
        print(r["step"], " ".join(f"{k.split('/')[-1]}={r[k]:.3g}" for k in keys if k in r))
PY
