"""One job over two nodes of unequal speed: makespan ÷ ideal, against the same job split in halves by hand.

    .venv/bin/python bench/bench_multinode.py --rows 20000 [--max-tokens 32 --tokens-per-s 100 --mrr 16]

Two local nodes on this machine (sim servers): "fast" with 2 servers, "slow" with 1 (half the
capacity). Each pass runs the same input:

- split by hand: the first half to fast, the second to slow, two detached single-node runners at
  once; makespan = the later of the two. Each node's capacity (completion tok/s while both ran) is
  measured here too.
- fleet: `fleet generate`'s flow over both nodes (chunks pulled); makespan = first chunk start to
  last chunk end (the flow's bring-up adoption, the cut and the merge are reported apart).

ideal = total completion tokens / (capacity fast + capacity slow). The capacities come from
the by-hand pass, where each node ran flat out on its half; a slow node running alone after the
fast one finished gets more CPU on this shared machine, so the ideal is if anything optimistic.
`--big` instead runs one large job over both nodes and reports wall, peak RSS of every runner
(polled from /proc) and of the controller, and the exact counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def config(tmp: Path, base_port: int, args: argparse.Namespace):
    from fleet.config import FleetConfig

    nodes = []
    for name, servers, port in (("fast", 2, base_port), ("slow", 1, base_port + 2)):
        (tmp / f"shm-{name}").mkdir(exist_ok=True)
        nodes.append({"name": name, "workdir": str(tmp / f"work-{name}"), "servers": servers, "base_port": port,
                      "ramdisk": str(tmp / f"shm-{name}")})
    return FleetConfig(
        name="bench-mn", nodes=nodes,
        engine={"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": args.tokens_per_s,
                                       "max_running_requests": args.mrr}},
        model={"served_name": "sim-model"},
        venv={"path": sys.prefix, "use_existing": True},
        servers={"ready_timeout_s": 120, "stop_grace_s": 2},
        smoke={"first_timeout_s": 30, "timeout_s": 10},
        generation={"max_tokens": args.max_tokens, "chunk_rows": args.chunk_rows, "node_lost_s": 120,
                    "max_concurrency_per_server": args.mrr},
    )


def prompts(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question number {i}"}]})
                    + "\n")
    return path


class RssWatch:
    """Peak RSS (VmHWM) of every runner process under the nodes' workdirs, polled from /proc."""

    def __init__(self, workdirs: list[Path]) -> None:
        self.workdirs = workdirs
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for wd in self.workdirs:
                for pidf in wd.glob("jobs/*/runner.pid"):
                    try:
                        pid = int(pidf.read_text().split()[0])
                        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                            if line.startswith("VmHWM:"):
                                kb = int(line.split()[1])
                                key = f"{wd.name}:{pid}"
                                self.peak[key] = max(self.peak.get(key, 0), kb)
                    except (OSError, ValueError):
                        continue

    def __enter__(self) -> RssWatch:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def by_hand(cfg, specs, inp: Path, tmp: Path, tag: str) -> dict[str, Any]:
    from fleet.generation.job.remote import start_job
    from fleet.node import LocalNode

    lines = inp.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    parts = {"fast": lines[:half], "slow": lines[half:]}
    handles = {}
    t0 = time.monotonic()
    for name, part in parts.items():
        p = tmp / f"half-{tag}-{name}.jsonl"
        p.write_text("".join(part))
        node_cfg = cfg.node(name)
        handles[name] = start_job(LocalNode(name), cfg, node_cfg, input_path=str(p), output=str(tmp / f"hand-{tag}-{name}"),
                                  specs=[s for s in specs if s.node == name])
    walls = {}
    node = LocalNode()
    while len(walls) < 2:
        for name, h in handles.items():
            if name not in walls and not node.is_alive(h.pid):
                walls[name] = time.monotonic() - t0
        time.sleep(0.1)
    out = {"makespan_s": round(max(walls.values()), 2), "nodes": {}}
    for name in parts:
        m = json.loads((tmp / f"hand-{tag}-{name}" / "manifest.json").read_text())
        tok = m["throughput"]["completion_tokens"]
        out["nodes"][name] = {"wall_s": round(walls[name], 2), "completed": m["counts"]["completed"],
                              "completion_tokens": tok, "dispatch_s": m["timings"]["dispatch_s"],
                              "capacity_tok_s": round(tok / m["timings"]["dispatch_s"], 1)}
    out["completion_tokens"] = sum(n["completion_tokens"] for n in out["nodes"].values())
    return out


def fleet_run(cfg, inp: Path, tmp: Path, tag: str) -> dict[str, Any]:
    from flows.fleet import fleet

    t0 = time.monotonic()
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(tmp / f"fleet-{tag}"), return_state=True)
    wall = time.monotonic() - t0
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), (state.message, res)
    m = json.loads((Path(res["output"]) / "manifest.json").read_text())
    plan = json.loads((Path(res["plan_dir"]) / "plan.json").read_text())
    return {"makespan_s": m["timings"]["wall_s"], "command_s": round(wall, 2), "completed": m["counts"]["completed"],
            "errors": m["counts"]["errors"], "completion_tokens": m["throughput"]["completion_tokens"],
            "chunks": len(plan["chunks"]), "chunk_sizes": [c["lines"] for c in plan["chunks"]],
            "nodes": {n["node"]: {k: n[k] for k in ("chunks", "rows", "share", "busy_s")} for n in m["nodes"]},
            "duplicates_dropped": m["merge"]["duplicates_dropped"], "output": res["output"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tokens-per-s", type=float, default=100.0)
    ap.add_argument("--mrr", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=None)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--big", action="store_true", help="one large job: wall, RSS, exact counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    tmp = Path(tempfile.mkdtemp(prefix="bench-mn-"))
    os.environ["XDG_STATE_HOME"] = str(tmp / "state")
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    from fleet.demo import free_port_block
    from fleet.node import connect
    from fleet.servers import stop_servers

    cfg = config(tmp, free_port_block(3, start=31700), args)
    inp = prompts(tmp / "in.jsonl", args.rows)
    result: dict[str, Any] = {"args": vars(args), "host": {"cpus": os.cpu_count(), "load": os.getloadavg()}}
    try:
        from flows.fleet import fleet

        state = fleet(config=cfg, action="bringup", return_state=True)
        assert state.is_completed(), state.message
        from fleet.servers import plan_servers

        specs = []
        for n in cfg.nodes:
            specs += plan_servers(cfg, n, [], model_path="", python=sys.executable)
        if args.big:
            with RssWatch([tmp / "work-fast", tmp / "work-slow"]) as rss:
                run = fleet_run(cfg, inp, tmp, "big")
            from fleet.generation.data.checks import account

            result["big"] = {**run, "runner_peak_rss_mb": {k: round(v / 1024, 1) for k, v in rss.peak.items()},
                             "max_runner_rss_mb": round(max(rss.peak.values()) / 1024, 1) if rss.peak else None,
                             "controller_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
            try:
                result["big"]["account"] = account(inp, run["output"])
            except Exception as exc:
                result["big"]["account"] = f"{type(exc).__name__}: {exc}"
        else:
            result["passes"] = []
            for p in range(args.passes):
                hand = by_hand(cfg, specs, inp, tmp, str(p))
                multi = fleet_run(cfg, inp, tmp, str(p))
                cap = sum(n["capacity_tok_s"] for n in hand["nodes"].values())
                ideal_multi = multi["completion_tokens"] / cap
                ideal_hand = hand["completion_tokens"] / cap
                result["passes"].append({
                    "by_hand": hand, "fleet": multi, "capacity_tok_s": round(cap, 1),
                    "fleet_makespan_over_ideal": round(multi["makespan_s"] / ideal_multi, 3),
                    "by_hand_makespan_over_ideal": round(hand["makespan_s"] / ideal_hand, 3),
                })
                print(json.dumps(result["passes"][-1], indent=1, default=str), flush=True)
    finally:
        for n in cfg.nodes:
            stop_servers(connect(n), cfg, n)
    result["host"]["load_end"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
