"""`fleet …`, the console script: the core command line (`fleet.cli`) plus the commands that run
a Prefect flow or read its records (demo, up, deploy, generate, report).

They live here, outside the core, because the core imports nothing from Prefect or the flows
(tests/test_layers.py). This is also where the process gets its credential store: node blocks
and key secrets named by a config are read from Prefect (blocks/credentials.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from blocks.credentials import STORE_BLOCK_ENVS, PrefectCredentials, load_store_credentials
from fleet import cli
from fleet.cli import EXIT_ERROR, EXIT_FAILED, print_rows
from fleet.node.credentials import install

if TYPE_CHECKING:
    from fleet.config import FleetConfig


def _prefect_env() -> None:
    from flows.api import prefect_env

    prefect_env()


def run_bringup(cfg: FleetConfig) -> tuple[bool, list[dict[str, Any]], str]:
    """Run the `fleet` flow in-process (embedded Prefect unless PREFECT_API_URL is set)."""
    from flows.api import ensure_api, run_flow

    ensure_api()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from flows.fleet import SUMMARY_COLUMNS, fleet
    from flows.outcome import run_data

    # No flow-run heartbeat thread for a bring-up in the terminal: Prefect's sync engine joins it
    # at the end of the run, and it notices only once a second (it sleeps in 1 s steps), so every
    # `fleet up` waited 0-1 s after its work was done (0.5 s on average of a 2.5 s command). The
    # node lock keeps its own heartbeat (tasks/locks.py); a worker's runs and `fleet generate` keep
    # Prefect's.
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        state = run_flow(fleet, config=cfg, action="bringup")
    from flows.quickup import save_task_keys

    try:
        save_task_keys()   # what the next adopt-only `fleet up` records its task runs under (flows/quickup.py)
    except OSError:
        pass   # not written: the next `fleet up` takes the flow's path again, nothing worse
    # a Cancel from Prefect ends the run Cancelled (flows/cancel.py): no rows, its message said
    data = None if state.is_cancelled() else run_data(state)  # a bug, not a failed server, raises here
    rows = data if isinstance(data, list) else []
    print_rows(rows, SUMMARY_COLUMNS)
    return state.is_completed(), rows, state.message or ""
def cmd_up(args: argparse.Namespace) -> int:
    from fleet.config import load_config
    from flows.quickup import quick_up

    cfg = load_config(args.config)
    # A fleet already up (every stage adopts) is recorded without Prefect's engine: the same records
    # at a fraction of the cost; anything else, or any doubt, runs the flow (flows/quickup.py).
    quick = quick_up(cfg)
    from fleet.stages import SUMMARY_COLUMNS

    if quick is not None:
        ok, rows, message = quick
        print_rows(rows, SUMMARY_COLUMNS)
    else:
        ok, _, message = run_bringup(cfg)
    print(("fleet up: " if ok else "fleet up: FAILED: ") + message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else EXIT_FAILED


def cmd_deploy(args: argparse.Namespace) -> int:
    """Save the config as the fleet-config block and register its four deployments (flows/deploy.py)."""
    from pathlib import Path

    from fleet.config import load_config

    cfg = load_config(args.config)
    _prefect_env()
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("fleet deploy: PREFECT_API_URL is not set: deployments need a Prefect server that stays up\n"
              "  remedy: start one (`prefect server start`) and export PREFECT_API_URL=http://127.0.0.1:4200/api",
              file=sys.stderr)
        return EXIT_ERROR
    from flows.deploy import deploy

    res = deploy(cfg, source=str(Path(args.config).resolve()), pool=args.pool,
                 revalidate_every_s=args.revalidate_every or None, revalidate_now=args.revalidate_now)
    print(f"fleet {cfg.name}: config saved as block {res.block}"
          + (f"; work pool {res.pool} created" if res.pool_created else ""))
    for name in res.deployments:
        print(f"  {name}")
    print(revalidation_line(res, cfg.name))
    print(f"each run: {res.checkout}/flows/fleet.py, in that directory (the checkout fleet is installed from)\n"
          f"start a worker: prefect worker start --pool {res.pool}   (in this venv, from any directory)\n"
          f"bring it up:    prefect deployment run fleet/bringup-{cfg.name} --watch")
    return 0


def revalidation_line(res: Any, name: str) -> str:
    """What `fleet deploy` set up for revalidation: the schedule, when its first run is, a run started now."""
    from datetime import datetime

    dep = f"fleet/revalidate-{name}"
    if not res.revalidate_every_s:
        sched = f"revalidation: no schedule ({dep} runs when started: prefect deployment run {dep})"
    elif res.first_scheduled is None:
        sched = f"revalidation: {dep} every {res.revalidate_every_s:g} s"
    else:
        first = res.first_scheduled
        mins = (first - datetime.now(first.tzinfo)).total_seconds() / 60
        sched = (f"revalidation: {dep} every {res.revalidate_every_s:g} s; the schedule's first run at "
                 f"{first.strftime('%Y-%m-%d %H:%M:%S %Z')} (in {max(0.0, mins):.0f} min)")
    if res.revalidate_run:
        return sched + f"; and one now: flow run {res.revalidate_run}, for a worker on {res.pool}"
    return sched + "; --revalidate-now starts one at once"


def cmd_generate(args: argparse.Namespace) -> int:
    import os

    from fleet.config import load_config
    from fleet.generation.job.validate import plan_job
    from flows.api import ensure_api, run_flow

    cfg = load_config(args.config)
    if args.limit is not None:
        cfg.generation.limit = args.limit
    if any(os.environ.get(k) for k in STORE_BLOCK_ENVS):   # the store's credentials from Prefect blocks: to check the input
        ensure_api()
        load_store_credentials()
    # Before anything starts: the input, the output location, the job already there (exit 2).
    plan = plan_job(cfg, input=args.input, output=args.output, retry_errors=args.retry_errors, cwd=os.getcwd())
    if plan.verdict == "done":
        print(f"fleet generate: {plan.message}")
        return 0
    print(f"fleet generate: {plan.message}", flush=True)
    from flows.quickgen import quick_generate

    # A re-attach to this job's live runner (one node, local output) is recorded without Prefect's
    # engine: the same records; anything else, or any doubt, runs the flow (flows/quickgen.py).
    quick = quick_generate(cfg, plan.input, plan.output, args.retry_errors)
    if quick is not None:
        ok, message, data = quick
    else:
        ensure_api()
        from flows.fleet import fleet
        from flows.outcome import run_data
        from flows.quickup import save_task_keys

        state = run_flow(fleet, config=cfg, action="generate", input=plan.input, output=plan.output,
                         retry_errors=args.retry_errors)
        try:
            save_task_keys()   # what the next re-attach records its task runs under (flows/quickgen.py)
        except OSError:
            pass
        # a Cancel from Prefect ends the run Cancelled (flows/cancel.py): no data, its message said
        data = None if state.is_cancelled() else run_data(state)  # a bug raises here, with its traceback
        ok, message = state.is_completed(), state.message or ""
    if isinstance(data, dict) and (data.get("conflict") or data.get("could_not_run")):
        # another job took the directory between the check above and the start, or the job's input changed
        # since it was planned, or the store refused it (README: exit 2)
        print(f"fleet generate: {message or 'a second job into a job directory'}", file=sys.stderr)
        return EXIT_ERROR
    if isinstance(data, dict):
        print(json.dumps({k: data.get(k) for k in ("output", "state", "rows_total", "completed", "errors", "rejects",
                                                    "quality_rejects", "throughput", "cost", "checks", "quality")}, indent=2, default=str))
    print(("fleet generate: " if ok else "fleet generate: FAILED: ") + message,
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else EXIT_FAILED


def cmd_report(args: argparse.Namespace) -> int:
    from flows.report import report

    rc: int = report(args.config, args.run, args.key, args.list, args.full)
    return rc


def run_demo(engine: str = "transformers", keep: bool = False, servers: int | None = None,
             keep_ramdisk: bool = False) -> int:
    from fleet.config import load_config
    from fleet.demo import demo_config, demo_dir, left_behind, to_toml
    from fleet.node import LocalNode
    from fleet.servers import stop_servers
    from fleet.stages import TeardownRow
    from fleet.staging import free_ramdisk

    state = demo_dir()
    state.mkdir(parents=True, exist_ok=True)
    cfg_path = state / f"demo-{engine}.toml"
    cfg_path.write_text(to_toml(demo_config(engine, servers, state)))
    cfg: FleetConfig = load_config(cfg_path)
    print(f"fleet demo: {cfg.servers.count} {engine} server(s) on this machine; config: {cfg_path}\n", flush=True)
    freed: dict[str, Any] | None = None
    try:
        ok, rows, message = run_bringup(cfg)
    finally:
        if not keep:
            node, node_cfg = LocalNode(), cfg.nodes[0]
            stopped = [TeardownRow.of_server(r) for r in stop_servers(node, cfg, node_cfg)]
            print(f"\nfleet demo: stopped {sum(1 for r in stopped if r.action != 'none')} server(s) "
                  "(--keep leaves them running)")
            if not keep_ramdisk:  # the copies are the demo's alone, and RAM: nobody else frees them
                freed = free_ramdisk(node, source=cfg.model.source, stage=cfg.model.stage,
                                     ramdisk=node_cfg.ramdisk, fleet=cfg.name)
    print(f"\nfleet demo: {'OK' if ok else 'FAILED'}: {message}")
    print("See what the run recorded (summary table, per-stage results, log excerpts):\n"
          f"  .venv/bin/fleet report -c {cfg_path} [--full | KEY]\n"
          f"  .venv/bin/prefect artifact ls; .venv/bin/prefect artifact inspect {cfg.name}-summary\n"
          "or the UI: .venv/bin/prefect server start, then open http://127.0.0.1:4200/runs")
    if keep:
        print(f"Servers left running: .venv/bin/fleet status -c {cfg_path}; stop: .venv/bin/fleet down -c {cfg_path}")
    print(left_behind(cfg, cfg_path, freed, keep=keep))
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(engine=args.engine, keep=args.keep, servers=args.servers, keep_ramdisk=args.keep_ramdisk)


COMMANDS: dict[str, cli.Command] = {"demo": cmd_demo, "up": cmd_up, "deploy": cmd_deploy,
                                    "generate": cmd_generate, "report": cmd_report}
assert set(COMMANDS) == set(cli.FLOW_COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    install(PrefectCredentials())
    rc = cli.main(argv, commands=COMMANDS)
    if argv is None:
        # The real command (argv from sys.argv) ends here: Prefect drains its log and event
        # workers at exit, then the interpreter tears down every module. The garbage collector's
        # passes over the heap Prefect and pydantic built took most of that (0.1-0.3 s idle, 3-4 s
        # at load 20); frozen objects are not scanned. Exit handlers and finalizers still run.
        import gc

        gc.freeze()
    return rc


if __name__ == "__main__":
    sys.exit(main())
