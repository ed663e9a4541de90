"""A lost controller's cost (issue 35 item 4): how long a new controller takes to pick the job up.

    .venv/bin/python bench/bench_takeover.py [--reps 2] [--tree /tmp/old-checkout] [--rows 3000]

Real parts: moto's S3 server on a loopback port (input and output there), two local nodes of sim
servers (bench_multinode's config: `fast` with 2, `slow` with 1), the local Prefect server of one
PREFECT_HOME (the first command starts it: its first start is not a takeover's cost), the
`fleet generate` command. Per rep: a first controller runs the job until a chunk runs on each node,
then is SIGKILLed with its process group (the nodes' detached runners and servers go on); a second
controller with another state home (XDG_STATE_HOME: nothing of the first one's plan directory) runs
the same command. Timed from the second command's start, by the lines it prints (each stamped when
read): the plan and state read from the store, the first running chunk re-attached, the first chunk
started by the new controller. The job is then left to finish (every id once is checked).

`--tree DIR` runs the reps of another checkout too (e.g. `git worktree add --detach DIR REV`),
alternated with this one's: the before figure. One JSON line per rep, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_controller_bytes import _moto, _port_block, _stop_nodes  # noqa: E402

MARKS = (("plan_read_s", re.compile(r"the job's plan and state read from")),
         ("first_reattach_s", re.compile(r"chunk \d+ \(\d+ lines\) re-attached on")),
         ("first_start_s", re.compile(r"chunk \d+ \(\d+ lines\) started on|chunk \d+ started on \S+ while")))


class Command:
    """A `fleet generate` whose output lines are read as they come, each stamped (monotonic)."""

    def __init__(self, tree: Path, cfg: Path, env: dict[str, str], log: Path) -> None:
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "generate", "-c", str(cfg),
                                      "--input", "s3://bench/in/prompts.jsonl", "--output", "s3://bench/out"],
                                     cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def first(self, pattern: re.Pattern[str]) -> float | None:
        return next((t for t, ln in self.lines if pattern.search(ln)), None)

    def count(self, pattern: re.Pattern[str]) -> int:
        return sum(1 for _, ln in self.lines if pattern.search(ln))

    def wait_for(self, check: Any, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None:
                raise SystemExit(f"the command ended (rc {self.proc.returncode}) before {what}: "
                                 + "\n".join(ln for _, ln in self.lines[-30:]))
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}: " + "\n".join(ln for _, ln in self.lines[-30:]))
            time.sleep(0.1)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(timeout=10)
        self.log.close()


def one(rep: int, tree: Path, home: Path, base: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    from bench_multinode import config
    from fleet.demo import to_toml
    from fleet.generation.data.objstore import Store

    tmp = Path(tempfile.mkdtemp(prefix=f"bench-takeover-{rep}-"))
    ns = argparse.Namespace(tokens_per_s=args.tokens_per_s, mrr=args.mrr, max_tokens=args.max_tokens,
                            chunk_rows=args.chunk_rows)
    cfg = config(tmp, _port_block(3), ns)
    cfg_path = tmp / "fleet.toml"
    cfg_path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    store = Store("s3://bench")
    if store.exists("out"):   # the last rep's output: each rep is a new job
        store.fs.rm(store._p("out"), recursive=True)
    env = {**base, "PYTHONPATH": str(tree), "XDG_STATE_HOME": str(tmp / "state1")}
    started = re.compile(r"chunk \d+ \(\d+ lines\) started on (\w+)")
    first = Command(tree, cfg_path, env, tmp / "first.log")
    try:
        first.wait_for(lambda: len({m.group(1) for _, ln in first.lines for m in [started.search(ln)] if m}) >= 2,
                       "a chunk running on each node", args.timeout)
    finally:
        first.kill()
    second = Command(tree, cfg_path, {**env, "XDG_STATE_HOME": str(tmp / "state2")}, tmp / "second.log")
    try:
        second.wait_for(lambda: second.first(MARKS[2][1]) is not None, "the new controller's first chunk",
                        args.timeout)
        got: dict[str, Any] = {name: second.first(p) for name, p in MARKS}
        rc = second.proc.wait(timeout=args.timeout)
    finally:
        second.kill()
        _stop_nodes(cfg)
    return {"rep": rep, "tree": str(tree), "rc": rc, **{k: round(v, 2) if v is not None else None for k, v in got.items()},
            "second_wall_s": round(second.lines[-1][0], 1) if second.lines else None,
            "ids": _ids(), "rows": args.rows, "load1": round(os.getloadavg()[0], 1), "log": str(tmp / "second.log")}


def _ids() -> dict[str, int]:
    """The merged output's ids: how many, how many distinct."""
    import pyarrow.parquet as pq

    from fleet.generation.data.objstore import Store
    from fleet.generation.job.publish import store_shards

    out = Store("s3://bench/out")
    ids: list[str] = []
    for name in store_shards(out):
        with out.open_read(f"shards/{name}") as f:
            ids += pq.read_table(f, columns=["id"]).column(0).to_pylist()
    return {"ids": len(ids), "distinct": len(set(ids))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tree", type=Path, default=None, help="another checkout, run alternated with this one")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tokens-per-s", type=float, default=200)
    ap.add_argument("--mrr", type=int, default=8)
    ap.add_argument("--chunk-rows", type=int, default=250)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    from bench_multinode import prompts
    from fleet.generation.data.objstore import Store

    tmp = Path(tempfile.mkdtemp(prefix="bench-takeover-"))
    moto, port = _moto(tmp)
    home = tmp / "prefect"
    base = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    os.environ.update({k: base[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                            "AWS_ENDPOINT_URL")})
    Store("s3://bench").fs.mkdir("bench")
    Store("s3://bench").put_file(str(prompts(tmp / "in.jsonl", args.rows)), "in/prompts.jsonl")
    trees = [ROOT] + ([args.tree.resolve()] if args.tree else [])
    results: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for tree in (trees if rep % 2 == 0 else trees[::-1]):
                r = one(rep, tree, home, base, args)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        from flows.localserver import stop

        stop(home / "fleet-server")
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait()
    for tree in trees:
        mine = [r for r in results if r["tree"] == str(tree)]
        med = {k: statistics.median(r[k] for r in mine if r[k] is not None)
               for k, _ in MARKS if any(r[k] is not None for r in mine)}
        print(json.dumps({"tree": str(tree), "reps": len(mine), "median": med}), flush=True)


if __name__ == "__main__":
    main()
