"""What a multi-node job cost: each node's GPUs for the time the job held the node (pure).

Why: the cost counted every GPU of every node that ran a chunk for the job's whole wall time, and
none of the nodes that ran none (issue 35) — a node rented for the job and idle, set aside or lost
was free, and a node that joined late paid for time it was not there. The bill an operator gets is
per node, from when the node was taken (its bring-up's start) to when it was let go: the job's end,
or, for a node set aside before the job, quarantined or lost and never back, that moment.

`Hold` is one node's span; `node_holds` builds them from what the controller knows; `job_cost` is
the manifest's `cost`. A job resumed by another controller keeps each node's first `since`
(`merged_holds`, from the plan directory's held.json): the nodes were held in between too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Hold", "BASIS", "job_cost", "merged_holds", "node_holds", "record_holds", "stored_holds", "HELD_FILE"]

HELD_FILE = "held.json"   # in the plan directory: each node's Hold, for `fleet fetch` and a next controller
BASIS = ("each node's GPUs for the time the job held it: from the start of its bring-up to its release "
         "(the job's end; for a node set aside, quarantined or lost that never came back, that moment); "
         "nodes that ran no chunk count too")


@dataclass(frozen=True)
class Hold:
    node: str
    gpus: int
    since: float          # wall clock: the start of the node's bring-up for this job
    until: float          # wall clock: its release
    released: str         # why then: "job end", "set aside", "quarantined", "lost"

    @property
    def held_s(self) -> float:
        return max(0.0, self.until - self.since)


def node_holds(gpus: dict[str, int], since: float, end: float, *, set_aside: dict[str, float] | None = None,
               quarantined: dict[str, float] | None = None, lost: dict[str, float] | None = None) -> list[Hold]:
    """Each node's Hold: `gpus` names every node the job took (set aside ones included); `since` the
    bring-up's start; `end` the job's end. A node in `set_aside` / `quarantined` / `lost` (node -> when,
    wall clock) was released then (lost: only when it never came back — the caller passes those)."""
    out = []
    for name in sorted(gpus):
        until, why = end, "job end"
        for what, when in (("set aside", set_aside), ("quarantined", quarantined), ("lost", lost)):
            if when and name in when:
                until, why = min(end, max(since, when[name])), what
                break
        out.append(Hold(name, gpus[name], since, until, why))
    return out


def merged_holds(new: list[Hold], old: list[dict[str, Any]] | None) -> list[Hold]:
    """`new` with each node's `since` taken from an earlier controller's record (`old`) when earlier."""
    first = {h["node"]: float(h["since"]) for h in old or [] if "node" in h and "since" in h}
    return [Hold(h.node, h.gpus, min(h.since, first.get(h.node, h.since)), h.until, h.released) for h in new]


def job_cost(holds: list[Hold], price_per_gpu_hour: float | None, completion_tokens: int) -> dict[str, Any]:
    """The manifest's `cost`: GPU hours per node and in all, and their price when known."""
    nodes = [{**asdict(h), "held_s": round(h.held_s, 3), "gpu_hours": round(h.gpus * h.held_s / 3600, 6)}
             for h in holds]
    gpu_hours = sum(h.gpus * h.held_s for h in holds) / 3600
    cost: dict[str, Any] = {"gpus": sum(h.gpus for h in holds), "gpu_hours": round(gpu_hours, 4),
                            "price_per_gpu_hour": price_per_gpu_hour, "basis": BASIS, "nodes": nodes}
    if price_per_gpu_hour is not None:
        for n in nodes:
            n["usd"] = round(n["gpu_hours"] * price_per_gpu_hour, 4)
        usd = gpu_hours * price_per_gpu_hour
        cost["usd"] = round(usd, 4)
        if completion_tokens:
            cost["usd_per_m_completion_tokens"] = round(usd / (completion_tokens / 1e6), 4)
    return cost


def _read(plan_dir: Path) -> list[dict[str, Any]] | None:
    try:
        got = json.loads((plan_dir / HELD_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return got if isinstance(got, list) else None


def record_holds(plan_dir: Path, gpus: dict[str, int], since: float, end: float, **released: Any) -> list[Hold]:
    """`node_holds` with an earlier controller's first `since` kept (`merged_holds`), written to held.json."""
    from fleet.generation.data.durable import write_json_atomic

    holds = merged_holds(node_holds(gpus, since, end, **released), _read(plan_dir))
    write_json_atomic(plan_dir / HELD_FILE, [asdict(h) for h in holds])
    return holds


def stored_holds(plan_dir: Path) -> list[Hold] | None:
    """The holds the job's controller recorded (held.json), or None (a job recorded before them)."""
    got = _read(plan_dir)
    try:
        return [Hold(**h) for h in got] if got else None
    except TypeError:   # a record this version cannot read
        return None
