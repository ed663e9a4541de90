#!/bin/bash
# bench/bench_controller_scale.py on the idle device machine (16 CPUs, Python 3.12, no network): the
# 100-node job (with the whole-state-per-change pass beside it) and the 1,000-node job, run at once
# (each is one process; the machine has 16 CPUs, so neither waits on the other). Run from the root of
# the checkout the device receives, with two git-excluded folders carried: .gpuwork/sc (this tree:
# `git archive HEAD`) and .gpuwork/.whl (the wheels of bench/gpu_wheels.txt). Writes $OUT/n100.log and
# $OUT/n1000.log (one JSON line per pass, then a Markdown table).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpuwork/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpuwork/sc PYTHONUNBUFFERED=1
cd .gpuwork/sc || exit 1
echo "$(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(python3 --version)"
python3 bench/bench_controller_scale.py --nodes 100 --speed 10 --compare-state --max-wall-s "${WALL100:-200}" \
    > "${OUT:-/tmp}/n100.log" 2>&1 &
python3 bench/bench_controller_scale.py --nodes 1000 --rows "${ROWS1000:-4500000}" --speed "${SPEED1000:-2}" \
    --max-wall-s "${WALL1000:-400}" > "${OUT:-/tmp}/n1000.log" 2>&1 &
wait
echo "load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
tail -n 30 "${OUT:-/tmp}/n100.log"; tail -n 30 "${OUT:-/tmp}/n1000.log"
