"""The `fleet` flow: provision → venv → stage → parallel per-GPU launch → smoke, per node.

`prefect deployment run fleet/bringup` starts it (flow `fleet`, deployment `bringup`);
`fleet up -c FILE` runs the same flow in-process. A failed server never fails its healthy
peers: the flow ends Failed with the summary table of what is up and what is not, and a
re-run redoes only what is missing (every stage adopts what is already in place).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from fleet.config import FleetConfig, config_from_param
from fleet.engines import ServerSpec
from fleet.servers import plan_servers
from fleet.smoke import compare_kv
from tasks.audit import write_table
from tasks.bringup import launch_server, provision, smoke_server, stage, venv
from tasks.nodes import close_all

Action = Literal["bringup", "teardown"]

SUMMARY_COLUMNS = ["node", "server", "gpus", "port", "pid", "state", "ready_s", "smoke_latency_s",
                   "kv_cache_tokens", "max_running_requests", "flag", "error"]


def _outcome(fut: PrefectFuture) -> tuple[Any, str | None]:
    """(result, None) or (None, error text) without raising."""
    fut.wait()
    state = fut.state
    if state.is_completed():
        return fut.result(), None
    try:
        fut.result(raise_on_failure=True)
    except Exception as exc:  # the task's exception, re-raised by Prefect
        return None, str(exc).splitlines()[0][:500]
    return None, f"task ended {state.name}"


def _row(node: str, index: Any, **kw: Any) -> dict[str, Any]:
    row = {c: None for c in SUMMARY_COLUMNS}
    row.update(node=node, server=index, **kw)
    return row


def bringup(cfg: FleetConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Run the DAG for every node; return (summary rows, failure lines)."""
    logger = get_run_logger()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    # 1. provision every node in parallel; a node that fails stops here.
    provs = {n.name: provision.submit(cfg, n.name) for n in cfg.nodes}
    provisioned: dict[str, dict[str, Any]] = {}
    for name, fut in provs.items():
        res, err = _outcome(fut)
        if err:
            rows.append(_row(name, "-", state="provision failed", error=err))
            failures.append(f"{name}: provision: {err}")
        else:
            provisioned[name] = res

    # 2 + 3. venv and RAM-disk staging, in parallel, per node.
    prepared: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    futs = {name: (venv.submit(cfg, name, p), stage.submit(cfg, name, p)) for name, p in provisioned.items()}
    for name, (vf, sf) in futs.items():
        v, verr = _outcome(vf)
        s, serr = _outcome(sf)
        for what, err in (("venv", verr), ("stage", serr)):
            if err:
                rows.append(_row(name, "-", state=f"{what} failed", error=err))
                failures.append(f"{name}: {what}: {err}")
        if not verr and not serr:
            prepared[name] = (v, s)

    # 4. launch every server of every ready node at once; 5. smoke each as soon as it is ready.
    specs: list[ServerSpec] = []
    for name, (v, s) in prepared.items():
        node_cfg = next(n for n in cfg.nodes if n.name == name)
        specs += plan_servers(cfg, node_cfg, provisioned[name]["gpu_ids"], model_path=s["model_path"],
                              python=v["python"])
    logger.info("launching %d server(s) on %d node(s)", len(specs), len(prepared))
    launches = {launch_server.submit(cfg, spec): spec for spec in specs}
    launched: dict[tuple[str, int], dict[str, Any]] = {}
    smokes: dict[PrefectFuture, ServerSpec] = {}
    for fut in as_completed(list(launches)):
        spec = launches[fut]
        res, err = _outcome(fut)
        if err:
            rows.append(_row(spec.node, spec.index, gpus=list(spec.gpus), port=spec.port, state="launch failed",
                             error=err))
            failures.append(f"{spec.node} server {spec.index} (port {spec.port}): {err}")
            continue
        launched[(spec.node, spec.index)] = res
        smokes[smoke_server.submit(cfg, spec, res)] = spec
    for fut, spec in smokes.items():
        res, err = _outcome(fut)
        lr = launched[(spec.node, spec.index)]
        facts = lr.get("facts") or {}
        row = _row(spec.node, spec.index, gpus=list(spec.gpus), port=spec.port, pid=lr["pid"],
                   ready_s=lr.get("ready_s"), kv_cache_tokens=facts.get("kv_cache_tokens"),
                   max_running_requests=facts.get("max_running_requests"))
        if err:
            row.update(state="smoke failed", error=err)
            failures.append(f"{spec.node} server {spec.index} (port {spec.port}): {err}")
        else:
            row.update(state="adopted" if lr.get("adopted") else "up", smoke_latency_s=round(res["latency_s"], 3),
                       max_running_requests=res.get("max_running_requests") or row["max_running_requests"])
        rows.append(row)

    flags = compare_kv({f"{r['node']}/{r['server']}": r["kv_cache_tokens"] for r in rows
                        if r["state"] in ("up", "adopted")}, cfg.smoke.kv_cache_min_ratio)
    for r in rows:
        flag = flags.get(f"{r['node']}/{r['server']}")
        if flag:
            r["flag"] = flag
            logger.warning("%s server %s: %s", r["node"], r["server"], flag)
    rows.sort(key=lambda r: (r["node"], -1 if r["server"] == "-" else r["server"]))
    return rows, failures


@flow(name="fleet", task_runner=ThreadPoolTaskRunner(max_workers=32), log_prints=True,
      flow_run_name="{action}-{config.name}")
def fleet(config: FleetConfig = FleetConfig(), action: Action = "bringup") -> Any:
    """Bring up (or tear down) every server of a fleet config. Ends Failed when any server is not up."""
    cfg = config_from_param(config)
    t0 = time.monotonic()
    try:
        if action == "teardown":
            from tasks.teardown import teardown

            rows = teardown(cfg)
            write_table(cfg, ("teardown",), rows, f"teardown of {cfg.name}")
            return Completed(message=f"stopped {sum(1 for r in rows if r['action'] != 'none')} server(s)", data=rows)
        rows, failures = bringup(cfg)
    finally:
        close_all()
    up = sum(1 for r in rows if r["state"] in ("up", "adopted"))
    write_table(cfg, ("summary",), rows,
                f"{cfg.name}: {up} server(s) up, {len(failures)} failure(s), {time.monotonic() - t0:.1f} s")
    if failures:
        return Failed(message=f"{up} server(s) up; {len(failures)} failed: " + " | ".join(failures), data=rows)
    return Completed(message=f"{up} server(s) up in {time.monotonic() - t0:.1f} s", data=rows)
