#!/usr/bin/env bash
# Build the .whl/ folder that bench/gpu_bench.py's device call carries (the GPU machines have no
# network). Run here, in the repo root; then name `.whl` in the device call's `carry` (see
# bench/RESULTS.md, "Real GPUs", for the whole call). Needs pip and a package index.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
grep -v '^#' bench/gpu_wheels.txt | grep . | while read -r req; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$req"
done
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
