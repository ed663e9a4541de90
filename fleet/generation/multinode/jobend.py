"""The end of a multi-node job (Prefect-free): the merge of its chunks' counted attempts with its
manifest (per node, per server, its cost: `merge_job`), and `fleet fetch` of a job (`fetch_job`,
`find_plan_dir`, `plan_root`). controller.py re-exports them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig
from fleet.generation.data.manifest import MANIFEST_FILE
from fleet.generation.data.objstore import Store
from fleet.generation.multinode.chunks import Assignments, Attempt, Chunk, Plan, Source, attempt_spans, merge, load_plan
from fleet.generation.multinode.cost import stored_holds
from fleet.generation.multinode.fence import attempt_part, counted_attempts
from fleet.generation.multinode.runchunk import ChunkRuns   # `Controller`'s base: its `_fetch_shards`
from fleet.node import connect

log = logging.getLogger("fleet.generation.multinode.controller")

STORE_FILE = "store.json"   # in the plan directory of a job whose output is on object storage: its URL


def part_url(output: str, node: str, chunk: Chunk) -> str:
    """Where node `node`'s first attempt at `chunk` of the job whose --output is the URL `output` puts its
    commits (a later attempt of that node at that chunk has its own: `fence.attempt_part`)."""
    return attempt_part(output, node, chunk.name)


def merge_job(cfg: FleetConfig, plan_dir: Path, plan: Plan, assign: Assignments, dest: str | Path,
              store: str | None = None, holds: list[Any] | None = None) -> dict[str, Any]:
    """The merge of one multi-node job (see chunks.merge) plus its manifest: per node, per server, cost.
    `store`: the job's output URL: the attempts' outputs are read from there, not from plan_dir.
    `holds`: each node's hold (cost.py; default: the plan directory's held.json) for the cost."""
    from fleet.generation.multinode.chunks import write_manifest_to

    attempts = [a for _, atts in assign.sources() for a in atts]
    first_start = min((a.started_at for a in attempts), default=assign.started_at)   # timestamps: wall clock
    last_end = max((a.ended_at or 0 for a in attempts), default=time.time())
    spans = attempt_spans(attempts)   # the duration: monotonic where it can be
    wall = max(1e-6, max(e for _, e in spans) - min(b for b, _ in spans)) if spans else \
        max(1e-6, last_end - first_start)
    counting: dict[int, dict[str, Any]] = {}   # source index -> the checks of its chunk's counting attempt
    sources, missing, per_node, per_server = _job_sources(plan_dir, assign, store, counting)
    _node_rates(per_node, per_server)
    ct = sum(n["completion_tokens"] for n in per_node.values())
    pt = sum(n["prompt_tokens"] for n in per_node.values())
    models = {s.get("model") for s in per_server.values() if s.get("model")}
    extra = {
        "multi_node": True,
        "input": {"path": plan.input, "rows": plan.total_lines, "chunks": len(plan.chunks)},
        "model": models.pop() if len(models) == 1 else None,
        "nodes": sorted(per_node.values(), key=lambda n: n["node"]),
        "servers": sorted(per_server.values(), key=lambda s: s["name"]),
        "timings": {"started_at": first_start, "finished_at": last_end, "wall_s": round(wall, 3)},
        "throughput": {"completion_tokens": ct, "prompt_tokens": pt,
                       "completion_tok_s": round(ct / wall, 2), "rows_per_s": None},
        "cost": _job_cost(cfg, per_node, wall, ct, holds if holds is not None else stored_holds(plan_dir)),
        "events": assign.events[-200:],
    }
    kept: list[int] = []
    manifest = merge(sources, dest, extra_manifest=extra, kept=kept)
    out = Store(str(dest))
    if missing:
        manifest.update(state="incomplete", complete=False, missing_chunks=missing)
        write_manifest_to(out, manifest)
    manifest["throughput"]["rows_per_s"] = round(manifest["counts"]["completed"] / wall, 3)
    from fleet.generation.data.checks import job_checks

    manifest["checks"], manifest["checks_basis"] = job_checks(dest, len(sources), counting, kept)
    write_manifest_to(out, manifest)
    return manifest


_Rows = dict[str, dict[str, Any]]


def _job_sources(plan_dir: Path, assign: Assignments, store: str | None = None,
                 counting: dict[int, dict[str, Any]] | None = None) -> tuple[list[Source], list[int], _Rows, _Rows]:
    """(every gathered attempt as a merge source in merge order, the chunks no attempt finished,
    per node and per server: what the finished attempts did, from their manifests). `store`: the
    attempts' outputs are read from the job's object storage (`part_url`) instead of plan_dir.
    `counting`: filled with the checks of each chunk's counting attempt (its first done one), by source index."""

    sources: list[Source] = []
    per_node: _Rows = {}
    per_server: _Rows = {}
    missing = []
    counted = counted_attempts(assign)
    for chunk, attempts in assign.sources():
        if not any(a.outcome == "done" for a in attempts):
            missing.append(chunk.index)
        if store is not None and chunk.index in counted:   # the fence: a done chunk is its counted part alone
            attempts = [counted[chunk.index]]
        took_checks = False
        for a in attempts:
            src = _attempt_source(plan_dir, chunk, a, store)
            if src is None:
                continue
            sources.append(src)
            if a.outcome != "done":
                continue
            raw = Store(str(src.dir)).read_bytes(MANIFEST_FILE)
            m = json.loads(raw) if raw else {}
            if counting is not None and not took_checks:
                checks = m.get("checks")
                counting[len(sources) - 1] = checks if isinstance(checks, dict) else {}
                took_checks = True
            n = per_node.setdefault(a.node, {"node": a.node, "chunks": 0, "rows": 0, "completion_tokens": 0,
                                              "prompt_tokens": 0, "busy_s": 0.0, "gpus": 0})
            n["chunks"] += 1
            n["rows"] += int(m.get("accounted") or 0)
            ov = m.get("overall") or {}
            n["completion_tokens"] += int(ov.get("completion_tokens") or 0)
            n["prompt_tokens"] += int(ov.get("prompt_tokens") or 0)
            n["busy_s"] += sum(e - b for b, e in attempt_spans([a]))
            n["gpus"] = max(n["gpus"], sum(int(s.get("gpus") or 1) for s in m.get("servers") or []))
            for s in m.get("servers") or []:
                ps = per_server.setdefault(s["name"], {"name": s["name"], "node": a.node, "model": s.get("model"),
                                                        "gpus": s.get("gpus"), "requests": 0,
                                                        "completion_tokens": 0, "errors": 0, "restarts": 0,
                                                        "readmissions": 0})
                for k in ("requests", "completion_tokens", "errors", "restarts", "readmissions"):
                    ps[k] += int(s.get(k) or 0)
    return sources, missing, per_node, per_server


def _attempt_source(plan_dir: Path, chunk: Chunk, a: Attempt, store: str | None) -> Source | None:
    """An attempt's output as a merge source: gathered locally, or in the store; None when there is none."""
    if store is not None:
        url = attempt_part(store, a.node, a.output)
        part = Store(url)
        return Source(chunk=chunk, node=a.node, dir=url) if part.names() else None
    d = plan_dir / "gathered" / a.node / chunk.name
    return Source(chunk=chunk, node=a.node, dir=d) if d.is_dir() else None


def _node_rates(per_node: _Rows, per_server: _Rows) -> None:
    """Each node's and server's completion tokens per busy second, and each node's share of the rows."""
    for n in per_node.values():
        n["busy_s"] = round(n["busy_s"], 2)
        n["completion_tok_s"] = round(n["completion_tokens"] / n["busy_s"], 2) if n["busy_s"] else None
        n["share"] = None
    rows_all = sum(n["rows"] for n in per_node.values()) or 1
    for n in per_node.values():
        n["share"] = round(n["rows"] / rows_all, 4)
    for s in per_server.values():
        busy = per_node.get(s["node"], {}).get("busy_s") or 0
        s["completion_tok_s"] = round(s["completion_tokens"] / busy, 2) if busy else None


def _job_cost(cfg: FleetConfig, per_node: _Rows, wall: float, ct: int, holds: list[Any] | None = None) -> dict[str, Any]:
    """Each node's GPUs for the time the job held it (cost.py), and their price when known; without the
    holds (a job recorded before them), every node that ran a chunk over the whole wall time."""
    if holds:
        from fleet.generation.multinode.cost import job_cost

        return job_cost(holds, cfg.generation.price_per_gpu_hour, ct)
    gpus = sum(n["gpus"] for n in per_node.values())
    gpu_hours = gpus * wall / 3600
    cost: dict[str, Any] = {"gpus": gpus, "gpu_hours": round(gpu_hours, 4),
                            "price_per_gpu_hour": cfg.generation.price_per_gpu_hour,
                            "basis": "every GPU of every node that ran a chunk, for the job's whole wall time"}
    if cfg.generation.price_per_gpu_hour is not None and ct:
        usd = gpu_hours * cfg.generation.price_per_gpu_hour
        cost.update(usd=round(usd, 4), usd_per_m_completion_tokens=round(usd / (ct / 1e6), 4))
    return cost


def plan_root() -> Path:
    """Where multi-node jobs keep their controller state: $XDG_STATE_HOME/fleet/jobs (~/.local/state/…)."""
    import os

    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "fleet" / "jobs"


def find_plan_dir(cfg: FleetConfig, remote: str | None) -> Path | None:
    """The plan directory of this fleet's multi-node job writing to `remote` (default: the newest one)."""
    from fleet.generation.multinode.chunks import PLAN_FILE, plan_dir_for

    root = plan_root()
    if remote is not None:
        d = plan_dir_for(root, cfg.name, remote.rstrip("/"))
        return d if (d / PLAN_FILE).exists() else None
    found = sorted(root.glob(f"{cfg.name}-*/{PLAN_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0].parent if found else None


def fetch_job(cfg: FleetConfig, plan_dir: Path, dest: str | Path) -> dict[str, Any]:
    """`fleet fetch` of a multi-node job: gather what the controller has not (finished chunks whose
    output is not here yet, the committed shards of running ones), then merge into `dest`."""
    from fleet.generation.multinode.chunks import load_plan
    from fleet.generation.job.remote import fetch
    from fleet.generation.data.manifest import read_manifest

    plan = load_plan(plan_dir)
    assert plan is not None
    assign = Assignments(plan_dir, plan)
    if (plan_dir / STORE_FILE).exists():   # every runner put its commits in the store: merge from there
        url = json.loads((plan_dir / STORE_FILE).read_text())["output"]
        return merge_job(cfg, plan_dir, plan, assign, dest, store=url)
    by_name = {n.name: n for n in cfg.nodes}
    for chunk, attempts in assign.sources():
        for a in attempts:
            local = plan_dir / "gathered" / a.node / chunk.name
            if a.outcome == "done" and read_manifest(local) is not None:
                continue
            if a.node not in by_name:
                continue
            try:
                node = connect(by_name[a.node])
                try:
                    if a.outcome == "done":
                        fetch(node, a.output, local)
                    else:
                        ChunkRuns._fetch_shards(node, a.output, local)
                finally:
                    node.close()
            except Exception as exc:   # a node that is gone: what was gathered before is used
                log.warning("could not gather %s from %s: %s", a.output, a.node, exc)
    return merge_job(cfg, plan_dir, plan, assign, dest)
