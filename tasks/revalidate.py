"""Re-validation of a running fleet: process, health, smoke and log verdict, never a relaunch.

For every server the launch records name (and every index `servers.count` expects but
no record has) one task runs the core's check (`fleet.revalidate.check_server`).

Each server leaves an artifact `<fleet>-<node>-server-<i>-revalidate`; the run leaves a
table `<fleet>-revalidate`. The flow ends Failed naming every unhealthy server. A node
the fleet was torn down on (its teardown marker, and none of the fleet's servers alive)
is not checked: its row says "nothing is up (torn down at …)", and when every node is so
the run ends Completed with that message (tasks/teardown.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.futures import PrefectFuture

from fleet.config import FleetConfig
from fleet.revalidate import REVALIDATE_COLUMNS, ServerCheck, check_server, missing_servers
from fleet.servers import records, server_paths
from fleet.torndown import describe
from fleet.torndown import read as torn_down
from tasks.states import failed, outcome
from tasks.audit import write_stage, write_table
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


@dataclass(frozen=True)
class Inventory:
    """A node's launch records of this fleet, and its teardown marker when none of them runs."""

    records: list[dict[str, Any]]
    torn_down: dict[str, Any] | None


@task(name="revalidate-inventory", task_run_name="inventory-{node_name}", **TASK_OPTS)
def inventory(cfg: FleetConfig, node_name: str) -> Inventory:
    """The launch records of this fleet on the node, and its teardown marker when nothing of it runs."""
    node_cfg = cfg.node(node_name)
    node = node_for(cfg, node_name)
    recs = records(node, node_cfg.workdir, cfg.name)
    marker = torn_down(node, node_cfg, cfg.name)
    if marker is not None:
        for rec in recs:
            pid = node.read_pid(server_paths(node_cfg.workdir, cfg.name, int(rec.get("index", 0))).pid)
            if pid is not None and node.is_alive(pid):
                marker = None  # something runs again (started outside a bring-up): check everything
                break
    return Inventory(recs, marker)


@task(name="revalidate", task_run_name="revalidate-{node_name}-{record[index]}", **TASK_OPTS)
def revalidate_server(cfg: FleetConfig, node_name: str, record: dict[str, Any]) -> ServerCheck:
    """Check one server and write its artifact; the task ends Failed (with its check) when it is unhealthy."""
    node_cfg = cfg.node(node_name)
    check = check_server(node_for(cfg, node_name), cfg, node_cfg, record)
    title = f"revalidate {node_name} server {check.index}"
    error = None if check.healthy else "\n".join(check.problems)
    write_stage(cfg, (node_name, "server", check.index, "revalidate"), title, ok=check.healthy,
                seconds=check.seconds, result=check.as_dict(), error=error, log=check.log_excerpt)
    if not check.healthy:
        get_run_logger().error("%s: unhealthy: %s", check.label(), "; ".join(check.problems))
        return failed(f"{check.label()}: " + "; ".join(check.problems), check)  # type: ignore[return-value]  # a Failed state carrying the check: outcome() gives it back
    get_run_logger().info("%s: healthy (smoke %.2f s)", check.label(), check.smoke_latency_s or 0)
    return check


@dataclass(frozen=True)
class Revalidation:
    """What a revalidate run found: the table (one row per server, or per node when it has none
    to check) and one line per unhealthy server."""

    rows: list[dict[str, Any]]
    failures: list[str]
    healthy: int
    torn_down: list[str]  # per torn-down node: "nothing is up (torn down at …)"

    @property
    def all_torn_down(self) -> bool:
        return bool(self.rows) and len(self.torn_down) == len(self.rows)


def revalidate(cfg: FleetConfig) -> Revalidation:
    """Re-validate every server of every node; write the table."""
    rows: list[tuple[tuple[str, int], dict[str, Any]]] = []   # (sort key, table row)
    failures: list[str] = []
    torn: list[str] = []
    healthy = 0
    inventories = {n.name: inventory.submit(cfg, n.name) for n in cfg.nodes}
    checks: dict[PrefectFuture[ServerCheck], tuple[str, dict[str, Any]]] = {}

    def node_row(node: str, state: str, problem: str | None) -> None:
        rows.append(((node, -1), {c: None for c in REVALIDATE_COLUMNS} | {
            "node": node, "server": "-", "state": state, "problem": problem}))

    for node_cfg in cfg.nodes:
        inv, err = outcome(inventories[node_cfg.name])
        if inv is None:
            node_row(node_cfg.name, "unreachable", err)
            failures.append(f"{node_cfg.name}: {err}")
            continue
        if inv.torn_down:
            torn.append(f"nothing is up ({describe(inv.torn_down)})")
            node_row(node_cfg.name, "torn down", torn[-1])
            continue
        for missing in missing_servers(cfg, node_cfg, inv.records):
            rows.append(((missing.node, missing.index), missing.row()))
            failures.append(f"{missing.label()}: {'; '.join(missing.problems)}")
        if not inv.records and cfg.servers.count is None:
            why = f"no servers of fleet {cfg.name!r} recorded: run the bringup deployment"
            node_row(node_cfg.name, "unhealthy", why)
            failures.append(f"{node_cfg.name}: {why}")
        for rec in inv.records:
            checks[revalidate_server.submit(cfg, node_cfg.name, rec)] = (node_cfg.name, rec)
    for fut, (node_name, rec) in checks.items():
        check, err = outcome(fut)
        index, port = rec.get("index"), rec.get("port")   # the launch record's
        if check is not None:
            rows.append(((check.node, check.index), check.row()))
            healthy += check.healthy
        else:  # the check itself could not run (node lost mid-way)
            rows.append(((node_name, int(index or 0)), {c: None for c in REVALIDATE_COLUMNS} | {
                "node": node_name, "server": index, "port": port, "state": "unknown", "problem": err}))
        if err:
            failures.append(err if err.startswith(node_name) else f"{node_name} server {index} (port {port}): {err}")
    table = [row for _, row in sorted(rows, key=lambda kr: kr[0])]
    write_table(cfg, ("revalidate",), table, f"revalidation of {cfg.name}: {healthy} healthy, {len(failures)} unhealthy"
                + (f", {len(torn)} node(s) torn down" if torn else ""))
    return Revalidation(table, failures, healthy, torn)
