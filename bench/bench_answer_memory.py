"""The runner's peak memory for rows with very large answers (issue 23): is a row's memory near its payload?

    .venv/bin/python bench/bench_answer_memory.py [--rows 8] [--reasoning-mb 20] [--content-mb 10] [--base DIR]
    .venv/bin/python bench/bench_answer_memory.py --stream [--rows 8] [--reasoning-mb 2] [--content-mb 1] [--delta-chars 16]

A stand-in server (bench/garbage.py) answers every request with one valid completion of
`--reasoning-mb` MB of reasoning_content and `--content-mb` MB of content. The runner (`run_local`)
takes `--rows` rows through it, all in flight at once (concurrency = rows), in a fresh process, and
reports its peak resident memory (VmHWM) beside the payload (rows x answer size). The same job with
answers of 1 KB gives the process's floor (imports, the event loop, Arrow's and Parquet's code), so the
answers' own cost is the peak minus the floor. With `--base DIR` the same runs are made with the code of
DIR (another checkout) on PYTHONPATH, side by side.

`--stream`: the client's streamed path alone (`chat(..., on_chunk=...)`, what the runner uses for engines
without token counters), `--rows` answers at once, each streamed in deltas of `--delta-chars` characters
(a real engine sends a token or a few per event); the payload is the answers' text. The streamed answer
counts against `generation.max_response_mib` by its stream size (about 80 bytes of JSON per event more).
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

# The child's own peak is VmHWM (its address space's high-water mark), not ru_maxrss: on Linux a child's
# ru_maxrss starts from its parent's peak, kept across exec (this parent holds the answers it serves).
PEAK = "int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:'))) / 1024"

CHILD = r'''
import json, sys
from fleet.config import FleetConfig
from fleet.generation.job.runner import run_local
url, inp, out, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = FleetConfig(name="mem", engine={"kind": "sim"}, generation={"max_tokens": 8, "max_concurrency_per_server": rows})
rc = run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": url, "model": "m"}], flush_interval_s=3600)
print(json.dumps({"rc": rc, "peak_mb": PEAK}))
'''.replace("PEAK", PEAK)

CHILD_STREAM = r'''
import asyncio, json, sys
from fleet.generation.data.rows import Request
from fleet.generation.hotpath.client import chat, new_session
url, rows = sys.argv[1], int(sys.argv[2])
async def main():
    session = new_session(rows)
    try:
        return await asyncio.gather(*(chat(session, url, "m", Request(f"r{i}", i + 1, [{"role": "user", "content": "q"}],
                                                                      {}), on_chunk=lambda: None) for i in range(rows)))
    finally:
        await session.close()
outs = asyncio.run(main())
ok = sum(o.ok for o in outs)
print(json.dumps({"rc": 0 if ok == rows else 1, "peak_mb": PEAK, "error": next((o.error for o in outs if not o.ok), None)}))
'''.replace("PEAK", PEAK)


def body(reasoning: int, content: int) -> bytes:
    doc = {"choices": [{"message": {"role": "assistant", "content": "c" * content, "reasoning_content": "r" * reasoning},
                        "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    return json.dumps(doc).encode()


def sse(reasoning: int, content: int, delta: int) -> bytes:
    """A streamed completion: the reasoning, then the content, `delta` characters per event."""
    def event(d: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(d).encode() + b"\n\n"
    parts = [event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})]
    for key, text in (("reasoning_content", "r" * reasoning), ("content", "c" * content)):
        parts += [event({"choices": [{"index": 0, "delta": {key: text[i:i + delta]}}]})
                  for i in range(0, len(text), delta)]
    parts.append(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    parts.append(event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}))
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def run(code_root: Path, url: str, rows: int, work: Path, stream: bool) -> dict[str, float]:
    inp, out = work / "in.jsonl", work / "out"
    work.mkdir(parents=True)
    write_rows(inp, rows)
    argv = ["-c", CHILD_STREAM, url, str(rows)] if stream else ["-c", CHILD, url, str(inp), str(out), str(rows)]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(code_root)}, cwd=code_root, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    result: dict[str, float] = json.loads(r.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"{code_root}: the job failed: {result}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reasoning-mb", type=float, default=None, help="default: 20 (2 with --stream)")
    ap.add_argument("--content-mb", type=float, default=None, help="default: 10 (1 with --stream)")
    ap.add_argument("--stream", action="store_true", help="the client's streamed path alone")
    ap.add_argument("--delta-chars", type=int, default=16, help="with --stream: characters per event")
    ap.add_argument("--base", default=None, help="another checkout to compare with, side by side")
    args = ap.parse_args()
    reasoning = int((args.reasoning_mb if args.reasoning_mb is not None else 2 if args.stream else 20) * 1e6)
    content = int((args.content_mb if args.content_mb is not None else 1 if args.stream else 10) * 1e6)
    if args.stream:
        replies = [Reply("large streamed answer", body=sse(reasoning, content, args.delta_chars), length=-1),
                   Reply("small streamed answer", body=sse(500, 500, args.delta_chars), length=-1)]
        payload_mb = args.rows * (reasoning + content) / 1e6
    else:
        replies = [Reply("large valid answer", body=body(reasoning, content)),
                   Reply("small valid answer", body=body(500, 500))]
        payload_mb = args.rows * len(replies[0].body) / 1e6
    servers = [GarbageServer([r]) for r in replies]
    what = "streamed answers' text" if args.stream else "answers"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, root in [("this checkout", ROOT)] + ([("base", Path(args.base))] if args.base else []):
                floor = run(root, servers[1].url, args.rows, Path(tmp) / f"{name}-floor".replace(" ", "-"), args.stream)
                res = run(root, servers[0].url, args.rows, Path(tmp) / name.replace(" ", "-"), args.stream)
                above = res["peak_mb"] - floor["peak_mb"]
                print(f"{name}: peak RSS {res['peak_mb']:.0f} MB for {payload_mb:.0f} MB of {what} "
                      f"({res['peak_mb'] / payload_mb:.2f}x); floor (1 KB answers) {floor['peak_mb']:.0f} MB; "
                      f"above the floor {above:.0f} MB ({above / payload_mb:.2f}x the payload)", flush=True)
    finally:
        for s in servers:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
