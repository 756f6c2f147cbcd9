#!/usr/bin/env bash
# Install the bundle that build_bundle.sh made into /tmp/site on the GPU machine (no network), then
# write /tmp/site/env.sh, which the command sources to use it. Run from the repo's root:
#
#   bash benchmarks/gpu_setup/install.sh [BUNDLE_DIR] && . /tmp/site/env.sh
#
# BUNDLE_DIR defaults to <repo>/.gpu_bundle; SITE=/other/dir installs elsewhere. Prints what it did;
# on failure, exits non-zero with one line saying why.
set -uo pipefail

REPO=$PWD
BUNDLE=${1:-$REPO/.gpu_bundle}
SITE=${SITE:-/tmp/site}
fail() { echo "install.sh: $*" >&2; exit 1; }
now() { date +%s.%N; }
t0=$(now)

[ -d "$BUNDLE/wheels" ] || fail "no $BUNDLE/wheels: run benchmarks/gpu_setup/build_bundle.sh where pip has network, and carry .gpu_bundle"
[ -f "$REPO/rl/__init__.py" ] || fail "run from the repo's root (no rl/ in $REPO)"
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
  || fail "python3 is $(python3 -V 2>&1); the bundle's wheels are for 3.12"
python3 -c 'import torch' 2>/dev/null || fail "python3 cannot import torch (the image's torch is used, never a bundled one)"
dups=$(ls "$BUNDLE"/wheels/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d | tr '\n' ' ')
[ -z "$dups" ] || fail "two versions of ${dups}in $BUNDLE/wheels: delete the bundle and build it again"

n=$(ls "$BUNDLE"/wheels/*.whl | wc -l)
log=$(mktemp)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$BUNDLE"/wheels/*.whl >"$log" 2>&1 || fail "pip install failed: $(grep -v '^\s*$' "$log" | tail -1)"
# A wheel rebuilt without zip modes would leave Ray's daemons unexecutable: make sure they run.
for bin in "$SITE"/ray/core/src/ray/raylet/raylet "$SITE"/ray/core/src/ray/gcs/gcs_server; do
  [ -f "$bin" ] || fail "ray's $(basename "$bin") is missing from the bundle's ray wheel"
  chmod +x "$bin"
done
mkdir -p "$SITE/bin"
printf '#!/bin/sh\nexec python3 -m rl.cli "$@"\n' > "$SITE/bin/rl"   # the console script pip would make
chmod +x "$SITE/bin/rl"
t1=$(now)

cat > "$SITE/env.sh" <<EOF
# written by benchmarks/gpu_setup/install.sh
export PYTHONPATH=$SITE:$REPO\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export WANDB_MODE=disabled             # wandb is not in the bundle
export RAY_USAGE_STATS_ENABLED=0
export TRITON_CACHE_DIR=$REPO/.cache/triton_gpu
# NVLink multicast off, as this workplace's GPU machines require (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF

. "$SITE/env.sh"
versions=$(python3 - 2>&1 <<'EOF'
import importlib, importlib.metadata as md, sys
out = []
for dist, module in [("torch", "torch"), ("ray", "ray"), ("deepspeed", "deepspeed"), ("pydantic", "pydantic"),
                     ("datasets", "datasets"), ("fla-core", "fla")]:
    try:
        if module:
            importlib.import_module(module)
        out.append(f"{dist} {md.version(dist)}")
    except Exception as exc:
        print(f"import {module} failed: {type(exc).__name__}: {exc}".splitlines()[0])
        sys.exit(1)
print(", ".join(out))
EOF
) || fail "$versions"
t2=$(now)
printf 'install.sh: %d wheels from %s into %s in %.1f s; imports checked in %.1f s: %s\n' \
  "$n" "$BUNDLE" "$SITE" "$(awk "BEGIN{print $t1 - $t0}")" "$(awk "BEGIN{print $t2 - $t1}")" "$versions"
echo "install.sh: now run: . $SITE/env.sh"
