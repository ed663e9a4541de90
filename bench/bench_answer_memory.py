"""The runner's peak memory for rows with very large answers (issue 23): is a row's memory near its payload?

    .venv/bin/python bench/bench_answer_memory.py [--rows 8] [--reasoning-mb 20] [--content-mb 10] [--base DIR]

A stand-in server (bench/garbage.py) answers every request with one valid completion of
`--reasoning-mb` MB of reasoning_content and `--content-mb` MB of content. The runner (`run_local`)
takes `--rows` rows through it, all in flight at once (concurrency = rows), in a fresh process, and
reports its peak resident memory (ru_maxrss) beside the payload (rows x answer size). With `--base DIR`
the same job runs a second time with the code of DIR (another checkout) on PYTHONPATH, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from garbage import GarbageServer, Reply, write_rows  # noqa: E402

CHILD = r'''
import json, resource, sys
from fleet.config import FleetConfig
from fleet.generation.job.runner import run_local
url, inp, out, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = FleetConfig(name="mem", engine={"kind": "sim"}, generation={"max_tokens": 8, "max_concurrency_per_server": rows})
rc = run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": url, "model": "m"}], flush_interval_s=3600)
print(json.dumps({"rc": rc, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def run(code_root: Path, url: str, rows: int, work: Path) -> dict[str, float]:
    inp, out = work / "in.jsonl", work / "out"
    work.mkdir(parents=True)
    write_rows(inp, rows)
    r = subprocess.run([sys.executable, "-c", CHILD, url, str(inp), str(out), str(rows)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(code_root)}, cwd=code_root, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    result: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reasoning-mb", type=float, default=20)
    ap.add_argument("--content-mb", type=float, default=10)
    ap.add_argument("--base", default=None, help="another checkout to compare with, side by side")
    args = ap.parse_args()
    doc = {"choices": [{"message": {"role": "assistant", "content": "c" * int(args.content_mb * 1e6),
                                    "reasoning_content": "r" * int(args.reasoning_mb * 1e6)},
                        "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    body = json.dumps(doc).encode()
    payload_mb = args.rows * len(body) / 1e6
    server = GarbageServer([Reply("large valid answer", body=body)])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, root in [("this checkout", ROOT)] + ([("base", Path(args.base))] if args.base else []):
                res = run(root, server.url, args.rows, Path(tmp) / name.replace(" ", "-"))
                print(f"{name}: rc {res['rc']}, peak RSS {res['peak_mb']:.0f} MB for {payload_mb:.0f} MB of "
                      f"answers ({res['peak_mb'] / payload_mb:.2f}x)", flush=True)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
