"""The generate action over several nodes: cut the input into chunks, let every node pull them.

Called by `flows.fleet.generate_action` when the config has more than one node. The chunk
plan, the assignments and everything gathered from the nodes live in the job's plan
directory on the machine that runs the flow (`plan_root()/<fleet>-<hash of --output>`); the
merged output (one directory, `fleet export` reads it) is `<plan dir>/output`, and
`fleet fetch` writes the same merge wherever it is asked to.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as cf_wait
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.states import Completed
from prefect.task_runners import ThreadPoolTaskRunner

from fleet.config import FleetConfig
from fleet.errors import ConfigError, FleetError, InputChanged, InputError, StoreError
from fleet.engines import ServerSpec
from fleet.stages import is_up
from fleet.generation.multinode.chunks import ControllerLock, plan_dir_for
from fleet.generation.multinode.controller import Controller, NodeWork, plan_root
from fleet.generation.data.objstore import is_url
from fleet.generation.multinode.nodecheck import whole_lines
from tasks.states import failed


def generate_multi(cfg: FleetConfig, rows: list[dict[str, Any]], specs: list[ServerSpec], input: str, output: str,
                   retry_errors: bool, failures: list[str] | None = None, held_since: float | None = None,
                   early: EarlyChecks | None = None) -> Any:
    from tasks.multinode import say

    logger = get_run_logger()
    from blocks.credentials import load_store_credentials

    load_store_credentials()   # a deployment's run: the store's credentials may come from a Secret block
    if retry_errors:
        return failed("--retry-errors is not supported for a job over several nodes yet: run the failed "
                      "rows as a new job (their ids are in the fetched errors.jsonl)")
    if is_url(input) and not is_url(output):
        return failed(f"--input {input} is on object storage: give --output a URL there too")
    if not is_url(input) and not Path(input).is_file():
        return failed(f"input {input} is not a file on this machine: a job over several nodes cuts the "
                      "input here and sends each node its chunks; give a local --input")
    by_node: dict[str, list[ServerSpec]] = {}
    for spec in specs:
        by_node.setdefault(spec.node, []).append(spec)
    if not by_node:
        return failed("no server came up on any node; nothing to generate with")
    nodes = {}
    for name, node_specs in by_node.items():
        facts = {r["server"]: {"max_running_requests": r.get("max_running_requests")}
                 for r in rows if r["node"] == name and is_up(r["state"])}
        nodes[name] = NodeWork(name, node_specs, facts)
    aside: dict[str, str] = {}
    gpus = {n: w.gpus for n, w in nodes.items()}   # every node taken for the job: its cost counts (cost.py)
    aside_at = time.time()
    if is_url(output):   # every node proves its store access first; one that cannot is left out
        aside = _check_nodes(cfg, sorted(nodes), input, output, early)
        aside_at = time.time()
        for name, cause in sorted(aside.items()):
            logger.warning("node %s set aside: %s", name, cause)
            del nodes[name]
        if not nodes:
            return failed("no node can do this job's store access: "
                          + " | ".join(f"{n}: {c}" for n, c in sorted(aside.items()))
                          + " — give every node the store's credentials (the controller's AWS_*, HF_*, GOOGLE_* "
                            "variables reach each runner by name; a profile or file must exist on the node too), "
                            "then run the same command again")
    failures = [*(failures or []), *(f"{n}: set aside: {c}" for n, c in sorted(aside.items()))]
    pdir = plan_dir_for(plan_root(), cfg.name, output)
    ctl = Controller(cfg, pdir, output, nodes, say=say)
    ctl.set_aside = dict(aside)
    ctl.held_since = held_since
    ctl.node_gpus = gpus
    ctl.aside_at = {n: aside_at for n in aside}
    t0 = time.monotonic()
    with ControllerLock(pdir):   # a gzip input on the store is staged in prepare: under the lock, one copy
        try:
            plan = ctl.prepare(input)
        except ConfigError as exc:   # the job is another input's, or staged elsewhere: said once, with its remedy
            return failed(f"generation: {exc.one_line()}")
        except InputError as exc:   # the input changed since the plan, the store refused: it could not run (exit 2)
            return failed(f"generation: {exc.one_line()}", {"could_not_run": True})
        assert ctl.assign is not None
        logger.info("job over %d node(s) (%s): %d input lines in %d chunks (%s), plan %s", len(nodes),
                    ", ".join(sorted(nodes)), plan.total_lines, len(plan.chunks),
                    ", ".join(str(c.lines) for c in plan.chunks[:6]) + (" …" if len(plan.chunks) > 6 else ""), pdir)
        asked = cfg.generation.limit
        if asked is not None and (plan.limit is None or plan.limit > asked) and (plan.rows or 0) > asked:
            logger.warning("this job's chunks were cut to %s rows (limit %s) and never change once cut: it "
                           "goes on to all of them, not only the first %d", plan.rows, plan.limit, asked)
        already_done = ctl.assign.all_done()
        for name in sorted(aside):   # a chunk a set-aside node ran under an earlier controller goes to the others
            if ctl.assign.running_on(name):
                ctl.assign.node_lost(name, f"set aside: {aside[name]}")
        shares, errors = _run_nodes(cfg, ctl)
        # with object storage the merge goes from the store to the job's prefix itself: `fleet export URL`
        dest: Path | str = output if ctl.store is not None else pdir / "output"
        try:
            manifest = ctl.finalize(dest)
        except StoreError as exc:   # the output's store refused the merge: its cause and remedy, no traceback
            ctl.fail_job(exc)
            return failed(f"generation: {(ctl.failure or exc).one_line()}",
                          {"plan_dir": str(pdir), "could_not_run": isinstance(ctl.failure, InputChanged)})
        # the fence (fence.py): late runners stopped, abandoned parts removed, what may still run named
        fence = _fence(cfg, ctl)
        cleaned = None
        if ctl.store is not None and manifest.get("complete") and ctl.assign.all_done():
            from fleet.generation.multinode.cleanup import clean_nodes, job_copies

            # the nodes' working copies, now that every row is merged in the store (never one that is not)
            try:
                cleaned = clean_nodes(cfg, output, job_copies(cfg, output, ctl.assign))
                logger.info("removed %d chunk working cop(ies) from the nodes%s", len(cleaned.removed),
                            "".join(f"; kept {k}: {v}" for k, v in sorted(cleaned.kept.items())[:10]))
            except Exception as exc:   # the job is done and merged: a cleanup that fails leaves copies, not a failure
                logger.warning("could not clean the nodes' working copies: %s: %s", type(exc).__name__, exc)
            if fence is not None:   # after the copies: an abandoned part is the last trace of a late attempt
                fence.removed_objects = _remove_leftovers(output, ctl)
    counts = manifest["counts"]
    result = {"output": str(dest), "remote_output": output, "plan_dir": str(pdir), "state": manifest["state"],
              "rows_total": plan.total_lines, "completed": counts["completed"], "errors": counts["errors"],
              "rejects": counts["rejects"], "throughput": manifest.get("throughput"), "cost": manifest.get("cost"),
              "checks": manifest.get("checks"), "nodes": manifest.get("nodes"), "shares": shares,
              "seconds": round(time.monotonic() - t0, 1), "node_copies": cleaned.to_dict() if cleaned else None,
              "fence": fence.to_dict() if fence is not None else None}
    still = "; ".join(fence.warnings()) if fence is not None else ""
    if ctl.failure is not None:   # the input changed under the job (exit 2), the store refused: one line, its remedy
        return failed(f"generation: {ctl.failure.one_line()}",
                      {**result, "could_not_run": isinstance(ctl.failure, InputChanged)})
    if not ctl.assign.all_done():
        left = [i for i, c in ctl.assign.chunks.items() if c.state != "done"]
        if errors:   # each names its cause and its remedy
            return failed(f"{len(left)} chunk(s) not done: {'; '.join(errors)}", result)
        return failed(f"{len(left)} chunk(s) not done (every node lost); run the same command again to resume",
                      result)
    if already_done:
        return Completed(message=f"nothing to do: {counts['completed'] + counts['errors'] + counts['rejects']:,} rows "
                                 f"already done in {dest}", data=result)
    per = ", ".join(f"{n['node']} {n['rows']} ({n['share'] * 100:.0f}%)" for n in manifest.get("nodes") or [])
    return Completed(message=f"generated {counts['completed']} row(s), {counts['errors']} error(s), "
                             f"{counts['rejects']} reject(s) over {len(nodes)} node(s) [{per}] into {dest}"
                             + (f"; not up: {' | '.join(failures)}" if failures else "")
                             + (f"; {still}" if still else ""),
                     data=result)


def _fence(cfg: FleetConfig, ctl: Controller) -> Any:
    """The job's end (fence.py): every node's abandoned runners stopped, each line of what may still run
    (a node that does not answer, servers kept up) said; None when that could not be looked at."""
    from fleet.generation.multinode.fence import fence_job

    assert ctl.assign is not None
    logger = get_run_logger()
    with ctl.assign._lock:   # a node lost at the end says "finished" in its loop; the state says lost
        states = {n: "lost" if ctl.assign.nodes.get(n, {}).get("state") == "lost" else w.state
                  for n, w in ctl.nodes.items()}
    states.update({n: "set aside" for n in ctl.set_aside})
    try:
        fence = fence_job(cfg, ctl.assign, states, None)
    except Exception as exc:   # the job's rows are merged: a fence that fails is said, never a failure
        logger.warning("could not stop the late nodes' runners: %s: %s", type(exc).__name__, exc)
        return None
    for name, chunks in sorted(fence.stopped.items()):
        logger.warning("node %s: stopped the runner(s) of chunk(s) %s, which another node finished", name,
                       ", ".join(map(str, chunks)))
    for line in fence.warnings():   # out of the operator's sight unless said
        logger.warning("%s", line)
    if fence.servers_up:   # as after any job: kept up for the next one
        logger.info("servers still run on %s (`fleet down` stops them)", ", ".join(sorted(fence.servers_up)))
    return fence


def _remove_leftovers(output: str, ctl: Controller) -> int:
    from fleet.generation.multinode.fence import remove_leftovers

    assert ctl.assign is not None
    try:
        n = remove_leftovers(output, ctl.assign)
    except Exception as exc:   # leftovers cost storage, never rows
        get_run_logger().warning("could not remove the abandoned attempts' parts: %s: %s", type(exc).__name__, exc)
        return 0
    if n:
        get_run_logger().info("removed %d object(s) of abandoned attempts from %s/_parts", n, output)
    return n


def _run_nodes(cfg: FleetConfig, ctl: Controller) -> tuple[list[dict[str, Any]], list[str]]:
    """Every node's loop (a `node_worker` task run each) until the job ends: (their shares, a line per
    loop that failed).

    Each loop runs until the job's tail: on the flow's pool (32 threads, shared with the bring-up) the
    33rd node's loop never started and that node never got a chunk (issue 35). The loops get a pool of
    their own, a thread per node; each chunk attempt stays a task run of its own."""
    from tasks.multinode import node_worker, watch_progress

    names = sorted(ctl.nodes)
    with ThreadPoolTaskRunner(max_workers=max(1, len(names))) as pullers:
        futs = {pullers.submit(node_worker, {"ctl": ctl, "node_name": name}): name for name in names}

        def finished(timeout: float) -> bool:
            inner = [f.wrapped_future for f in futs]
            cf_wait([f for f in inner if not f.done()], timeout=timeout, return_when=FIRST_COMPLETED)
            if any(f.done() and f.exception() is not None for f in inner):
                ctl.stop()   # a node task failed outright (a chunk failed too often): stop the others
            return all(f.done() for f in inner)

        try:
            watch_progress(cfg, ctl, finished)
        finally:
            ctl.stop()
        shares: list[dict[str, Any]] = []
        errors: list[str] = []
        for fut, name in futs.items():
            fut.wait()  # bounded: a task's own waits all have timeouts (tests/test_waits.py)
            if fut.state.is_completed():
                # bounded: the future is done (waited for above)
                shares.append(fut.result())
            else:
                try:
                    # bounded: the future is done (waited for above)
                    fut.result(raise_on_failure=True)
                except FleetError as exc:   # cause and remedy, whole (cut at 300 it read "ProfileNotFound(profi")
                    errors.append(f"{name}: {exc.one_line()}")
                except Exception as exc:
                    errors.append(f"{name}: {whole_lines(f'{type(exc).__name__}: {exc}')}")
    return shares, errors


class EarlyChecks:
    """Each node's store check, started before the bring-up and run beside it (a `node-check` task run
    each): a takeover's nodes are up, and their adopt and their check ran one after the other (issue 35
    item 4; bench/bench_takeover.py: 14.9 → 12.6 s to the first chunk beside two CPU burners). The check needs nothing the bring-up makes (it builds the runner's own venv,
    not the servers'). A check that passed counts; one that failed is run again after the bring-up
    (`_check_nodes`), so a node that was still coming up is not set aside for it."""

    def __init__(self, cfg: FleetConfig, input: str, output: str) -> None:
        self.cfg, self.input, self.output = cfg, input, output
        self.futures: dict[str, Any] = {}
        self._runner: ThreadPoolTaskRunner[Any] | None = None

    def __enter__(self) -> EarlyChecks:
        from tasks.multinode import check_node

        names = [n.name for n in self.cfg.nodes]
        self._runner = ThreadPoolTaskRunner(max_workers=max(1, len(names)))
        self._runner.__enter__()
        self.futures = {name: self._runner.submit(check_node, {"cfg": self.cfg, "node_name": name,
                                                                "input": self.input, "output": self.output})
                        for name in names}
        return self

    def __exit__(self, *exc: object) -> None:   # waits for the checks still running (each is bounded)
        if self._runner is not None:
            self._runner.__exit__(None, None, None)
            self._runner = None


def _cause(fut: Any) -> str | None:
    """A finished check's answer: None (it passed) or the cause."""
    fut.wait()  # bounded: the check's node commands all have timeouts
    if fut.state.is_completed():
        # bounded: the future is done (waited for above)
        cause: str | None = fut.result()
        return cause
    try:
        # bounded: the future is done (waited for above)
        fut.result(raise_on_failure=True)
        return f"its check ended {fut.state.name}"
    except FleetError as exc:
        return exc.one_line()
    except Exception as exc:
        return whole_lines(f"{type(exc).__name__}: {exc}")


def _check_nodes(cfg: FleetConfig, names: list[str], input: str, output: str,
                 early: EarlyChecks | None = None) -> dict[str, str]:
    """Each node's store check (a `node-check` task run each, all at once): {node: cause} of those that
    failed. A node whose early check (run beside the bring-up) passed is not checked again."""
    from tasks.multinode import check_node

    passed = set()
    if early is not None and early.input == input and early.output == output:
        passed = {n for n in names if n in early.futures and _cause(early.futures[n]) is None}
    todo = [n for n in names if n not in passed]
    if not todo:
        return {}
    with ThreadPoolTaskRunner(max_workers=max(1, len(todo))) as checks:
        futs = {name: checks.submit(check_node, {"cfg": cfg, "node_name": name, "input": input, "output": output})
                for name in todo}
        aside: dict[str, str] = {}
        for name, fut in futs.items():
            cause = _cause(fut)
            if cause is not None:
                aside[name] = cause
    return aside
