"""The fence of a multi-node store job (fleet/generation/multinode/fence.py): only a chunk's counted
attempt adds to the output, a late node's runner is stopped and its leftovers removed, what cannot be
stopped is named; and the job's cost counted per node for the time it held the node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_multinode import _cli, _run_to_end, _runner_pids, _server_pids, _wait, plan_state, state_home, two_nodes  # noqa: F401
from test_objstore import s3, store_ids  # noqa: F401  (fixture)



def _live_runner_outputs(work: Path) -> dict[str, int]:
    """{working copy's name: pid} of the live runners under a local node's workdir."""
    from fleet.node import LocalNode

    found = {}
    for jf in work.glob("jobs/*/job.json"):
        pidf = jf.parent / "runner.pid"
        pid = int((pidf.read_text().split() or ["0"])[0]) if pidf.exists() else 0
        if pid and LocalNode().is_alive(pid):
            found[Path(json.loads(jf.read_text())["output"]).name] = pid
    return found


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.timeout(900)   # one bring-up and a 400-row job through a loss, on a shared 2-core machine
def test_a_lost_nodes_prestarted_runner_is_stopped_and_its_late_parts_count_for_nothing(
        tmp_path: Path, state_home: Path, s3: str, stop_everything) -> None:  # noqa: F811
    """The fault seen on main: a node lost while it had a second chunk started early ("started on slow while
    the previous one drains") — the lost chunk's runner was stopped, the early one's never: it went on
    generating, and publishing into its abandoned prefix, after the job ended; cleanup said "its runner is
    still running". Now every runner of the lost node's abandoned attempts is stopped (at the loss, when the
    node answers), the abandoned parts are removed from the store once the job is complete, every id is in
    the output once, and a part put by a late runner after the end adds nothing to a merge from the store."""
    from fleet.generation.data.objstore import Store

    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 60, "shard_rows": 10, "node_lost_s": 30},
                    sim={"tokens_per_s": 40, "max_running_requests": 4})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 400)
    Store(s3).put_file(str(inp), "in/prompts.jsonl")
    out = f"{s3}/job"
    log = tmp_path / "gen.log"
    proc = _cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log)   # type: ignore[arg-type]
    slow = tmp_path / "work-slow"
    frozen: list[int] = []
    late_runner: list[Any] = []   # argv, environment, cwd
    try:
        def two_runners_on_slow() -> tuple[list[int]] | None:
            """Slow runs two chunks (one started while the other drains), both runners alive: freeze the
            node there (its runners and servers), and say which chunks (in a tuple: chunk 0 is falsy)."""
            got = plan_state(state_home)
            if not got:
                return None
            running = sorted(int(i) for i, c in got[1]["chunks"].items()
                             if c["state"] == "running" and c["node"] == "slow")
            live = _live_runner_outputs(slow)
            if len(running) < 2 or not all(f"chunk-{i:05d}" in live for i in running):
                return None
            pids = _runner_pids(slow) + _server_pids(slow)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            frozen[:] = pids
            # The lost chunk's runner as it is now (how it was started, its job directory, its working
            # copy): run again after the job's end on these files, it is the node that did not answer at
            # the end (fence_job could neither stop it nor clean its files) coming back.
            pid = live[f"chunk-{running[0]:05d}"]
            job_dir = next(jf.parent for jf in slow.glob("jobs/*/job.json")
                           if Path(json.loads(jf.read_text())["output"]).name == f"chunk-{running[0]:05d}")
            copy = tmp_path / "late-node"
            dirs = [job_dir, Path(json.loads((job_dir / "job.json").read_text())["output"])]
            for i, d in enumerate(dirs):
                shutil.copytree(d, copy / str(i), symlinks=True)
            late_runner[:] = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1],
                              dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                                   if b"=" in kv),
                              os.readlink(f"/proc/{pid}/cwd"), [(copy / str(i), d) for i, d in enumerate(dirs)]]
            return (running,)

        (chunks,) = _wait(proc, log, two_runners_on_slow, "two chunks running on the slow node at once", timeout=400)
        text = _run_to_end(proc, log, timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    pdir, st = plan_state(state_home)  # type: ignore[misc]
    assert any(e["event"] == "node-lost" and e["node"] == "slow" for e in st["events"]), text[-3000:]
    live = _live_runner_outputs(slow)
    assert not any(name.startswith(tuple(f"chunk-{i:05d}" for i in chunks)) for name in live), live
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 400
    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["complete"] and manifest["counts"]["completed"] == 400
    assert "its runner is still running" not in text
    # the store keeps only each chunk's counted attempt's part (the first to finish it, by the state):
    # the lost node's abandoned prefixes are gone, and no two attempts shared one
    counted = set()
    for c in st["chunks"].values():
        done = sorted((a for a in c["attempts"] if a["outcome"] == "done"), key=lambda a: a["ended_at"])
        counted.add(f"{done[0]['node']}/{Path(done[0]['output']).name}")
    for c in st["chunks"].values():
        for a in c["attempts"]:
            assert a["outcome"] == "done" or f"{a['node']}/{Path(a['output']).name}" not in counted, c
    parts = Store(f"{out}/_parts")
    there = {f"{n}/{c}" for n in parts.names() for c in parts.child(n).names()
             if Store(f"{out}/_parts/{n}/{c}").names()}
    assert there == counted, (there, counted)
    # a late runner that could not be stopped publishes into its abandoned prefix after the end: a merge
    # from the store (`fleet fetch`) reads the counted parts only, so the output's ids do not change
    late = Store(f"{out}/_parts/slow/chunk-{chunks[0]:05d}")
    with late.open_write("shards/part-000099.parquet") as f:
        pq.write_table(pa.table({"id": ["late-0"], "completion": ["x"]}), f)
    from flows.cli import main

    assert main(["fetch", "-c", str(tmp_path / "fleet.toml"), "--output", str(tmp_path / "fetched")]) == 0
    fetched = [i for p in sorted((tmp_path / "fetched" / "shards").glob("*.parquet"))
               for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
    assert sorted(fetched) == sorted(ids)
    # the chunk started early is stopped at the loss (the node still answers), not left to run on
    assert "node slow: stopped the runner(s) of chunk(s)" in text, text[-3000:]
    # The node back after the end, its runner never stopped (it did not answer at the end): it resumes
    # its chunk and puts its shards in its prefix. The old code kept them there for good (removed only
    # by the next run of the command); now the runner reads the job's end marker, removes its part and
    # stops, its exit record saying why.
    argv, runner_env, cwd, saved = late_runner
    for kept, where in saved:   # the node's files as it left them (its cleanup at the end never reached it)
        shutil.rmtree(where, ignore_errors=True)
        shutil.copytree(kept, where, symlinks=True)
    job_dir = saved[0][1]
    (job_dir / "exit.json").unlink(missing_ok=True)
    late_run = subprocess.run(argv, env={k.decode(): v.decode() for k, v in runner_env.items()}, cwd=cwd,
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    said = (late_run.stdout + late_run.stderr).decode(errors="replace")
    assert late.names() == [] and not Store(f"{out}/_parts/slow/chunk-{chunks[0]:05d}/shards").names(), said[-3000:]
    assert late_run.returncode != 0, said[-3000:]
    exit_rec = json.loads((job_dir / "exit.json").read_text())
    assert (exit_rec.get("failure") or {}).get("kind") == "fenced", exit_rec
    assert store_ids(out) == ids   # the output itself is as it was
    # the job's cost: per node, for the time the job held it (bring-up start to release), on that basis
    _check_cost(manifest)


def _check_cost(manifest: dict[str, Any]) -> None:
    cost = manifest["cost"]
    assert "held" in cost["basis"], cost
    held = {n["node"]: n for n in cost["nodes"]}
    assert set(held) == {"fast", "slow"}
    assert held["fast"]["gpus"] == 2 and held["slow"]["gpus"] == 1
    # both held from the bring-up's start; fast to the job's end, slow to then or to its last loss
    assert all(n["held_s"] > 0 for n in held.values())
    assert held["fast"]["released"] == "job end" and held["slow"]["released"] in ("job end", "lost")
    assert held["fast"]["since"] == held["slow"]["since"] < manifest["timings"]["started_at"]
    total = sum(n["gpus"] * n["held_s"] for n in held.values()) / 3600
    assert cost["gpu_hours"] == pytest.approx(total, abs=1e-3)


def test_cost_counts_each_node_for_the_time_the_job_held_it_idle_and_set_aside_nodes_too() -> None:
    """The old cost: every GPU of every node that ran a chunk over the whole wall time, none of a node that
    ran none. Now per node from its bring-up's start to its release: the job's end, or when it was set
    aside / quarantined / lost for good; a node that ran no chunk still counts."""
    from fleet.generation.multinode.cost import BASIS, job_cost, merged_holds, node_holds

    holds = node_holds({"a": 8, "idle": 8, "aside": 4, "q": 2, "lost": 1}, since=1000.0, end=4600.0,
                       set_aside={"aside": 1060.0}, quarantined={"q": 2800.0}, lost={"lost": 9999.0})
    by = {h.node: h for h in holds}
    assert by["a"].held_s == by["idle"].held_s == 3600.0 and by["a"].released == "job end"
    assert by["aside"].held_s == 60.0 and by["aside"].released == "set aside"
    assert by["q"].held_s == 1800.0 and by["q"].released == "quarantined"
    assert by["lost"].held_s == 3600.0   # a release after the end is the end
    cost = job_cost(holds, 2.0, completion_tokens=1_000_000)
    assert cost["basis"] == BASIS and cost["gpus"] == 23
    assert cost["gpu_hours"] == pytest.approx(8 + 8 + 4 / 60 + 1 + 1, abs=1e-4)
    assert cost["usd"] == pytest.approx(2 * cost["gpu_hours"], abs=1e-3)
    assert cost["usd_per_m_completion_tokens"] == cost["usd"]
    assert {n["node"]: n["gpu_hours"] for n in cost["nodes"]}["idle"] == 8.0
    assert "usd" not in job_cost(holds, None, 10)
    # a second controller keeps the first one's `since`: the nodes were held in between too
    again = merged_holds(node_holds({"a": 8}, since=3000.0, end=5000.0), [{"node": "a", "since": 1000.0}])
    assert again[0].since == 1000.0 and again[0].held_s == 4000.0


def _assign(plan_dir: Path, attempts: dict[int, list[tuple[str, str, str | None]]]) -> Any:
    """Assignments of a plan of len(attempts) chunks whose chunk i had `attempts[i]`: (node, output, outcome)."""
    from fleet.generation.multinode.chunks import Assignments, Attempt, Chunk, ChunkState, Plan

    plan = Plan(input="x", input_id={}, total_lines=10 * len(attempts), chunk_rows=10, nodes=["a", "b"],
                chunks=[Chunk(i, 1 + 10 * i, 10, "") for i in attempts], fmt="jsonl")
    plan_dir.mkdir(parents=True, exist_ok=True)
    assign = Assignments(plan_dir, plan)
    for i, atts in attempts.items():
        c = ChunkState(attempts=[Attempt(node=n, output=o, started_at=float(k), ended_at=float(k + 1) if oc else None,
                                         outcome=oc) for k, (n, o, oc) in enumerate(atts)])
        done = [a for a in c.attempts if a.outcome == "done"]
        c.state, c.node = ("done", done[0].node) if done else ("pending", None)
        assign.chunks[i] = c
    return assign


def test_only_a_chunks_counted_attempt_counts_and_a_nodes_other_attempts_are_abandoned(tmp_path: Path) -> None:
    from fleet.generation.multinode.chunks import Chunk
    from fleet.generation.multinode.fence import abandoned_on, attempt_name, attempt_part, counted_attempts

    c = Chunk(3, 1, 10, "")
    assert attempt_name(c, 1) == "chunk-00003" and attempt_name(c, 2) == "chunk-00003.2"
    assert attempt_part("s3://b/job/", "slow", "/w/objstore/k/slow/chunk-00003.2") == "s3://b/job/_parts/slow/chunk-00003.2"
    assign = _assign(tmp_path, {0: [("slow", "/w/slow/chunk-00000", "lost"), ("fast", "/w/fast/chunk-00000", "done")],
                                1: [("slow", "/w/slow/chunk-00001", "done")],
                                2: [("slow", "/w/slow/chunk-00002", "failed"), ("slow", "/w/slow/chunk-00002.2", None)]})
    counted = counted_attempts(assign)
    assert {i: a.node for i, a in counted.items()} == {0: "fast", 1: "slow"}   # chunk 2 is not done
    assert [(i, a.output) for i, a in abandoned_on(assign, "slow")] == [(0, "/w/slow/chunk-00000"),
                                                                         (2, "/w/slow/chunk-00002")]
    assert abandoned_on(assign, "fast") == []


def test_a_late_node_that_does_not_answer_is_named_with_what_may_still_run(tmp_path: Path) -> None:
    """At the job's end the fence stops the abandoned runners of every node that answers; one that does not
    is named in the job's report: its chunks' runners and its servers may still run."""
    from test_bringup import port_block, sim_config

    from fleet.generation.multinode.fence import fence_job

    cfg = sim_config(tmp_path, port_block(1), n=1)
    data = cfg.model_dump(mode="json")
    data["nodes"] = [{"name": n, "workdir": str(tmp_path / n)} for n in ("fast", "slow")]
    from fleet.config import FleetConfig

    cfg = FleetConfig.model_validate(data)
    assign = _assign(tmp_path, {0: [("fast", "/w/fast/chunk-00000", "done")],
                                1: [("slow", "/w/slow/chunk-00001", "lost"), ("fast", "/w/fast/chunk-00001", "done")]})

    def connect(node_cfg: Any) -> Any:
        if node_cfg.name == "slow":
            raise OSError("no route to host")
        from fleet.node import LocalNode

        return LocalNode()

    fence = fence_job(cfg, assign, {"fast": "finished", "slow": "lost"}, None, connect=connect)
    assert fence.unreachable == {"slow": [1]} and fence.servers_maybe == ["slow"] and fence.servers_up == ["fast"]
    assert fence.warnings() == ["slow: runner of chunk 1 may still run; its servers may still run "
                                "(it does not answer; `fleet down` once it does)"]
    assert fence.lines()[-1] == "servers still run on fast (`fleet down` stops them)"


def test_a_late_publish_into_an_abandoned_prefix_adds_nothing_to_the_merge(tmp_path: Path) -> None:
    """A lost node's runner that could not be stopped puts a shard into its abandoned prefix after its chunk
    was finished elsewhere: the merge from the store reads each done chunk's counted attempt alone, so the
    late rows are not in the output (on main they were merged: every attempt's part was a source)."""
    from test_bringup import port_block, sim_config

    from fleet.generation.multinode.controller import merge_job

    out = tmp_path / "store"   # a local directory is a store too (objstore.Store)
    assign = _assign(tmp_path / "plan", {0: [("slow", "/w/slow/chunk-00000", "lost"),
                                             ("fast", "/w/fast/chunk-00000", "done")]})
    for node, ids in (("fast", ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]), ("slow", ["late-0"])):
        part = out / "_parts" / node / "chunk-00000"
        (part / "shards").mkdir(parents=True)
        pq.write_table(pa.table({"id": ids, "completion": ["x"] * len(ids)}), part / "shards" / "part-000001.parquet")
        (part / "manifest.json").write_text(json.dumps({"complete": True, "state": "done", "accounted": len(ids)}))
    cfg = sim_config(tmp_path, port_block(1), n=1)
    merge_job(cfg, tmp_path / "plan", assign.plan, assign, tmp_path / "dest", store=str(out))
    merged = [i for p in sorted((tmp_path / "dest" / "shards").glob("*.parquet"))
              for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
    assert sorted(merged) == list("abcdefghij")


def test_after_the_end_only_a_counted_attempt_keeps_its_part_and_a_late_one_removes_its_own(tmp_path: Path) -> None:
    """The runner's side of the fence (job/publish.py `Publisher.check_fence`) on a local-directory store:
    with the job's end marker naming the counted parts, a counted attempt finishing after it keeps its part
    (a late end of the one attempt that counts must lose nothing); an attempt not named removes its own
    part, raises Fenced and puts nothing more; without the marker (the job still runs) nothing changes."""
    from fleet.errors import Fenced
    from fleet.generation.job.publish import ENDED_FILE, Publisher

    store = tmp_path / "store"

    def publisher(node: str) -> tuple[Publisher, Path]:
        out = tmp_path / "work" / node / "chunk-00000"
        (out / "shards").mkdir(parents=True)
        pq.write_table(pa.table({"id": [f"{node}-0"], "completion": ["x"]}), out / "shards" / "part-000001.parquet")
        (out / "manifest.json").write_text("{}")
        return Publisher(out, f"{store}/_parts/{node}/chunk-00000"), store / "_parts" / node / "chunk-00000"

    running, running_part = publisher("running")
    running.finish()   # no marker: the job runs on
    assert (running_part / "manifest.json").exists()
    (store / ENDED_FILE).parent.mkdir(parents=True)
    (store / ENDED_FILE).write_text(json.dumps({"counted": ["_parts/counted/chunk-00000"], "at": 0}))
    counted, counted_part = publisher("counted")
    counted.finish()
    assert sorted(p.name for p in counted_part.rglob("*") if p.is_file()) == ["manifest.json", "part-000001.parquet"]
    late, late_part = publisher("late")
    with pytest.raises(Fenced, match="the job ended without this attempt"):
        late.finish()
    assert not [p for p in late_part.rglob("*") if p.is_file()]
    pq.write_table(pa.table({"id": ["late-1"], "completion": ["x"]}),
                   tmp_path / "work" / "late" / "chunk-00000" / "shards" / "part-000002.parquet")
    with pytest.raises(Fenced):
        late.sync_shards()   # fenced once: nothing more goes to the store
    assert not [p for p in late_part.rglob("*") if p.is_file()]
