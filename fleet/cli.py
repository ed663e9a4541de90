"""`fleet …` — the command line. Each command is a thin layer over the core (or the flow).

Errors fleet raises on purpose print as one clear line (config errors: one line per
problem) and exit 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fleet.errors import FleetError

if TYPE_CHECKING:
    from fleet.config import FleetConfig

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]  # what add_subparsers returns

EXIT_FAILED = 1     # the command ran and found a problem (a failed check, a failed server)
EXIT_ERROR = 2      # the command could not run (bad config, unreachable, bad input)


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, metavar="FILE",
                   help="fleet config (TOML); FLEET_<SECTION>__<KEY> env vars override it. "
                        "Examples: deployments/configs/")


def cmd_preflight(args: argparse.Namespace) -> int:
    from fleet.config import load_config
    from fleet.node import connect
    from fleet.preflight import gather, render

    cfg = load_config(args.config)
    reports = []
    for node_cfg in cfg.nodes:
        node = connect(node_cfg)
        try:
            reports.append(gather(node, cfg, node_cfg))
        finally:
            node.close()
    if args.json:
        print(json.dumps({"config": args.config, "ok": all(r.ok for r in reports),
                          "nodes": [r.as_dict() for r in reports]}, indent=2))
    else:
        print(render(reports))
    bad = [r for r in reports if not r.ok]
    for r in bad:
        why = r.error if not r.reachable else "; ".join(f"{c.name}: {c.detail}" for c in r.failures())
        print(f"fleet preflight: node {r.node} {'unreachable' if not r.reachable else 'failed'}: {why}",
              file=sys.stderr)
    if any(not r.reachable for r in bad):
        return EXIT_ERROR
    return EXIT_FAILED if bad else 0


def print_rows(rows: Sequence[Mapping[str, Any]], columns: list[str]) -> None:
    """A table of `columns` (rich, at its natural width: never wrapped at 80 columns on a pipe).
    On a terminal a long cell (a log path, an error) ends in "…" to keep rows on the screen; on a
    pipe or in a file every cell is whole, for grep and for the record."""
    from fleet.tables import MAX_CELL, table

    def cell(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}"
        if isinstance(v, list):
            return ",".join(str(x) for x in v) or "-"
        return str(v)

    print(table(columns, [[cell(r.get(c)) for c in columns] for r in rows],
                max_cell=MAX_CELL if sys.stdout.isatty() else None))


def cmd_status(args: argparse.Namespace) -> int:
    from fleet.config import load_config
    from fleet.node import connect
    from fleet.servers import states

    cfg = load_config(args.config)
    if args.check:
        return _status_check(cfg, args.json)
    rows = []
    for node_cfg in cfg.nodes:
        with connect(node_cfg) as node:
            rows += [s.as_dict() for s in states(node, cfg, node_cfg)]
    for r in rows:
        r["server"] = r.pop("index")   # the name `fleet up`'s summary uses
        smoke = r.get("last_smoke") or {}
        r["last_smoke_ago_s"] = round(__import__("time").time() - smoke["at"], 1) if smoke.get("at") else None
        r["up_s"] = round(r["up_s"], 1) if r.get("up_s") is not None else None
    if args.json:
        print(json.dumps({"fleet": cfg.name, "servers": rows}, indent=2))
    elif rows:
        print_rows(rows, ["node", "server", "state", "pid", "port", "gpus", "up_s", "last_smoke_ago_s", "log"])
    else:
        print(f"no servers of fleet {cfg.name!r} recorded on any node")
    return 0 if all(r["state"] == "running" for r in rows) else EXIT_FAILED


def _status_check(cfg: FleetConfig, as_json: bool) -> int:
    """`fleet status --check`: the revalidate action's checks, run here (no Prefect, no artifacts)."""
    from fleet.node import connect
    from fleet.revalidate import REVALIDATE_COLUMNS, check_node

    checks = []
    for node_cfg in cfg.nodes:
        with connect(node_cfg) as node:
            checks += check_node(node, cfg, node_cfg)
    if as_json:
        print(json.dumps({"fleet": cfg.name, "servers": [c.as_dict() for c in checks]}, indent=2))
    elif checks:
        print_rows([c.row() for c in checks], REVALIDATE_COLUMNS)
    else:
        print(f"no servers of fleet {cfg.name!r} recorded on any node")
    for c in checks:
        if not c.healthy:
            print(f"fleet status: {c.label()}: {'; '.join(c.problems)}", file=sys.stderr)
    return 0 if checks and all(c.healthy for c in checks) else EXIT_FAILED


def cmd_down(args: argparse.Namespace) -> int:
    from fleet import torndown
    from fleet.config import load_config
    from fleet.node import connect
    from fleet.stages import TeardownRow
    from fleet.staging import free_ramdisk

    cfg = load_config(args.config)
    rows: list[TeardownRow] = []
    freed = []
    for node_cfg in cfg.nodes:
        with connect(node_cfg) as node:
            # runners first, then servers; the marker makes revalidation say "nothing is up (torn down …)"
            rows += torndown.tear_down(node, cfg, node_cfg, by="fleet down")
            if args.free_ramdisk:
                freed.append({"node": node_cfg.name, **free_ramdisk(node, source=cfg.model.source, stage=cfg.model.stage,
                                                                    ramdisk=node_cfg.ramdisk, fleet=cfg.name)})
    if rows:
        print_rows([{"server": r.index if r.is_server else r.what, **r.as_dict()} for r in rows],
                   ["node", "server", "port", "pid", "action", "seconds"])
    else:
        print(f"no servers of fleet {cfg.name!r} recorded on any node")
    if freed:
        print_rows(freed, ["node", "path", "action", "bytes"])
    return EXIT_FAILED if any(r.failed for r in rows) else 0


def cmd_inspect_log(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleet.engines import inspect_log

    try:
        text = Path(args.file).read_bytes().decode("utf-8", "replace")
    except OSError as exc:
        print(f"fleet inspect-log: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    verdict = inspect_log(text, args.engine)
    if args.json:
        print(json.dumps(verdict.as_dict(), indent=2))
    else:
        state = "FATAL" if verdict.fatal else ("ready" if verdict.ready else "not ready (no ready line yet)")
        print(f"verdict: {state}")
        for k, v in verdict.facts.items():
            print(f"  {k:<28} {v}")
        for line in verdict.fatal:
            print(f"  fatal: {line}")
        for line in verdict.warnings:
            print(f"  warning: {line}")
    return EXIT_FAILED if verdict.fatal else 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fleet.tinymodel import build_tiny_model

    out = build_tiny_model(Path(args.out))
    print(out)
    return 0


# fleet.generation.data.export.FORMATS, spelled out: importing it (pyarrow) would slow every --help
EXPORT_FORMATS = ["openai-batch", "jsonl", "sharegpt", "specforge", "speculators", "speculators-tokens"]


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def cmd_fetch(args: argparse.Namespace) -> int:
    from fleet.config import load_config
    from fleet.errors import ConfigError
    from fleet.generation.job.remote import check_fetch_path, fetch, job_outputs
    from fleet.node import connect

    cfg = load_config(args.config)
    if len(cfg.nodes) > 1:   # one job over every node: gather every chunk, merge into one directory
        from fleet.generation.multinode.controller import fetch_job, find_plan_dir

        plan_dir = find_plan_dir(cfg, args.remote)
        if plan_dir is not None:
            m = fetch_job(cfg, plan_dir, args.output)
            c = m["counts"]
            nodes = ", ".join(f"{n['node']} {n['rows']} rows" for n in m.get("nodes") or [])
            print(f"{c['completed']} completed, {c['errors']} error(s), {c['rejects']} reject(s) from "
                  f"{m['input']['chunks']} chunk(s) [{nodes}] → {args.output} ({m['state']})")
            return 0
    total = 0
    refused: ConfigError | None = None
    for node_cfg in cfg.nodes:
        with connect(node_cfg) as node:
            outputs = job_outputs(node, cfg, node_cfg)
            if args.remote is not None:
                try:
                    remote = check_fetch_path(args.remote, outputs, node_cfg.name)
                except ConfigError as exc:   # not this node's job: another node may hold it
                    refused = exc
                    continue
            elif outputs:
                remote = outputs[0]
            else:
                continue
            dest = args.output if len(cfg.nodes) == 1 else f"{args.output.rstrip('/')}/{node_cfg.name}"
            files = fetch(node, remote, dest)
        total += len(files)
        print(f"{node_cfg.name}: {len(files)} file(s) from {remote} → {dest}")
    if not total and refused is not None:
        raise refused
    if not total:
        print("fleet fetch: no generation output found (give --remote DIR)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fleet.generation.data.plan import format_plan, plan

    try:
        d = plan(completions=args.completions, avg_output_tokens=args.avg_output_tokens,
                 tokens_per_s=args.tokens_per_s, price_per_gpu_hour=args.price_per_gpu_hour, gpus=args.gpus,
                 tokens_per_s_is_per_gpu=not args.fleet_rate)
    except ValueError as exc:
        print(f"fleet plan: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(d, indent=2) if args.json else format_plan(d))
    return 0


# Formats whose name is already a file suffix are not suffixed twice (`export.jsonl`, never
# `export.jsonl.jsonl`); the others are JSONL files named for their format.
_SUFFIX_FORMATS = ("jsonl", "json", "parquet", "csv")


def export_dest(out_dir: str, fmt: str) -> str:
    """Default destination of `fleet export DIR --format FMT`."""
    name = f"export.{fmt}" if fmt in _SUFFIX_FORMATS else f"export.{fmt}.jsonl"
    if "://" in out_dir:   # a URL: its scheme's // stays
        return f"{out_dir.rstrip('/')}/{name}"
    return f"{out_dir.rstrip('/') or '/'}/{name}".replace("//", "/")


def cmd_export(args: argparse.Namespace) -> int:
    from fleet.generation.data.export import export
    from fleet.generation.data.objstore import is_url

    dest = args.dest or export_dest(args.dir, args.format)
    keep = args.keep_flagged
    try:
        flags: bool | frozenset[str] = True if keep == "all" else frozenset(keep.split(",")) if keep else False
        if is_url(args.dir) or is_url(dest):
            from fleet.generation.data.objstore import export_via_copy

            s = export_via_copy(args.dir, dest, lambda src, to: export(
                src, args.format, to, keep_flagged=flags, named=dest if is_url(dest) else None))
        else:
            s = export(args.dir, args.format, dest, keep_flagged=flags)
    except (ValueError, OSError, ImportError) as exc:   # OSError: a store's refusal too; ImportError: no s3fs
        print(f"fleet export: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {s.rows} rows to {dest}")
    if s.flagged_left_out:
        by_flag = ", ".join(f"{g}: {n}" for g, n in sorted(s.left_out_by_flag.items()))
        print(f"left out {s.flagged_left_out} flagged conversation(s) ({by_flag}) -> {s.files['flagged']} "
              "(--keep-flagged [FLAG,...] keeps them)")
    if s.flagged_kept:
        print(f"kept {s.flagged_kept} flagged conversation(s) (--keep-flagged)")
    for kind, n in (("skipped", s.skipped), ("error", s.errors)):
        if n:
            print(f"{n} {kind} row(s) -> {s.files[kind]}")
    return 0


# The commands that run a Prefect flow (or read its records). The core cannot import the flows:
# the entry point outside it (`flows/cli.py`, the `fleet` console script) supplies them.
FLOW_COMMANDS = ("demo", "up", "deploy", "generate", "report")
Command = Callable[[argparse.Namespace], int]


def _runs_a_flow(args: argparse.Namespace) -> int:
    raise FleetError(f"`fleet {args.command}` runs a Prefect flow and is not part of the core command line",
                     remedy="run it through the `fleet` command (or `python -m flows.cli`)")


def _demo_command(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="run the bring-up flow on this machine (embedded Prefect, tiny local model)",
                       description="Build a tiny random-weight model, bring up servers on this machine through the "
                                   "full `fleet` flow (provision, venv, RAM-disk staging, launch, smoke) under "
                                   "Prefect's embedded server, print the summary, then stop the servers.")
    p.add_argument("--engine", choices=["transformers", "sim"], default="transformers",
                   help="transformers: real `transformers serve` on CPU (2 servers); sim: simulated SGLang (4 servers)")
    p.add_argument("--servers", type=int, default=None, help="number of servers (default 2 for transformers, 4 for sim)")
    p.add_argument("--keep", action="store_true", help="leave the servers running (stop them with `fleet down`)")
    p.add_argument("--keep-ramdisk", action="store_true",
                   help="keep the model's RAM-disk copy after the servers stop (by default the demo frees it)")
    p.set_defaults(func=_runs_a_flow)


def _preflight_command(sub: Subparsers) -> None:
    p = sub.add_parser("preflight", help="inspect every node: GPUs, RAM, RAM disk, filesystems, ports",
                       description="Inspect every node of a fleet config and run the hard checks of the provision "
                                   "stage. Exit 0 when all pass, 1 when a node fails a hard check, 2 when a node is "
                                   "unreachable or the config is invalid.")
    _config_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON (schema in the README) instead of a table")
    p.set_defaults(func=cmd_preflight)


def _up_command(sub: Subparsers) -> None:
    p = sub.add_parser("up", help="run the bring-up flow for a config (same flow as the `bringup` deployment)",
                       description="Provision, venv, stage, launch and smoke every server of the config. "
                                   "Idempotent: what is already in place is adopted. Exit 1 when any server is not up.")
    _config_arg(p)
    p.set_defaults(func=_runs_a_flow)


def _deploy_command(sub: Subparsers) -> None:
    p = sub.add_parser("deploy", help="save the config in Prefect and register its bringup, revalidate, generate "
                                      "and teardown deployments",
                       description="Validate the config, save it as the Prefect block fleet-config/NAME (NAME: the "
                                   "fleet's name; secrets stored encrypted, shown masked in the UI) and register "
                                   "fleet/bringup-NAME, fleet/revalidate-NAME (scheduled), fleet/generate-NAME and "
                                   "fleet/teardown-NAME, each reading that block. Needs PREFECT_API_URL. Re-run it "
                                   "after editing the file.")
    _config_arg(p)
    p.add_argument("--pool", default="fleet-pool", help="process work pool (created if missing; default %(default)s)")
    p.add_argument("--revalidate-every", type=float, default=1800, metavar="SECONDS",
                   help="revalidate schedule interval; 0 for no schedule (default %(default)s). Its first run "
                        "comes one interval after the deploy (the command prints when)")
    p.add_argument("--revalidate-now", action="store_true",
                   help="also start a revalidation at once (a flow run for the pool's worker)")
    p.set_defaults(func=_runs_a_flow)


def _status_command(sub: Subparsers) -> None:
    p = sub.add_parser("status", help="show every server: state, pid, port, seconds up, last smoke",
                       description="Read every server's launch record on every node (no relaunch, no requests): "
                                   "state (running / dead / stopped), pid, port, GPUs, seconds up, when its last "
                                   "smoke passed, its log. Exit 1 when any recorded server is not running. "
                                   "--check re-validates each one instead (what the revalidate deployment does).")
    _config_arg(p)
    p.add_argument("--check", action="store_true",
                   help="re-validate every server: process alive, health endpoint, one chat completion, log "
                        "verdict (no relaunch); exit 1 when any is unhealthy or never launched")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)


def _down_command(sub: Subparsers) -> None:
    p = sub.add_parser("down", help="stop every server of the config (TERM, then KILL after servers.stop_grace_s)",
                       description="Stop every server this fleet recorded on every node: SIGTERM to its whole "
                                   "process group, SIGKILL after servers.stop_grace_s. Idempotent. The RAM-disk copy "
                                   "stays unless --free-ramdisk.")
    _config_arg(p)
    p.add_argument("--free-ramdisk", action="store_true",
                   help="also remove the model's RAM-disk copy on each node (only a copy fleet staged, and only "
                        "when no live process uses it)")
    p.set_defaults(func=cmd_down)


def _inspect_log_command(sub: Subparsers) -> None:
    p = sub.add_parser("inspect-log", help="classify a server log: facts, fatal lines, readiness verdict",
                       description="Run fleet's log classifier on a server log, for diagnosing a server by hand. "
                                   "Exit 1 when a fatal line is found.")
    p.add_argument("file", help="log file")
    p.add_argument("--engine", choices=["sglang", "vllm", "transformers", "sim"], default="sglang",
                   help="engine whose log lines to look for (default sglang; sim logs like sglang)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect_log)


def _sim_command(sub: Subparsers) -> None:
    # main() hands `fleet sim …` to the simulator before parsing: this entry is for `fleet --help`.
    sub.add_parser("sim", help="run the simulated SGLang server (`fleet sim --help` lists its flags and faults)",
                   add_help=False, description="The SGLang-compatible simulated server. All arguments go to it.")


def _generate_command(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="bring the fleet up if needed, then run a batch job through every server",
                       description="The `generate` action of the `fleet` flow: bring-up (adopting what runs), then a "
                                   "detached runner on the node pushes every input row through the servers (one queue, "
                                   "retries, relaunch of dead servers). Re-running resumes: completed ids are skipped; "
                                   "a runner still going for the same output is re-attached to, never doubled.")
    _config_arg(p)
    p.add_argument("--input", required=True, help="JSONL or Parquet prompts (OpenAI batch, {id, messages} or ShareGPT rows)")
    p.add_argument("--output", required=True, help="output directory ON THE NODE (shards/, errors.jsonl, rejects.jsonl, "
                                                   "manifest.json, progress.json)")
    p.add_argument("--retry-errors", action="store_true", help="send the rows of errors.jsonl again")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="read only the first N input rows (try a job on a few rows; a later run with a larger N "
                        "or none goes on from there)")
    p.set_defaults(func=_runs_a_flow)


def _fetch_command(sub: Subparsers) -> None:
    p = sub.add_parser("fetch", help="copy a generation output directory back from the node(s)",
                       description="Copy a job's output (shards, errors, rejects, manifest, progress) from the node "
                                   "to a local directory. A job over several nodes: gather every chunk from every node "
                                   "and write one merged directory (every id once) with one manifest. While the job "
                                   "runs, shards and the manifest come whole (written, then renamed); errors.jsonl and "
                                   "rejects.jsonl are appended to, so fetch again once the job ends.")
    _config_arg(p)
    p.add_argument("--output", required=True, help="local directory to copy into")
    p.add_argument("--remote", default=None, help="output directory on the node (default: the newest job's)")
    p.set_defaults(func=cmd_fetch)


def _plan_command(sub: Subparsers) -> None:
    p = sub.add_parser("plan", help="wall time and $ per M tokens of a generation job (the seed job's arithmetic)",
                       description="How long N completions take and what they cost. The rate is per GPU (what one "
                                   "server on one GPU generates) unless --fleet-rate.")
    p.add_argument("--completions", type=int, required=True, help="rows to generate, e.g. 902087")
    p.add_argument("--avg-output-tokens", type=float, required=True, help="mean completion tokens per row")
    p.add_argument("--tokens-per-s", type=float, required=True, help="decode rate per GPU (tok/s)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (servers × tp) working on the job")
    p.add_argument("--price-per-gpu-hour", type=float, default=None, help="$ per GPU-hour")
    p.add_argument("--fleet-rate", action="store_true", help="--tokens-per-s is the whole fleet's rate")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)


def _export_command(sub: Subparsers) -> None:
    p = sub.add_parser("export", help="write a generation output DIR as openai-batch, jsonl, sharegpt, specforge or speculators",
                       description="Stream the Parquet shards of a generation output directory into an interchange "
                                   "format (atomic write; a .gz destination is compressed).")
    p.add_argument("dir", help="the generation output directory (holds shards/)")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True,
                   help="specforge: SpecForge's regenerated-data JSONL; speculators: vLLM speculators' conversations; "
                        "speculators-tokens: its pre-tokenized rows, from the token ids the engine returned")
    p.add_argument("-o", "--dest", default=None, help="destination file (default DIR/export.jsonl for jsonl, DIR/export.FORMAT.jsonl "
                                                          "for the others)")
    p.add_argument("--keep-flagged", nargs="?", const="all", default=None, metavar="FLAG,...",
                   help="specforge/speculators: keep conversations with a quality flag (all flags, or only those "
                        "named, e.g. truncated); by default they go to DEST_flagged.jsonl")
    p.set_defaults(func=cmd_export)


def _report_command(sub: Subparsers) -> None:
    p = sub.add_parser("report", help="show what a run recorded: state, summary table, artifacts (fast, read-only)",
                       description="Render a fleet run's state, summary and artifacts in the terminal at full width. "
                                   "Reads the server at PREFECT_API_URL, or else the embedded server's database "
                                   "directly (read-only, no server started). `prefect artifact ls/inspect` show the "
                                   "same artifacts.")
    p.add_argument("-c", "--config", default=None, metavar="FILE", help="only runs of this fleet config")
    p.add_argument("--run", default="last", metavar="NAME|ID|last",
                   help="which run: a run name (e.g. bringup-local-sim: the newest of that name), an id, or last")
    p.add_argument("--list", action="store_true", help="list the recent runs instead")
    p.add_argument("--full", action="store_true", help="also print every markdown artifact (per-task details)")
    p.add_argument("key", nargs="?", default=None,
                   help="one artifact by key (e.g. local-sim-summary): of that run, or the newest with that key")
    p.set_defaults(func=_runs_a_flow)


def _tiny_model_command(sub: Subparsers) -> None:
    p = sub.add_parser("tiny-model", help="build the tiny random-weight chat model used by tests and the demo",
                       description="Build a tiny random-weight Qwen2-style chat model (byte-level BPE tokenizer "
                                   "trained locally, ChatML template) in a few seconds, with no download. "
                                   "Idempotent: an existing complete build is reused.")
    p.add_argument("out", help="output directory (created; must be empty or a previous build)")
    p.set_defaults(func=cmd_tiny_model)


# `fleet --help` lists the commands in this order.
COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _demo_command, _preflight_command, _up_command, _deploy_command, _status_command, _down_command,
    _inspect_log_command, _sim_command, _generate_command, _fetch_command, _plan_command, _export_command,
    _report_command, _tiny_model_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet",
        description="Bring up a fleet of LLM inference servers (one per GPU) on nodes reached over SSH, "
                    "prove each one works, and push batch-generation jobs through them — orchestrated by Prefect.",
        epilog="Start here: `fleet demo` (the whole bring-up on this machine). `fleet COMMAND --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None, commands: Mapping[str, Command] | None = None) -> int:
    """Run one command. `commands` supplies the FLOW_COMMANDS (from `flows/cli.py`)."""
    # Only the real command (argv from sys.argv) takes over Ctrl-C: a test calling main([...])
    # in its own process keeps its SIGINT (fleet/interrupt.py ends the process on Ctrl-C).
    take_sigint = argv is None
    if take_sigint:  # `fleet … | head -1`: the reader may go first (fleet/interrupt.py ClosedSafe)
        from fleet.interrupt import guard_closed_output

        guard_closed_output()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # every argument belongs to the simulator, --help included
        from fleet.sim.server import main as sim_main

        return sim_main(argv[1:], prog="fleet sim")
    parser = build_parser()
    args = parser.parse_args(argv)
    if commands and args.command in commands:
        args.func = commands[args.command]
    if take_sigint:
        from fleet.interrupt import install

        install(lambda: interrupt_paragraph(args))
    try:
        func: Command = args.func
        return func(args)
    except FleetError as exc:
        from fleet.errors import ConfigError

        if isinstance(exc, ConfigError):
            for line in str(exc.reason).splitlines():
                print(f"fleet: config error: {line}", file=sys.stderr)
            if exc.remedy:
                print(f"fleet: remedy: {exc.remedy}", file=sys.stderr)
        else:
            print(f"fleet: error: {exc.one_line()}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # SIGINT is handled by fleet.interrupt; this is a KeyboardInterrupt raised by hand
        print("fleet: interrupted", file=sys.stderr)
        return 130


def interrupt_paragraph(args: argparse.Namespace) -> str:
    """What Ctrl-C leaves behind, per command: what still runs, how to re-attach, how to stop."""
    cfg = getattr(args, "config", None)
    if args.command == "demo":
        from fleet.demo import demo_dir

        cfg = str(demo_dir() / f"demo-{args.engine}.toml")
    c = f" -c {cfg}" if cfg else ""
    if args.command in ("up", "demo"):
        return (f"Servers already launched keep running (they are detached from this command). "
                f"See them: `fleet status{c}`. Finish the bring-up (adopts what runs): `fleet up{c}`. "
                f"Stop them: `fleet down{c}`.")
    if args.command == "generate":
        jobs = "<workdir>/jobs"
        several = False
        try:
            from fleet.config import load_config

            loaded = load_config(cfg)
            jobs = f"{loaded.nodes[0].workdir.rstrip('/')}/jobs/{loaded.name}-*"
            several = len(loaded.nodes) > 1
        except Exception:
            pass  # the paragraph must not depend on the config being readable
        from fleet.generation.data.objstore import is_url

        out = str(args.output or "")
        if is_url(out) or several:   # a multi-node job: its controller's progress, not a runner's
            where = (f"{out.rstrip('/')}/_control/progress.json in the store" if is_url(out) else
                     "the job's progress.json in its plan directory on this machine (~/.local/state/fleet/jobs/)")
            return (f"The nodes' servers and runners keep running (detached): their chunks go on, with the job's "
                    f"last progress in {where}. Resume: the same `fleet generate` command again (it re-attaches "
                    f"to the running chunks, never doubles one). Servers: `fleet status{c}`; stop them and the "
                    f"runners: `fleet down{c}`.")
        return (f"Servers and the generation runner, if it had started, keep running (detached): the job goes on, "
                f"with progress in {args.output}/progress.json on the node. Re-attach: the same `fleet generate` "
                f"command again (it never starts a second runner). Servers: `fleet status{c}`; stop them: "
                f"`fleet down{c}`. Stop the job (it commits what is done): "
                f"`kill -TERM $(cut -d' ' -f1 {jobs}/runner.pid)` on the node.")
    if args.command == "down":
        return f"Servers not stopped yet keep running: `fleet status{c}` shows them; `fleet down{c}` again stops them."
    if args.command == "fetch":
        return f"Files copied so far are in {args.output}; run the same `fleet fetch` again to complete the copy."
    return "Nothing was left running."


if __name__ == "__main__":
    sys.exit(main())
