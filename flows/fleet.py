"""The `fleet` flow: provision → venv → stage → parallel per-GPU launch → smoke, per node.

`prefect deployment run fleet/bringup` starts it (flow `fleet`, deployment `bringup`);
`fleet up -c FILE` runs the same flow in-process. A failed server never fails its healthy
peers: the flow ends Failed with the summary table of what is up and what is not, and a
re-run redoes only what is missing (every stage adopts what is already in place).

Actions: `bringup`, `revalidate` (process, health, smoke and log verdict of every recorded
server, no relaunch: tasks/revalidate.py), `teardown` (stop every server; with
free_ramdisk=True also remove the RAM-disk copy). Each holds the per-node Prefect
concurrency limit `fleet-node-<machine>` for its whole run (tasks/locks.py), so two runs
never launch onto the same GPUs at once: a second one waits for the first, then adopts.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import get_run_logger
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Cancelled, Completed
from prefect.task_runners import ThreadPoolTaskRunner

from fleet.config import FleetConfig
from fleet.engines import ServerSpec
from fleet.errors import FleetError, InputChanged, JobConflict
from fleet.generation.data.objstore import is_url
from fleet.interrupt import clear_stop, installed, interrupted, park, request_stop
from fleet.servers import plan_servers
from fleet.smoke import compare_kv
from fleet.stages import SUMMARY_COLUMNS, Launched, ModelPlace, Provisioned, ServerRow, Smoked, TeardownRow

__all__ = ["SUMMARY_COLUMNS", "ServerRow", "fleet"]
from fleet.venv import VenvResult
from flows.alerts import announce_failure, clear_cause
from flows.cancel import CANCELLED_MESSAGE, cancel_seen, end_cancelled
from flows.outcome import quiet_expected_failures
from flows.params import for_deployment, lazy_schema_flow, resolve_config, run_name
from tasks.audit import write_not_run, write_table
from tasks.bringup import launch_server, provision, retire, smoke_server, stage, venv
from tasks.locks import hold_nodes
from tasks.nodes import close_all
from tasks.states import failed, outcome

# The engine's traceback for a run this flow failed on purpose is noise (flows/outcome.py).
quiet_expected_failures()

Action = Literal["bringup", "revalidate", "teardown", "generate"]


@dataclass
class _Summary:
    """The summary table as the stages fill it in, and one line per failure."""

    rows: list[ServerRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def node_failed(self, node: str, what: str, err: str | None) -> None:
        self.rows.append(ServerRow(node, "-", state=f"{what} failed", error=err))
        self.failures.append(f"{node}: {what}: {err}")

    def server_failed(self, row: ServerRow, state: str, err: str | None) -> None:
        row.state, row.error = state, err
        self.rows.append(row)
        self.failures.append(f"{row.node} server {row.server} (port {row.port}): {err}")


def bringup(cfg: FleetConfig) -> tuple[list[ServerRow], list[str], list[ServerSpec]]:
    """Run the DAG for every node; return (summary rows, failure lines, specs of the servers up)."""
    summary = _Summary()
    provisioned = _provision(cfg, summary)
    prepared = _prepare(cfg, provisioned, summary)
    specs: list[ServerSpec] = []
    for name, (v, s) in prepared.items():
        specs += plan_servers(cfg, cfg.node(name), provisioned[name].gpu_ids, model_path=s.model_path,
                              python=v.python)
    _retire(cfg, list(prepared), specs, summary)
    get_run_logger().info("launching %d server(s) on %d node(s)", len(specs), len(prepared))
    _launch_and_smoke(cfg, specs, summary)
    _flag_small_kv_caches(cfg, summary.rows)
    rows = sorted(summary.rows, key=ServerRow.sort_key)
    up = {(r.node, r.server) for r in rows if r.up}
    return rows, summary.failures, [s for s in specs if (s.node, s.index) in up]


def _provision(cfg: FleetConfig, summary: _Summary) -> dict[str, Provisioned]:
    """1. Provision every node in parallel; a node that fails stops here."""
    provs = {n.name: provision.submit(cfg, n.name) for n in cfg.nodes}
    provisioned: dict[str, Provisioned] = {}
    for name, fut in provs.items():
        prov, err = outcome(fut)
        if prov is None:
            summary.node_failed(name, "provision", err)
        else:
            provisioned[name] = prov
    for name in provs:
        if name not in provisioned:
            _not_reached(cfg, name, ("venv", "stage"), "the node's provision failed")
    return provisioned


def _prepare(cfg: FleetConfig, provisioned: dict[str, Provisioned],
             summary: _Summary) -> dict[str, tuple[VenvResult, ModelPlace]]:
    """2 + 3. The venv and the RAM-disk copy of the model, in parallel, per node."""
    prepared: dict[str, tuple[VenvResult, ModelPlace]] = {}
    futs = {name: (venv.submit(cfg, name, p), stage.submit(cfg, name, p)) for name, p in provisioned.items()}
    for name, (vf, sf) in futs.items():
        v, verr = outcome(vf)
        s, serr = outcome(sf)
        for what, err in (("venv", verr), ("stage", serr)):
            if err:
                summary.node_failed(name, what, err)
        if v is not None and s is not None:
            prepared[name] = (v, s)
        else:
            _not_reached(cfg, name, (), f"the node's {'venv' if verr else 'staging'} failed")
    return prepared


def _retire(cfg: FleetConfig, nodes: list[str], specs: list[ServerSpec], summary: _Summary) -> None:
    """3b. One server per slot: each node's recorded servers whose slot is no longer planned are
    stopped before the launches (a row "retired" each); one a live job uses is a failure."""
    # a node that plans no server at all is left alone: that is a teardown's job, not a bring-up's
    futs = {name: retire.submit(cfg, name, [s.index for s in specs if s.node == name]) for name in nodes
            if any(s.node == name for s in specs)}
    for name, fut in futs.items():
        retired, err = outcome(fut)
        if retired is None:
            summary.failures.append(f"{name}: retire: {err}")
            summary.rows.append(ServerRow(name, "-", state="retire failed", error=err))
            continue
        for r in retired:
            summary.rows.append(ServerRow(name, r["index"], port=r["port"], pid=r["pid"],
                                          state="retired (no longer in the config)"))


def _launch_and_smoke(cfg: FleetConfig, specs: list[ServerSpec], summary: _Summary) -> None:
    """4. Launch every server of every ready node at once; 5. smoke each as soon as it is ready."""
    launches = {launch_server.submit(cfg, spec): spec for spec in specs}
    launched: dict[tuple[str, int], Launched] = {}
    smokes: dict[PrefectFuture[Smoked], ServerSpec] = {}
    for lfut in as_completed(list(launches)):
        spec = launches[lfut]
        started, err = outcome(lfut)
        if started is None:
            summary.server_failed(ServerRow(spec.node, spec.index, gpus=list(spec.gpus), port=spec.port),
                                  "launch failed", err)
            write_not_run(cfg, (spec.node, "server", spec.index, "smoke"), f"smoke {spec.node} server {spec.index}",
                          "its launch failed")
            continue
        launched[(spec.node, spec.index)] = started
        smokes[smoke_server.submit(cfg, spec, started)] = spec
    for sfut, spec in smokes.items():
        smoked, err = outcome(sfut)
        lr = launched[(spec.node, spec.index)]
        row = ServerRow(spec.node, spec.index, gpus=list(spec.gpus), port=spec.port, pid=lr.pid, ready_s=lr.ready_s,
                        kv_cache_tokens=lr.fact_int("kv_cache_tokens"),
                        max_running_requests=lr.fact_int("max_running_requests"))
        if smoked is None:
            summary.server_failed(row, "smoke failed", err)
            continue
        row.state = "adopted" if lr.adopted else (lr.launch.replaced or "up")
        row.smoke_latency_s = round(smoked.latency_s, 3) if smoked.latency_s is not None else None
        row.proof = smoked.proof
        row.max_running_requests = smoked.max_running_requests or row.max_running_requests
        summary.rows.append(row)


def _flag_small_kv_caches(cfg: FleetConfig, rows: list[ServerRow]) -> None:
    """A server whose KV cache is markedly below its peers' (another process holds GPU memory): flag it."""
    flags = compare_kv({r.label: r.kv_cache_tokens for r in rows if r.up}, cfg.smoke.kv_cache_min_ratio)
    for r in rows:
        flag = flags.get(r.label)
        if flag:
            r.flag = flag
            get_run_logger().warning("%s server %s: %s", r.node, r.server, flag)


def _not_reached(cfg: FleetConfig, node: str, stages: tuple[str, ...], why: str) -> None:
    """NOT RUN versions of the keys a failed node did not reach, so no older OK reads as current."""
    for stage_name in stages:
        write_not_run(cfg, (node, stage_name), f"{stage_name} {node}", why)
    for i in range(cfg.servers.count or 0):  # without a count the node's servers are unknown until preflight
        for what in ("launch", "smoke"):
            write_not_run(cfg, (node, "server", i, what), f"{what} {node} server {i}", why)


def teardown_action(cfg: FleetConfig, free_ramdisk: bool) -> Any:
    """Stop every server (whole process groups), optionally free the RAM-disk copy; a summary table."""
    from tasks.ramdisk import free_ramdisk as free_task
    from tasks.teardown import teardown

    rows = teardown(cfg)
    if free_ramdisk:
        for name, f in [(n.name, free_task.submit(cfg, n.name)) for n in cfg.nodes]:
            freed, err = outcome(f)
            rows.append(freed if freed is not None else TeardownRow(name, "ramdisk", f"error: {err}"))
    failures = [f"{r.node} {r.what}: {r.action}" for r in rows if r.failed]
    stopped = sum(1 for r in rows if r.is_server and r.stopped)
    runners = [r for r in rows if r.what.startswith("runner") and r.stopped]
    freed_bytes = sum(r.bytes or 0 for r in rows if r.action == "freed")
    summary = (f"teardown of {cfg.name}: stopped {stopped} server(s)"
               + (f" and {len(runners)} generation runner(s) first ({', '.join(r.what for r in runners)}; "
                  "the same `fleet generate` resumes)" if runners else "")
               + (f", freed {freed_bytes / 1e9:.2f} GB of RAM disk" if freed_bytes else "")
               + (f"; {len(failures)} error(s)" if failures else ""))
    table = [r.as_dict() for r in rows]
    write_table(cfg, ("teardown",), table, summary)
    # The summary is "the fleet's state after the latest run": after a teardown, nothing is up.
    write_table(cfg, ("summary",), [ServerRow(r.node, r.index if r.index is not None else "-", port=r.port, pid=r.pid,
                                              state="teardown failed" if r.failed else "stopped by teardown",
                                              error=r.action if r.failed else None).as_dict()
                                    for r in rows if r.is_server],
                f"{cfg.name}: torn down, {stopped} server(s) stopped")
    if failures:
        return failed(summary + ": " + " | ".join(failures), table)
    return Completed(message=summary, data=table)


# What an operator does about an unhealthy server: the bring-up adopts the healthy ones and
# relaunches the rest (a revalidation only looks; it never relaunches).
REVALIDATE_REMEDY = ("run the bring-up to relaunch them (`fleet up -c FILE`, or the fleet's bringup deployment); "
                     "each server's log excerpt is in `fleet report --run revalidate-{name}`")


def revalidate_action(cfg: FleetConfig) -> Any:
    """Health, smoke and log verdict of every recorded server; Failed naming every unhealthy one."""
    from tasks.revalidate import revalidate

    t0 = time.monotonic()
    found = revalidate(cfg)
    if found.all_torn_down:
        return Completed(message=" | ".join(sorted(set(found.torn_down))), data=found.rows)
    if found.failures:
        return failed(f"{len(found.failures)} server(s) unhealthy, {found.healthy} healthy: "
                      + " | ".join(found.failures) + f" — remedy: {REVALIDATE_REMEDY.format(name=cfg.name)}",
                      found.rows)
    return Completed(message=f"{found.healthy} server(s) healthy in {time.monotonic() - t0:.1f} s", data=found.rows)


def _write_summary(cfg: FleetConfig, rows: list[ServerRow], failures: list[str], t0: float) -> int:
    up = sum(1 for r in rows if r.up)
    write_table(cfg, ("summary",), [r.as_dict() for r in rows],
                f"{cfg.name}: {up} server(s) up, {len(failures)} failure(s), {time.monotonic() - t0:.1f} s")
    return up


def generate_action(cfg: FleetConfig, rows: list[ServerRow], failures: list[str], specs: list[ServerSpec],
                    input: str, output: str, retry_errors: bool, held_since: float | None = None,
                    early: Any = None) -> Any:
    """Push the job through the servers that came up and the config's [[endpoints]]: one runner,
    on the node that has the servers (endpoints only: the config's node)."""
    from tasks.generate import generate

    logger = get_run_logger()
    by_node: dict[str, list[ServerSpec]] = {}
    for spec in specs:
        by_node.setdefault(spec.node, []).append(spec)
    if not by_node and cfg.endpoints:
        by_node[cfg.nodes[0].name] = []   # the endpoints alone (the config allows one node with them)
    if not by_node:
        return failed("no server came up; nothing to generate with: " + " | ".join(failures),
                      [r.as_dict() for r in rows])
    if len(cfg.nodes) > 1 or is_url(output):   # one job over every node (or the store): flows/multinode.py
        from flows.multinode import generate_multi

        if failures:
            logger.warning("generating with the servers that are up; not up: %s", " | ".join(failures))
        try:
            return generate_multi(cfg, [r.as_dict() for r in rows], specs, input, output, retry_errors, failures,
                                  held_since=held_since, early=early)
        except JobConflict as exc:   # another controller runs this job: it could not run (exit 2)
            return failed(f"generation: {exc.one_line()}", {"conflict": True})
    node_name = max(by_node, key=lambda n: len(by_node[n]))
    if len(by_node) > 1:
        # The runner runs next to its servers; one job spans one node (see the README).
        logger.warning("generation uses the %d server(s) of node %s; other nodes' servers stay idle",
                       len(by_node[node_name]), node_name)
    if failures:
        logger.warning("generating with %d server(s); not up: %s", len(by_node[node_name]), " | ".join(failures))
    facts = {r.server: {"max_running_requests": r.max_running_requests}
             for r in rows if r.node == node_name and r.up and isinstance(r.server, int)}
    fut = generate.submit(cfg, node_name, by_node[node_name], facts, input, output, retry_errors)
    fut.wait()  # bounded: a task's own waits all have timeouts (tests/test_waits.py)
    if not fut.state.is_completed():
        try:
            # bounded: the future is done (waited for above)
            fut.result(raise_on_failure=True)
            err = f"task ended {fut.state.name}"
        except JobConflict as exc:   # a second job into a job's directory: it could not run (exit 2)
            return failed(f"generation: {exc.one_line()}", {"conflict": True})
        except InputChanged as exc:   # the input rewritten under the job: stopped, never mixed (exit 2)
            return failed(f"generation: {exc.one_line()}", {"could_not_run": True})
        except FleetError as exc:   # cause and remedy on one line: the CLI prints this message
            err = exc.one_line()
        except Exception as exc:
            err = str(exc).splitlines()[0][:500]
        return failed(f"generation: {err}")
    # bounded: the future is done (waited for above)
    res = fut.result()
    return Completed(message=res.message(), data=res.as_dict())


@lazy_schema_flow(name="fleet", task_runner=ThreadPoolTaskRunner(max_workers=32), log_prints=True,
                  flow_run_name=run_name, on_failure=[announce_failure], on_completion=[clear_cause])
def fleet(config: FleetConfig | str = FleetConfig(), action: Action = "bringup", free_ramdisk: bool = False,
          node_wait_s: float = 3600.0, input: str | None = None, output: str | None = None,
          retry_errors: bool = False) -> Any:
    """Bring up, re-validate or tear down every server of a fleet config. Ends Failed when any server is not up.

    Args:
        config: The fleet config: the form below, a TOML path on the worker (relative to the
            repo root), `block:secret/NAME` (a Secret block) or `variable:NAME` (a Prefect
            Variable) holding it as a JSON object or TOML text.
        action: bringup (provision → venv → stage → launch → smoke), revalidate (health, smoke and
            log verdict of the running servers, no relaunch), teardown (stop every server) or
            generate (the batch job).
        free_ramdisk: teardown only: also remove the model's RAM-disk copy (never one another
            process still uses).
        node_wait_s: How long to wait for a node another run holds (its per-node concurrency
            limit) before ending Failed.
        input: generate only: the prompts (JSONL or Parquet; a local file is uploaded to an SSH node).
        output: generate only: the output directory on the node (Parquet shards, errors, manifest).
        retry_errors: generate only: send the rows of the errors file again.
    """
    quiet_expected_failures()
    clear_stop()
    try:
        result = _run(resolve_config(config), action, free_ramdisk, node_wait_s, input, output, retry_errors)
        if cancel_seen():   # a command's run cancelled from Prefect: its waits gave up (flows/cancel.py)
            return Cancelled(message=CANCELLED_MESSAGE)
        return result
    except BaseException as exc:
        if not isinstance(exc, Exception):
            # Prefect's Cancel (TerminationSignal from its SIGTERM handler), Ctrl-C: the engine
            # joins the task threads before it can set the run Cancelled. Tell their waits to
            # give up now, not at their timeouts (fleet/interrupt.py).
            request_stop()
            if not installed():
                # Under a worker (a command's Ctrl-C/SIGTERM ends in fleet/interrupt.py): the node
                # lock is back (hold_nodes unwound); a Cancel ends Cancelled now, not after
                # Prefect's runner loads the flow again in a new process (flows/cancel.py).
                end_cancelled()
        raise


def _run(cfg: FleetConfig, action: Action, free_ramdisk: bool, node_wait_s: float, input: str | None,
         output: str | None, retry_errors: bool) -> Any:
    t0 = time.monotonic()
    if action == "generate":
        if not (input and output):
            return failed("action 'generate' needs the parameters input and output")
        return for_deployment(_generate(cfg, input, output, retry_errors, node_wait_s, t0))
    if action == "bringup" and not cfg.launches_servers:   # no venv, no staging, no server for nothing
        return Completed(message="servers.count = 0: this config launches no server (it generates through its "
                                 f"{len(cfg.endpoints)} endpoint(s)); nothing to bring up", data=[])
    try:
        # Every action that launches, probes or stops servers holds its nodes; a long-running
        # action (generation) must not: it would block bring-ups and revalidations for days.
        with hold_nodes(cfg, wait_s=node_wait_s, purpose=action):
            if action == "teardown":
                return teardown_action(cfg, free_ramdisk)
            if action == "revalidate":
                return revalidate_action(cfg)
            rows, failures, _ = bringup(cfg)
    finally:
        close_all()
    up = _write_summary(cfg, rows, failures, t0)
    table = [r.as_dict() for r in rows]
    if failures:
        return failed(f"{up} server(s) up; {len(failures)} failed: " + " | ".join(failures), table)
    replaced = [f"{r.node} server {r.server} {r.state}" for r in rows
                if (r.state or "").startswith(("replaced", "retired"))]
    return Completed(message=f"{up} server(s) up in {time.monotonic() - t0:.1f} s"
                             + (f"; {', '.join(replaced)}" if replaced else ""), data=table)


def _generate(cfg: FleetConfig, input: str, output: str, retry_errors: bool, node_wait_s: float, t0: float) -> Any:
    """Check the job before any server starts, bring up (holding the nodes), then run the job (not holding them)."""
    with ExitStack() as stack:
        return _generate_in(stack, cfg, input, output, retry_errors, node_wait_s, t0)


def _generate_in(stack: ExitStack, cfg: FleetConfig, input: str, output: str, retry_errors: bool,
                 node_wait_s: float, t0: float) -> Any:
    from fleet.generation.job.endpoints import endpoint_keys
    from fleet.generation.job.validate import plan_job
    from tasks.nodes import node_for

    try:
        try:
            if is_url(input) or is_url(output):   # a worker's run never passes through flows/cli.py, which loads them
                from blocks.credentials import load_store_credentials

                load_store_credentials()
            plan = plan_job(cfg, input=input, output=output, retry_errors=retry_errors,
                            connect=lambda n: node_for(cfg, n.name))
        except FleetError as exc:
            return failed(f"generate: {exc.one_line()}")
        if plan.verdict == "done":
            return Completed(message=plan.message, data={"output": plan.output, "state": "done", **(plan.done or {})})
        try:
            endpoint_keys(cfg)   # a missing endpoint key fails now, before any server starts
        except FleetError as exc:
            return failed(f"generate: {exc.one_line()}")
        rows: list[ServerRow] = []
        failures: list[str] = []
        specs: list[ServerSpec] = []
        held_since = time.time()   # the nodes are the job's from their bring-up on: its cost counts from here
        early = None
        if cfg.launches_servers:   # servers.count = 0: the [[endpoints]] only, nothing to bring up
            if is_url(plan.output):   # each node's store check runs beside its bring-up, not after it
                from flows.multinode import EarlyChecks

                early = stack.enter_context(EarlyChecks(cfg, plan.input, plan.output))
            # Bring-up (idempotent: adopts what runs) holds the nodes; the job itself must not: it
            # would block bring-ups and revalidations for days.
            with hold_nodes(cfg, wait_s=node_wait_s, purpose="generate-bringup"):
                rows, failures, specs = bringup(cfg)
            _write_summary(cfg, rows, failures, t0)
        result = generate_action(cfg, rows, failures, specs, plan.input, plan.output, retry_errors, held_since,
                                 early)
        if interrupted():
            # The job phase holds no node lock (whose release parks the bring-up): a job that ended
            # after a Ctrl-C stops here too, so its run is not set Completed over the Crashed the
            # cleanups set. The shutdown ends the process (130, the paragraph).
            park()
        return result
    finally:
        close_all()
