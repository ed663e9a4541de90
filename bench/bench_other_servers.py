"""Other people's servers (issue 33): one bad endpoint among four, what it costs the job.

    .venv/bin/python bench/bench_other_servers.py [--rows 600] [--tokens-per-s 200] [--max-tokens 32] [--repeats 1]

Three healthy `fleet sim` processes and one stand-in on loopback (bench/garbage.py), all four as
`[[endpoints]]`, each job through the runner in-process (`run_local`):

- baseline      the three healthy sims alone: the healthy servers' ideal makespan
- fast-400      the fourth answers every chat at once with HTTP 400 "maximum context length is 2048
                tokens" (a server started with a shorter context than its peers)
- rate-limit    the fourth answers its first 12 chats with HTTP 429 Retry-After: 1, then valid answers
                (a hosted endpoint's quota), 50 ms each

Per case: rows done (and on the healthy servers), errors, makespan ÷ the baseline's, and what reached
the fourth server: chats the dispatcher sent it, chats it received in all (the difference: probes
while it was out), its 429s, its downs and last down reason. Prints a table and, unless --no-append,
adds it to bench/RESULTS.md under "## Other people's servers".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from garbage import GOOD, GarbageServer, Reply, write_rows  # noqa: E402

from fleet.config import FleetConfig  # noqa: E402

CONTEXT_400 = Reply("400", status=400, body=json.dumps({"object": "error", "message": (
    "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens."),
    "type": "BadRequestError", "code": 400}).encode())
RATE_429 = Reply("429", status=429, headers=(("Retry-After", "1"),),
                 body=b'{"error":{"message":"Rate limit reached","type":"rate_limit"}}')
VALID = Reply("valid", body=json.dumps({**GOOD, "model": "sim-model"}).encode(), delay_s=0.05)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sim(tokens_per_s: float, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "sim", "--port", str(port), "--startup-s", "0",
                             "--tokens-per-s", str(tokens_per_s), "--max-running-requests", "8"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sim on {url} did not start: {log.read_text()[-2000:]}")


def one_job(work: Path, urls: list[tuple[str, str]], rows: int, max_tokens: int) -> dict[str, Any]:
    from fleet.generation.job.endpoints import endpoint_entries
    from fleet.generation.job.runner import run_local

    work.mkdir(parents=True)
    inp, out = work / "in.jsonl", work / "out"
    write_rows(inp, rows)
    cfg = FleetConfig(servers={"count": 0}, engine={"kind": "sim"},
                      generation={"max_tokens": max_tokens, "max_concurrency_per_server": 8},
                      endpoints=[{"name": n, "url": u, "model": "sim-model", "engine": "sim"} for n, u in urls])
    t0 = time.monotonic()
    rc = run_local(cfg, inp, out, endpoint_entries(cfg), progress_interval_s=0.5, flush_interval_s=2.0)
    wall = time.monotonic() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    return {"rc": rc, "wall_s": wall, "counts": manifest["counts"],
            "servers": {s["name"]: s for s in manifest["servers"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--tokens-per-s", type=float, default=200.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-other-servers-"))
    sims = [start_sim(args.tokens_per_s, tmp / f"sim{i}.log") for i in range(3)]
    healthy = [(f"good{i}", url) for i, (_, url) in enumerate(sims)]
    lines: list[str] = []
    try:
        results: dict[str, list[dict[str, Any]]] = {"baseline": [], "fast-400": [], "rate-limit": []}
        for r in range(args.repeats):
            results["baseline"].append(one_job(tmp / f"baseline-{r}", healthy, args.rows, args.max_tokens))
            for case, script, then in (("fast-400", [CONTEXT_400], None), ("rate-limit", [RATE_429] * 12, VALID)):
                bad = GarbageServer(script, then=then)
                try:
                    res = one_job(tmp / f"{case}-{r}", [*healthy, ("bad", bad.url)], args.rows, args.max_tokens)
                    res["received"] = len(bad.served)
                    res["r429"] = bad.served.count("429")
                finally:
                    bad.close()
                results[case].append(res)
        base = sorted(x["wall_s"] for x in results["baseline"])[len(results["baseline"]) // 2]
        head = ("| case | exit | rows done | on healthy | errors | makespan s | ÷ healthy ideal | sent to bad | "
                "received by bad | 429s | downs | bad's last down reason |")
        lines += [head, "| --- " * 12 + "|"]
        for case, runs in results.items():
            for x in runs:
                b = x["servers"].get("endpoint/bad", {})
                on_healthy = sum(s["requests"] for n, s in x["servers"].items() if n != "endpoint/bad")
                lines.append(
                    f"| {case} | {x['rc']} | {x['counts'].get('completed', 0)} | {on_healthy} | "
                    f"{x['counts'].get('errors', 0)} | {x['wall_s']:.2f} | {x['wall_s'] / base:.2f} | "
                    f"{b.get('sent', '-')} | {x.get('received', '-')} | {x.get('r429', '-')} | {b.get('downs', '-')} | "
                    f"{(b.get('down_reason') or '-')[:150]} |")
    finally:
        for proc, _ in sims:
            proc.kill()
            proc.wait(10)
    cmd = "python bench/bench_other_servers.py " + shlex.join(sys.argv[1:])
    load = os.getloadavg()[0]
    header = (f"\n## Other people's servers (issue 33), {dt.date.today()}\n\n`{cmd}` on {platform.node() or 'this box'} "
              f"({os.cpu_count()} cores, load {load:.1f} at the end; shared): {args.rows} rows, max_tokens "
              f"{args.max_tokens}, three sims at {args.tokens_per_s:g} tok/s per row × 8 slots, and a fourth "
              "endpoint that is bad. \"Sent to bad\": chats the dispatcher sent it; \"received\": every chat it got "
              "(the rest are probes while it was out). The healthy ideal is the three sims alone.\n\n")
    text = header + "\n".join(lines) + "\n"
    print(text)
    if not args.no_append:
        with (ROOT / "bench" / "RESULTS.md").open("a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
