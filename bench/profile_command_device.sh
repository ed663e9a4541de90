#!/bin/bash
# Where `fleet up` on a running sim fleet spends its wall and CPU on the idle device machine (this
# tree, nothing else running): each output line stamped, `bench/profile_command.py` twice, import
# times. Run from the root of the checkout the device receives, carrying .gpuwork/fc (this tree),
# .gpuwork/.whl and .gpuwork/fc-whl, as bench/bench_localserver_device.sh.
cd .gpuwork/fc || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl ../fc-whl/*.whl || exit 1
python3 -m compileall -q -j 0 /tmp/site > /dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_HOME=/tmp/ph PREFECT_SERVER_ANALYTICS_ENABLED=false
mkdir -p /tmp/b
C=$(python3 -c "import sys;sys.path.insert(0,'.');from bench.bench_localserver import sim_config;from pathlib import Path;print(sim_config(Path('/tmp/b'),2))")
python3 -m compileall -q . > /dev/null
python3 -m flows.cli up -c $C > /dev/null 2>&1
TIMEFORMAT="up: %R s wall, %U user %S sys"
for i in 1 2 3 4; do time (python3 -m flows.cli up -c $C > /dev/null 2>&1); done
TIMEFORMAT="import prefect: %R s wall, %U user %S sys"
for i in 1 2 3; do time python3 -c "import prefect"; done
TIMEFORMAT="import flows.cli, flows.fleet: %R s wall, %U user %S sys"
for i in 1 2; do time python3 -c "import flows.cli, flows.fleet"; done
TIMEFORMAT="python3 -c pass: %R s wall, %U user %S sys"
time python3 -c pass
python3 - "$C" <<'PY'
import subprocess, sys, time
for rep in range(2):
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", "up", "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        print(f"{time.monotonic() - t0:5.2f} {line.rstrip()[:150]}")
    p.wait()
    print(f"{time.monotonic() - t0:5.2f} exit {p.returncode}")
PY
for i in 1 2; do python3 bench/profile_command.py up -c $C --top 45 2>&1 | sed -n '/^wall/,$p'; done
python3 -m flows.cli down -c $C > /dev/null 2>&1; python3 -m flows.localserver stop
