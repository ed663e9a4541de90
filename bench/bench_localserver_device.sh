#!/bin/bash
# bench/bench_localserver.py on the idle device machine (16 CPUs, Python 3.12, no network), old vs
# new side by side in one run. Run from the root of the checkout the device receives, with three
# git-excluded folders carried: .gpuwork/$NEW (default fc: this tree, `git archive HEAD`), .gpuwork/$OLD
# (default fc-old: the old rev's tree) and .gpuwork/.whl (the wheels of bench/gpu_wheels.txt; optionally
# .gpuwork/fc-whl, more wheels). Writes $OUT/bench.log and $OUT/bench.json.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpuwork/.whl/*.whl $(ls .gpuwork/fc-whl/*.whl 2>/dev/null) || exit 1
python3 -m compileall -q -j 0 /tmp/site > /dev/null   # bytecode, as a normal install has
# the sim servers run `fleet sim` from this tree (both paths adopt the same fleet)
NEW=${NEW:-fc} OLD=${OLD:-fc-old}
export PYTHONPATH=/tmp/site:$PWD/.gpuwork/$NEW PYTHONUNBUFFERED=1 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
cd ".gpuwork/$NEW" || exit 1
echo "$(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(python3 --version)"
python3 bench/bench_localserver.py --reps "${REPS:-6}" --old-dir "../$OLD" --old-rev "${OLD_REV:-fcd3513}" --generate \
    --out "${OUT:-/tmp}/bench.json" 2>&1 | tee "${OUT:-/tmp}/bench.log"
