#!/usr/bin/env bash
# Run `rl train ARGS...` in the background and, every INTERVAL seconds (default 30), print what its
# log gained and take a py-spy stack dump of the driver and every Ray actor, so that a run which
# stalls inside a device call's time limit still says where it stood. Needs the bundle installed
# (install.sh; py-spy is in it) and env.sh sourced.
#   WATCH_INTERVAL=30 WATCH_FOR=540 bash benchmarks/gpu_setup/watch_run.sh configs/gpu_small.yaml train.steps=3
# Dumps go to $OUT/dumps (the device tool brings $OUT back) or ./watch_dumps; the log to .../train.log.
set -u
INTERVAL=${WATCH_INTERVAL:-30}
DURATION=${WATCH_FOR:-540}
DIR=${OUT:-.}/watch
mkdir -p "$DIR/dumps"
LOG=$DIR/train.log
rl train "$@" logging.progress=false >"$LOG" 2>&1 &
DRIVER=$!
START=$(date +%s)
SHOWN=0
while kill -0 "$DRIVER" 2>/dev/null; do
  sleep "$INTERVAL"
  NOW=$(( $(date +%s) - START ))
  LINES=$(wc -l <"$LOG")
  # Ray's C++ logging lines drown the run's own
  sed -n "$((SHOWN + 1)),${LINES}p" "$LOG" | grep -v 'logging.cc\|^\s*$' | cut -c1-220
  SHOWN=$LINES
  echo "--- t=${NOW}s: stacks ---"
  for PID in $DRIVER $(pgrep -f '^ray::' || true); do
    NAME=$(tr '\0' ' ' </proc/"$PID"/cmdline 2>/dev/null | cut -c1-60)
    py-spy dump --pid "$PID" >"$DIR/dumps/t${NOW}_${PID}.txt" 2>&1
    # the innermost frames of each thread py-spy saw running (idle ones wait on a lock or a socket)
    echo "[$PID $NAME]"
    awk '/^Thread/{keep = ($0 ~ /active/); t=$0; n=0; next} keep && n<5 {print "  " substr(t,1,36) " | " $0; n++}' \
      "$DIR/dumps/t${NOW}_${PID}.txt" | head -15
  done
  [ "$NOW" -ge "$DURATION" ] && { echo "watch_run: stopping the run after ${NOW}s"; kill -INT "$DRIVER"; sleep 10; kill -9 "$DRIVER" 2>/dev/null; break; }
done
wait "$DRIVER" 2>/dev/null
echo "watch_run: exit status $?; log: $LOG"
tail -40 "$LOG" | grep -v 'logging.cc'
