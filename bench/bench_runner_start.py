"""What one runner process costs in CPU for a small job: with and without pyarrow's pandas import.

    .venv/bin/python bench/bench_runner_start.py [--reps 8] [--rows 40]

Each rep runs the real runner (`python -m fleet.generation.job.runner --job J`) on a fresh output
directory, once as it is ("new": `main()` refuses pandas, fleet/generation/job/nopandas.py) and
once through `runner.main(argv)` with the arguments given ("old": the refusal is skipped, so pyarrow
imports pandas on the first shard it builds, as every runner did before), alternated, against two
simulated SGLang servers on loopback. CPU is the process's user + system time (wait4's rusage).
A multi-node job starts one runner per chunk attempt, so this is paid per chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from sims import start_sims  # noqa: E402

OLD = "import sys; from fleet.generation.job import runner; sys.exit(runner.main(sys.argv[1:]))"


def run(argv: list[str]) -> tuple[float, float, int]:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - t0, ru.ru_utime + ru.ru_stime, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=40)
    args = ap.parse_args()
    procs, urls = start_sims([20000.0, 20000.0], slots=64)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp = Path(tmp) / "in.jsonl"
            inp.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                                   + "\n" for i in range(args.rows)))
            cpu: dict[str, list[float]] = {"old": [], "new": []}
            wall: dict[str, list[float]] = {"old": [], "new": []}
            for rep in range(args.reps):
                for kind in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                    job_dir = Path(tmp) / f"{kind}-{rep}"
                    job_dir.mkdir()
                    job = {"config": {"name": "b", "engine": {"kind": "sim"}, "generation": {"max_tokens": 8}},
                           "input": str(inp), "output": str(job_dir / "out"),
                           "servers": [{"node": "local", "index": i, "url": u, "model": "sim-model"}
                                       for i, u in enumerate(urls)]}
                    (job_dir / "job.json").write_text(json.dumps(job))
                    argv = [sys.executable, "-m", "fleet.generation.job.runner"] if kind == "new" else \
                        [sys.executable, "-c", OLD]
                    w, c, rc = run([*argv, "--job", str(job_dir / "job.json")])
                    manifest = json.loads((job_dir / "out" / "manifest.json").read_text())
                    assert rc == 0 and manifest["counts"]["completed"] == args.rows, (kind, rc, manifest["counts"])
                    cpu[kind].append(c)
                    wall[kind].append(w)
            load = os.getloadavg()
            print(f"# {args.reps} reps alternated, {args.rows} rows, 2 sims; load average now {load[0]:.1f} {load[1]:.1f}")
            print("| runner | CPU s (median) | every rep, CPU s | wall s (median) |")
            print("| --- | --- | --- | --- |")
            for kind in ("old", "new"):
                print(f"| {kind} | {statistics.median(cpu[kind]):.2f} | {', '.join(f'{c:.2f}' for c in cpu[kind])} "
                      f"| {statistics.median(wall[kind]):.2f} |")
            print(f"new ÷ old CPU (medians): {statistics.median(cpu['new']) / statistics.median(cpu['old']):.2f}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
