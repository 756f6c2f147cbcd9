#!/usr/bin/env bash
# CI: Debian's chromium and its driver, for the dashboard's browser tests (tests/rl/test_rl_dashboard.py).
# Idempotent; where they cannot be installed, those tests skip with a reason.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
command -v apt-get >/dev/null || { echo "no apt-get here"; exit 1; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
