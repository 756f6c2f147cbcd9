#!/usr/bin/env bash
# Make a Docker daemon answer for the sandbox tests. Idempotent; always exits 0:
# when no daemon can run, the Docker tests skip with the reason printed here.
set -u
log() { echo "[start-docker] $*" >&2; }
SOCK=/var/run/docker.sock

answering() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && answering; then
  log "dockerd already answering"; exit 0
fi

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # a concurrent apt run holds the lock: wait for it (bounded) instead of failing
    timeout 600 apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || log "apt-get update failed"
    timeout 900 apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
      || log "apt-get install ${need[*]} failed"
  else
    log "cannot install ${need[*]} (not root or no apt-get)"
  fi
fi

if ! command -v dockerd >/dev/null 2>&1; then
  log "no dockerd binary: Docker tests will skip"; exit 0
fi

# another caller may be starting it right now: only start when no dockerd runs
if ! pgrep -x dockerd >/dev/null 2>&1; then
  log "starting dockerd"
  mkdir -p /var/log
  nohup setsid dockerd --storage-driver=overlay2 >/var/log/dockerd.log 2>&1 </dev/null &
fi

for _ in $(seq 1 60); do
  if [ -S "$SOCK" ] && answering; then log "dockerd answering"; exit 0; fi
  sleep 0.5
done
log "dockerd did not answer within 30 s (see /var/log/dockerd.log): Docker tests will skip"
exit 0
