#!/bin/bash
# bench/bench_controller_scale.py on the idle device machine (16 CPUs, Python 3.12, no network): the
# controller before and after a change, side by side, at 100 nodes and at 1,000 nodes (four processes at
# once; each is one Python process whose controller threads share one core, so on 16 CPUs none waits on
# another). The 1,000-node "new" pass is meant to run to its end: makespan ÷ ideal measured.
#
# Run from the root of the checkout the device receives, with three git-excluded folders carried:
#   .gpuwork/sc   this tree:              git archive HEAD | tar -x -C .gpuwork/sc
#   .gpuwork/old  the tree to compare to: git archive <old commit> | tar -x -C .gpuwork/old, then
#                 cp bench/bench_controller_scale.py .gpuwork/old/bench/   (one bench, both controllers)
#   .gpuwork/.whl the wheels of bench/gpu_wheels.txt
# Writes $OUT/n100-new.log, n100-old.log, n1000-new.log, n1000-old.log (one JSON line, then a table).
# Knobs: ROWS1000 (4500000), SPEED1000 (2 job s per wall s), WALL1000 (480 s), WALL100 (300 s).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpuwork/.whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
echo "$(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(python3 --version)"
for tree in new old; do
    dir=$PWD/.gpuwork/$([ "$tree" = new ] && echo sc || echo old)
    [ -d "$dir" ] || { echo "missing $dir"; exit 1; }
    ( cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/bench_controller_scale.py --nodes 1000 \
        --rows "${ROWS1000:-4500000}" --speed "${SPEED1000:-2}" --max-wall-s "${WALL1000:-480}" \
        > "$out/n1000-$tree.log" 2>&1 ) &
    ( cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/bench_controller_scale.py --nodes 100 --speed 10 \
        --max-wall-s "${WALL100:-300}" > "$out/n100-$tree.log" 2>&1 ) &
done
wait
echo "load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
for f in n100-old n100-new n1000-old n1000-new; do echo "== $f"; tail -n 32 "$out/$f.log"; done
