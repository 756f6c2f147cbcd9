#!/usr/bin/env bash
# Build .gpu_bundle/ here (with network): every Python package the GPU machine's image lacks, as
# wheels for CPython 3.12 on x86-64, small enough that the repo and the bundle travel in one device
# call (64 MiB). On the GPU machine, benchmarks/gpu_setup/install.sh installs them.
#
#   benchmarks/gpu_setup/build_bundle.sh [OUT_DIR]     # default: <repo>/.gpu_bundle
#
# Needs: python3 with pip, the repo's .venv (deepspeed's setup.py imports torch; `make setup`).
# Set PYTHON=/path/to/python to build deepspeed's wheel with another interpreter that has torch.
set -euo pipefail

RAY_VERSION=2.60.0        # the versions CI runs (pyproject.toml leaves them open)
DEEPSPEED_VERSION=0.19.8
MAX_MIB=55                # leaves ~9 MiB of the 64 MiB a call carries for the repo itself

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${1:-$REPO/.gpu_bundle}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
RAW=$REPO/.cache/gpu_bundle_raw   # the full ray wheel (79 MB) stays out of the bundle
fail() { echo "build_bundle: $*" >&2; exit 1; }

"$PYTHON" -c 'import torch' 2>/dev/null || fail "$PYTHON cannot import torch (run 'make setup' or set PYTHON)"
mkdir -p "$OUT/wheels" "$RAW"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --no-deps)

echo "build_bundle: wheels from packages.txt"
python3 -m pip download -q "${TARGET[@]}" -d "$OUT/wheels" -r "$HERE/packages.txt" 2> >(grep -v '^WARNING: Location' >&2)

ray_whl=ray-$RAY_VERSION-cp312-cp312-manylinux2014_x86_64.whl
if [ ! -f "$OUT/wheels/$ray_whl" ]; then
  echo "build_bundle: ray $RAY_VERSION, slimmed (takes a few minutes on 2 cores)"
  python3 -m pip download -q "${TARGET[@]}" -d "$RAW" "ray==$RAY_VERSION" 2> >(grep -v '^WARNING: Location' >&2)
  [ -f "$RAW/$ray_whl" ] || fail "pip did not produce $ray_whl (a new ray release names its wheel differently?)"
  # Java jar, dashboard web client, and ray libraries the pipeline never imports
  python3 "$HERE/slim_wheel.py" "$RAW/$ray_whl" "$OUT/wheels/$ray_whl.part" \
    ray/jars ray/dashboard/client ray/rllib ray/data ray/serve ray/tune ray/train ray/llm
  mv "$OUT/wheels/$ray_whl.part" "$OUT/wheels/$ray_whl"
fi

if ! ls "$OUT"/wheels/deepspeed-$DEEPSPEED_VERSION-*.whl >/dev/null 2>&1; then
  echo "build_bundle: deepspeed $DEEPSPEED_VERSION wheel (source distribution; no ops built: torch optimizers)"
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps "deepspeed==$DEEPSPEED_VERSION" \
    -w "$OUT/wheels" 2> >(grep -v '^WARNING: Location' >&2)
fi

cp "$HERE/install.sh" "$OUT/install.sh"   # the bundle installs itself in a checkout that lacks the script
(cd "$OUT/wheels" && ls -l --block-size=1 *.whl | awk '{printf "%10d  %s\n", $5, $9}') > "$OUT/MANIFEST.txt"
total=$(du -sb "$OUT" | cut -f1)
echo "total $total bytes" >> "$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
[ "$total" -le $((MAX_MIB * 1024 * 1024)) ] || fail "bundle is $((total / 1048576)) MiB, over $MAX_MIB MiB"
echo "build_bundle: $OUT is $((total / 1048576)) MiB; carry it with the device tool: carry: [\".gpu_bundle\"]"
