"""One generation job over two nodes, end to end: the split, a node lost mid-job, the controller killed.

Real parts: the Prefect test server (and a CLI subprocess with its own), sim servers on two
local nodes with their own workdirs and ports (one node has half the servers: half the
capacity), the detached runners, the merge, `fleet fetch` and `fleet export`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from conftest import scaled
from fleet.config import FleetConfig
from fleet.generation.multinode.chunks import read_state
from test_bringup import port_block, sim_config
from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("prefect_api")


def two_nodes(tmp_path: Path, *, generation: dict[str, Any], sim: dict[str, Any] | None = None) -> FleetConfig:
    base = port_block(3)
    cfg = sim_config(tmp_path, base, n=1, generation=generation,
                     engine={"sim": {"startup_s": 0.3, **(sim or {})}})
    data = cfg.model_dump(mode="json")
    # Two nodes on one machine would build one venv path at once: use this interpreter's (the sim needs
    # nothing else).
    data["venv"] = {"path": sys.prefix, "use_existing": True}
    data["nodes"] = []
    for name, servers, port in (("fast", 2, base), ("slow", 1, base + 2)):
        (tmp_path / f"shm-{name}").mkdir()
        data["nodes"].append({"name": name, "workdir": str(tmp_path / f"work-{name}"), "servers": servers,
                              "base_port": port, "ramdisk": str(tmp_path / f"shm-{name}")})
    return FleetConfig(**data)


@pytest.fixture
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(d))
    return d


def ids_of(out: Path) -> list[str]:
    return [i for p in sorted((out / "shards").glob("*.parquet"))
            for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]


def plan_state(state_home: Path) -> tuple[Path, dict[str, Any]] | None:
    """The job's plan directory and its state (snapshot + log, read as the controller reads them)."""
    found = list((state_home / "fleet" / "jobs").glob("*/plan.json"))
    if not found:
        return None
    try:
        st = read_state(found[0].parent)
    except (ValueError, FileNotFoundError):   # a plan.json being replaced at this moment
        return None
    return (found[0].parent, st) if st is not None else None


def test_two_nodes_one_job_split_merge_fetch_export(tmp_path: Path, state_home: Path, stop_everything) -> None:
    """The split: one job over two nodes of unequal size ends with every id exactly once in one merged
    directory, both nodes took chunks, the manifest has per-node and per-server numbers and the cost over
    every GPU; `fleet fetch` writes the same merge elsewhere and `fleet export` reads it unchanged.
    (600 rows in chunks of 150 down to 37: 8 chunks, each a runner start — the cost of this test.)"""
    from flows.fleet import fleet

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 150, "price_per_gpu_hour": 2.0})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 600, bad_lines=1)
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(tmp_path / "out"), return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), (state.message, res)
    assert "not up" not in state.message, state.message
    assert (res["completed"], res["errors"], res["rejects"]) == (600, 0, 1)
    out = Path(res["output"])
    ids = ids_of(out)
    assert len(ids) == len(set(ids)) == 600
    manifest = json.loads((out / "manifest.json").read_text())
    nodes = {n["node"]: n for n in manifest["nodes"]}
    assert set(nodes) == {"fast", "slow"} and all(n["chunks"] >= 1 and n["rows"] > 0 for n in nodes.values())
    assert sum(n["rows"] for n in nodes.values()) == 601         # the bad line is the reject's row
    assert {s["name"] for s in manifest["servers"]} == {"fast/0", "fast/1", "slow/0"}
    assert manifest["cost"]["gpus"] == 3 and manifest["cost"]["usd"] > 0
    rej = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rej] == [601]                      # the input's line, not the chunk's
    progress = json.loads((Path(res["plan_dir"]) / "progress.json").read_text())
    assert progress["rows_done"] == progress["rows_total"] == 601
    assert {n["node"] for n in progress["nodes"]} == {"fast", "slow"}

    from flows.cli import main

    cfg_path = tmp_path / "fleet.toml"
    from fleet.demo import to_toml

    cfg_path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    assert main(["fetch", "-c", str(cfg_path), "--output", str(tmp_path / "fetched")]) == 0
    assert sorted(ids_of(tmp_path / "fetched")) == sorted(ids)
    assert main(["export", str(tmp_path / "fetched"), "--format", "jsonl"]) == 0
    assert len((tmp_path / "fetched" / "export.jsonl").read_text().splitlines()) == 600


def test_a_job_over_two_nodes_goes_on_under_a_larger_or_no_limit(tmp_path: Path, state_home: Path,
                                                                  stop_everything) -> None:
    """Fault: a job over several nodes cut to `limit = 100` kept its 100-row plan for a later run with
    `limit = 200` or none: every chunk done, "nothing to do: 100 rows already done", 100 of 300 rows. Now
    each larger call cuts the rest of the input into new chunks and the merged output ends with every id
    exactly once; only a run that asks for nothing more is "nothing to do"."""
    from flows.fleet import fleet

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 50})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 300)

    def generate(limit: int | None) -> tuple[str, list[str]]:
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.generation.limit = limit
        state = fleet(config=run_cfg, action="generate", input=str(inp), output=str(tmp_path / "out"),
                      return_state=True)
        res = state.result(raise_on_failure=False)
        assert state.is_completed(), (state.message, res)
        return str(state.message), ids_of(Path(res["output"]))

    for limit, want in ((100, 100), (200, 200), (None, 300)):
        message, ids = generate(limit)
        assert "nothing to do" not in message, (limit, message)
        assert len(ids) == len(set(ids)) and set(ids) == {f"r{i}" for i in range(want)}, (limit, message)
    message, ids = generate(None)
    assert message.startswith("nothing to do: 300 rows already done"), message
    assert len(ids) == len(set(ids)) == 300


def _runner_pids(workdir: Path) -> list[int]:
    from fleet.node import LocalNode

    out = []
    for p in workdir.glob("jobs/*/runner.pid"):
        pid = int((p.read_text().split() or ["0"])[0])   # "PID STARTTIME"
        if pid and LocalNode().is_alive(pid):
            out.append(pid)
    return out


def _server_pids(workdir: Path) -> list[int]:
    from fleet.node import LocalNode

    return [pid for p in workdir.rglob("*.pid") if "jobs" not in p.parts
            for pid in [int((p.read_text().split() or ["0"])[0])] if pid and LocalNode().is_alive(pid)]


def _cli(cfg: FleetConfig, tmp_path: Path, inp: Path, out: Path, log: Path) -> subprocess.Popen:
    from fleet.demo import to_toml

    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    argv = [sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input", str(inp), "--output", str(out)]
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _run_to_end(proc: subprocess.Popen, log: Path, timeout: float = 400) -> str:
    """Wait for a command `_cli` started to end (its process group SIGKILLed past `timeout`), assert it
    exited 0 (the end of its log in the message else); its log."""
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    return text


def _wait(proc: subprocess.Popen, log: Path, check, what: str, timeout: float = 240) -> Any:
    """`check()`'s first truthy answer, while `proc` runs. A falsy answer is "not yet": a check that
    finds a chunk index returns it in a tuple (chunk 0 is falsy)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        got = check()
        if got:
            return got
        assert proc.poll() is None, f"the command ended before {what}: " + log.read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}: " + log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def test_node_lost_mid_job_its_chunk_goes_elsewhere_without_redoing_fetched_rows(
        tmp_path: Path, state_home: Path, stop_everything) -> None:
    """A node lost mid-job (its runner and servers frozen: no progress for node_lost_s): its running chunk
    goes to the other node, which starts from the shards already gathered from the lost one (rows committed
    and fetched are not generated again); the job still ends with every id exactly once."""
    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 300, "shard_rows": 20, "node_lost_s": 4},
                    sim={"tokens_per_s": 40, "max_running_requests": 4})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 900)
    log = tmp_path / "cli.log"
    proc = _cli(cfg, tmp_path, inp, tmp_path / "out", log)
    frozen: list[int] = []
    try:
        def slow_chunk_with_gathered_shards() -> tuple[Path, int] | None:
            got = plan_state(state_home)
            if not got:
                return None
            pdir, st = got
            for idx, c in st["chunks"].items():
                if c["state"] == "running" and c["node"] == "slow":
                    g = pdir / "gathered" / "slow" / f"chunk-{int(idx):05d}" / "shards"
                    if len(list(g.glob("part-*.parquet"))) >= 2:
                        return pdir, int(idx)
            return None

        pdir, idx = _wait(proc, log, slow_chunk_with_gathered_shards, "the slow node to commit and be gathered")
        frozen = _runner_pids(tmp_path / "work-slow") + _server_pids(tmp_path / "work-slow")
        assert frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        gathered = pdir / "gathered" / "slow" / f"chunk-{idx:05d}" / "shards"
        rc = proc.wait(timeout=400)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert rc == 0, output[-5000:]
    st = read_state(pdir)
    assert st is not None
    # the loss that released the frozen chunk (on a busy machine the slow node may also have been
    # lost and rejoined earlier, with node_lost_s = 4 s: that earlier loss released another chunk)
    lost = [e for e in st["events"] if e["event"] == "node-lost" and e["node"] == "slow"]
    assert any(idx in e["released"] for e in lost), lost
    chunk = st["chunks"][str(idx)]
    on_slow = [a for a in chunk["attempts"] if a["node"] == "slow"]
    assert chunk["state"] == "done" and any(a["outcome"] == "lost" for a in on_slow), chunk
    done_by = chunk["node"]
    fetched_before = sum(pq.ParquetFile(p).metadata.num_rows for p in gathered.glob("part-*.parquet"))
    final = json.loads((pdir / "gathered" / done_by / f"chunk-{idx:05d}" / "manifest.json").read_text())
    lines = json.loads((pdir / "plan.json").read_text())["chunks"][idx]["lines"]
    if done_by != "slow":
        # the fetched rows came with the chunk to the other node: its runs sent only the rest
        assert sum(r["fed"] for r in final["runs"]) <= lines - fetched_before
    ids = ids_of(pdir / "output")
    assert len(ids) == len(set(ids)) == 900


def test_controller_killed_runners_go_on_then_rerun_reattaches(tmp_path: Path, state_home: Path,
                                                              stop_everything) -> None:
    """The controller is disposable: SIGKILL of `fleet generate` leaves each node's runner working on its
    chunk; running the command again re-attaches to those runners (no second runner, no chunk started
    twice on a node) and hands out the remaining chunks; every id exactly once."""
    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 200, "node_lost_s": 120},
                    sim={"tokens_per_s": 40, "max_running_requests": 4})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 1000)
    out = tmp_path / "out"
    log1 = tmp_path / "first.log"
    first = _cli(cfg, tmp_path, inp, out, log1)

    def live_runner_on_each_node_and_a_chunk_done() -> list[int] | None:
        got = plan_state(state_home)
        if not got or not any(c["state"] == "done" for c in got[1]["chunks"].values()):
            return None
        fast, slow = _runner_pids(tmp_path / "work-fast"), _runner_pids(tmp_path / "work-slow")
        return [fast, slow] if fast and slow else None

    try:
        by_node = _wait(first, log1, live_runner_on_each_node_and_a_chunk_done,
                        "a chunk done and a runner on each node")
        runners = by_node[0] + by_node[1]
        # Hold the runners (alive, as busy ones are) from before the kill until the second command has
        # re-attached: a chunk that ends meanwhile is simply finished, with nothing to re-attach to.
        for pid in runners:
            os.kill(pid, signal.SIGSTOP)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    pdir, st = plan_state(state_home)  # type: ignore[misc]
    from fleet.node import LocalNode

    assert all(LocalNode().is_alive(pid) for pid in runners), "a runner died with the controller"
    log2 = tmp_path / "second.log"
    second = _cli(cfg, tmp_path, inp, out, log2)
    try:
        _wait(second, log2, lambda: log2.read_text(errors="replace").count("re-attached on") >= 2,
              "the second command to re-attach to both runners")
    finally:
        for pid in runners:
            os.kill(pid, signal.SIGCONT)
    try:
        rc = second.wait(timeout=400)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    text = log2.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    import re

    reattached = {int(p) for p in re.findall(r"re-attached on \w+, runner pid (\d+)", text)}
    # each node's runner from before the kill was re-attached to (the others, and the runners the new
    # controller started itself, may have ended or been re-attached too)
    assert all(reattached & set(pids) for pids in by_node), (reattached, by_node)
    st = read_state(pdir)
    assert st is not None
    for c in st["chunks"].values():
        assert c["state"] == "done"
        per_node = [a["node"] for a in c["attempts"]]
        assert len(per_node) == len(set(per_node)), c     # re-attached, never started twice on one node
    ids = ids_of(pdir / "output")
    assert len(ids) == len(set(ids)) == 1000


@pytest.mark.ssh
def test_a_local_and_an_ssh_node_one_job(tmp_path: Path, state_home: Path, sshd, stop_everything) -> None:
    """Over SSH: the chunk files are uploaded to the SSH node, its runner runs from its own venv and a
    zip of fleet, its chunk outputs are gathered over SFTP; the job ends with every id exactly once."""
    from flows.fleet import fleet

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 150})
    data = cfg.model_dump(mode="json")
    slow = data["nodes"][1]
    remote = sshd.node_config(name="remote", workdir=str(tmp_path / "rwork"), servers=1,
                              base_port=slow["base_port"], ramdisk=slow["ramdisk"])
    data["nodes"][1] = remote.model_dump(mode="json")
    cfg = FleetConfig(**data)
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 600)
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(tmp_path / "out"), return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed() and "not up" not in state.message, (state.message, res)
    ids = ids_of(Path(res["output"]))
    assert len(ids) == len(set(ids)) == 600
    nodes = {n["node"]: n for n in json.loads((Path(res["output"]) / "manifest.json").read_text())["nodes"]}
    assert nodes["remote"]["chunks"] >= 1, nodes
    assert list((tmp_path / "rwork" / "inputs").rglob("chunk-*.jsonl")), "the chunk files were not uploaded"


def test_an_ssh_nodes_chunks_share_one_connection_and_one_runner_install(tmp_path: Path, state_home: Path, sshd,
                                                                       stop_everything, monkeypatch) -> None:
    """Cost: a node's chunk attempts, one after another, run on one SSH connection, and the runner's venv
    and zip are checked and put once. Before, each attempt connected again (a handshake), checked the
    workdir and the runner venv (its stamp, an import of pyarrow on the node) and put fleet's 1.3 MB zip
    again: at 100 nodes, most of the controller's CPU. Counted: the connections the test sshd accepted
    during the job (its own log), and the zips put (SSHNode.put, wrapped to count and call through)."""
    from fleet.node.ssh.node import SSHNode
    from flows.fleet import fleet

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 100})
    data = cfg.model_dump(mode="json")
    # two SSH nodes (one sshd: the test's log sees both), each a workdir and a server of its own
    data["nodes"] = [sshd.node_config(name=f"remote-{i}", workdir=str(tmp_path / f"rwork{i}"), servers=1,
                                      base_port=n["base_port"], ramdisk=n["ramdisk"]).model_dump(mode="json")
                     for i, n in enumerate(data["nodes"])]
    cfg = FleetConfig(**data)
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 800)   # 8 chunks over the two nodes
    zips: list[str] = []
    put = SSHNode.put

    def counted(self: SSHNode, local: Any, remote: str) -> None:
        if remote.endswith("/fleet-runner.pyz"):
            zips.append(remote)
        put(self, local, remote)

    monkeypatch.setattr(SSHNode, "put", counted)
    log = sshd.dir / "sshd.log"
    start = log.stat().st_size
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(tmp_path / "out"), return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), (state.message, res)
    ids = ids_of(Path(res["output"]))
    assert len(ids) == len(set(ids)) == 800
    found = plan_state(state_home)
    assert found is not None
    attempts = [a for c in found[1]["chunks"].values() for a in c["attempts"]]
    assert len(attempts) >= 8, attempts
    with open(log, "rb") as f:
        f.seek(start)
        accepted = [x for x in f.read().decode(errors="replace").splitlines() if "Accepted publickey" in x]
    assert sorted(zips) == sorted(f"{tmp_path}/rwork{i}/bin/fleet-runner.pyz" for i in range(2)), zips
    # the bring-up's own connections and the controller's one per node: fewer than the attempts (one each before)
    assert len(accepted) < len(attempts), (len(accepted), accepted)


def test_a_second_job_over_several_nodes_into_one_output_exits_2(tmp_path: Path, state_home: Path, stop_everything,
                                                                capsys) -> None:
    """Fault (issue 23): a second `fleet generate` over several nodes into the output of a job whose
    controller runs met that controller's lock and exited 1 (a FatalError out of the flow), where
    README's exit-code table says 2 for a second job into a job's directory. Now it exits 2 with the
    reason (another controller, its pid) and the remedy; the live controller is left alone."""
    from fleet.demo import to_toml
    from fleet.generation.multinode.chunks import ControllerLock, plan_dir_for
    from fleet.generation.multinode.controller import plan_root
    from flows.cli import main

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 150})
    stop_everything(cfg)
    inp, out = prompts(tmp_path / "in.jsonl", 50), tmp_path / "out"
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    pdir = plan_dir_for(plan_root(), cfg.name, str(out))
    with ControllerLock(pdir):   # the first job's controller, alive
        rc = main(["generate", "-c", str(path), "--input", str(inp), "--output", str(out)])
        text = capsys.readouterr()
        assert rc == 2, text
        assert f"another controller (pid {os.getpid()}) is running this multi-node job" in text.err, text.err
        assert "give it its own --output" in text.err and "Traceback" not in text.err
        assert (pdir / ".controller.lock").read_text() == str(os.getpid())
