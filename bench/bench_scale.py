"""Scale: the seed job's row count (902,087 prompts) through the runner against sim servers.

    .venv/bin/python bench/bench_scale.py [--rows 902087] [--servers 4] [--max-tokens 8]

Short outputs, servers that answer at once: what is measured is fleet's own cost at the seed
job's size — the runner's wall time, rows/s and peak RSS (the runner is its own process, as
in production: `python -m fleet.generation.job.runner --job JOB.json`), and the exactly-once
account at the end (every input id once in shards + errors + rejects). Resume planning at
50 % done is bench/bench_resume.py. Appends to bench/RESULTS.md under "## Scale".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_client import start_sims  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=902_087)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    from fleet.config import FleetConfig
    from fleet.generation.data.checks import account

    tmp = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    inp = tmp / "prompts.jsonl"
    t = time.monotonic()
    with inp.open("w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": f"row-{i:07d}", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Question {i}: explain topic {i % 977} in one paragraph."}]}) + "\n")
    gen_s = time.monotonic() - t
    procs, urls = start_sims(args.servers, 256)
    try:
        cfg = FleetConfig(name="scale", generation={"max_tokens": args.max_tokens, "max_concurrency_per_server": 64})
        job = {"config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), "input": str(inp),
               "output": str(tmp / "out"), "relaunch": False, "console_interval_s": 30,
               "servers": [{"node": "local", "index": i, "url": u, "model": "sim-model"} for i, u in enumerate(urls)]}
        (tmp / "job.json").write_text(json.dumps(job))
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(tmp / "job.json")],
                           cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - t
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if r.returncode != 0:
            sys.exit(f"runner failed ({r.returncode}): {r.stderr[-3000:]}")
        t = time.monotonic()
        acc = account(inp, tmp / "out")
        account_s = time.monotonic() - t
    finally:
        for p in procs:
            p.terminate()
    manifest = json.loads((tmp / "out" / "manifest.json").read_text())
    lines = [
        "", "## Scale: 902,087 prompts through the runner (sim servers)", "",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — `.venv/bin/python bench/bench_scale.py "
        f"--rows {args.rows} --servers {args.servers} --max-tokens {args.max_tokens}`", "",
        f"- host: {platform.node()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM; the sim servers share "
        "the same cores with the runner; load average at the end " + f"{os.getloadavg()[0]:.2f}",
        f"- input: {args.rows:,} JSONL rows, {inp.stat().st_size / 1e6:.0f} MB (written in {gen_s:.1f} s); "
        f"{args.servers} sim servers answering at once, max_tokens {args.max_tokens}", "",
        "| what | value |", "| --- | --- |",
        f"| runner wall time (start to manifest) | {wall:.0f} s |",
        f"| rows/s | {args.rows / wall:,.0f} |",
        f"| runner peak RSS | {peak_mb:.0f} MB |",
        f"| completed / errors / rejects | {manifest['counts'].get('completed')} / {manifest['counts'].get('errors')} "
        f"/ {manifest['counts'].get('rejects')} |",
        f"| shards | {len(list((tmp / 'out' / 'shards').glob('*.parquet')))} |",
        f"| exactly-once account (`checks.account`) | {'ok' if acc.get('ok') else acc} in {account_s:.1f} s |", "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
