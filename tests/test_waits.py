"""Every wait has a bound (issue 23): a stopped child, a child in another session holding the
pipes, a stopped server — none of them may hold a command, a relaunch or a bring-up.

What these protect:
- a command killed at its timeout whose pipes a stopped child in another session still holds
  returns (LocalNode's second read of the pipes once had no timeout);
- a launch shell stopped before it writes its pid file is killed (by pid and start time) and the
  launch fails with the reason, instead of `fleet` waiting on it for as long as it stays stopped;
- the same inside a job: the relaunch of a crashed server whose launch shell is stopped fails,
  is retried through the crash path and the job ends with every row exactly once;
- a stopped (SIGSTOP) server at bring-up is a failed server: `generate` starts on its peers at
  once instead of waiting out servers.ready_timeout_s;
- the static scan: no call in fleet/ that waits without a timeout, except the allow-listed ones.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import start_local_servers, wait_until
from fleet.config import FleetConfig
from fleet.errors import CommandFailed, CommandTimeout
from fleet.node import LocalNode

ROOT = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def test_timed_out_command_whose_stopped_child_in_another_session_holds_the_pipes_returns(tmp_path: Path) -> None:
    """Fault: a command times out while a child it put in its own session (setsid), and then
    stopped, holds its stdout and stderr. Killing the command's group misses that child and the
    read of the pipes after the kill had no timeout: the call never returned (issue 23's hung
    relaunch). Now it raises CommandTimeout within the timeout plus the bounded drain."""
    from fleet.node.local import DRAIN_S

    pidfile = tmp_path / "child.pid"
    script = 'setsid sh -c \'echo $$ > "$1"; kill -STOP $$\' fleet-child "$1" & sleep 60'
    node = LocalNode()
    t0 = time.monotonic()
    try:
        with pytest.raises(CommandTimeout):
            node.run(["sh", "-c", script, "fleet-test", str(pidfile)], timeout=1.0)
        took = time.monotonic() - t0
        child = int(pidfile.read_text())
        assert not _gone(child), "the stopped child outlived the kill (else the pipes were never held)"
        assert took < 1.0 + DRAIN_S + 10, f"returned after {took:.1f} s"
    finally:
        if pidfile.exists():
            _kill(int(pidfile.read_text()))


def _stopping_mkdir(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A `mkdir` on PATH that, while `arm` exists, removes it and stops its parent (the launch
    shell, which runs mkdir before it writes its pid file) and records that parent's pid."""
    bin_dir, arm, victim = tmp_path / "stopbin", tmp_path / "arm", tmp_path / "victim"
    bin_dir.mkdir()
    fake = bin_dir / "mkdir"
    fake.write_text(f'#!/bin/sh\nif rm "{arm}" 2>/dev/null; then echo $PPID > "{victim}"; kill -STOP $PPID; fi\n'
                    'exec /bin/mkdir "$@"\n')
    fake.chmod(0o755)
    return bin_dir, arm, victim


def test_launch_shell_stopped_before_its_pid_file_is_killed_and_the_launch_fails(tmp_path: Path) -> None:
    """Fault: the launch shell of a detached process is stopped (SIGSTOP) before it writes its pid
    file. start_detached used `setsid --fork`, whose shell held the caller's pipes: the call hung
    as long as the shell stayed stopped. Now it fails within the pid file's bound, naming the
    launch, and the stopped shell is gone (killed by its recorded pid and start time), so it can
    never start a second copy beside the retry."""
    from fleet.node.base import PID_FILE_TIMEOUT_S

    bin_dir, arm, victim = _stopping_mkdir(tmp_path)
    arm.touch()
    node = LocalNode()
    t0 = time.monotonic()
    try:
        with pytest.raises(CommandFailed, match="wrote no pid file") as info:
            node.start_detached(["sleep", "60"], log_path=str(tmp_path / "d.log"), pid_path=str(tmp_path / "d.pid"),
                                env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
        assert time.monotonic() - t0 < PID_FILE_TIMEOUT_S + 20
        assert "killed" in str(info.value)
        shell = int(victim.read_text())
        wait_until(lambda: _gone(shell), timeout=10, what="the stopped launch shell killed")
        assert not (tmp_path / "d.pid").exists()
        # the next launch (the retry) works: the fault was the shell's, not the node's
        det = node.start_detached(["sleep", "60"], log_path=str(tmp_path / "d.log"), pid_path=str(tmp_path / "d.pid"),
                                  env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
        node.stop(det.pid, grace_s=1)
    finally:
        if victim.exists():
            _kill(int(victim.read_text()))


def test_stopped_launch_shell_during_a_relaunch_is_retried_and_the_job_ends(tmp_path: Path) -> None:
    """Fault (issue 23): kill -9 a server mid-job, then SIGSTOP the launch shell of its relaunch.
    The runner sat at "relaunching server local/1" with the job "paused" for as long as the shell
    stayed stopped. Now the stopped launch is killed, the relaunch fails through the crash path
    and is tried again; the server comes back and every row ends exactly once. Server 0 is slow
    (one row at a time), so the job outlasts the relaunches whatever the load."""
    from conftest import port_block
    from fleet.generation.job.runner import run_local
    from fleet.servers import stop_servers
    from test_gen_runner import progress, result_ids, sim_fleet, wait_for, write_input

    bin_dir, arm, victim = _stopping_mkdir(tmp_path)
    # Server 1 slow enough that rows are left when it is killed: at the fleet's 600 tokens/s x 8 it
    # served all 160 in ~2 s, and on a loaded machine the job had ended before the kill (no relaunch)
    cfg = sim_fleet(tmp_path, port_block(2), 2, extra_args_by_index={
        0: ["--max-running-requests", "1", "--tokens-per-s", "24"],
        1: ["--max-running-requests", "4", "--tokens-per-s", "60"]})
    data = cfg.model_dump()
    data["engine"]["env"] = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cfg = FleetConfig(**data)
    node = LocalNode("local")
    pids: list[int] = []
    try:
        entries = start_local_servers(cfg, pids)
        inp, out = tmp_path / "in.jsonl", tmp_path / "out"
        rows = write_input(inp, 160)
        done: dict[str, bool] = {}

        def kill_server_1() -> None:
            def served() -> bool:
                p = progress(out)
                return bool(p and p.get("servers") and p["servers"][1]["requests"] >= 20)
            wait_for(served, 60, "server 1 serving")
            arm.touch()   # its relaunch's shell stops before it writes the pid file
            os.killpg(pids[1], signal.SIGKILL)
            done["killed"] = True

        t = threading.Thread(target=kill_server_1, daemon=True)
        t.start()
        rc = run_local(cfg, inp, out, entries, flush_interval_s=0.5, progress_interval_s=0.1)
        t.join(5)
        assert rc == 0 and done.get("killed")
        assert victim.exists() and not arm.exists(), "the relaunch's launch shell was stopped"
        assert _gone(int(victim.read_text())), "the stopped launch shell was killed"
        ids = result_ids(out)
        assert len(ids) == rows == len(set(ids))
        manifest = json.loads((out / "manifest.json").read_text())
        s1 = {s["name"]: s for s in manifest["servers"]}["local/1"]
        assert s1["restarts"] >= 1 and s1["state"] == "up", s1
    finally:
        if victim.exists():
            _kill(int(victim.read_text()))
        stop_servers(node, cfg, cfg.nodes[0])


@pytest.mark.usefixtures("prefect_api")
def test_stopped_server_at_bringup_is_a_failed_server_and_the_job_starts_on_its_peers(tmp_path: Path) -> None:
    """Fault (issue 23): one of the fleet's servers is stopped (SIGSTOP) when `generate` brings the
    fleet up. Adopting it waited for its readiness for servers.ready_timeout_s (12+ minutes seen,
    no runner, no rows). Now a stopped process fails its launch at once ("is stopped"), and the
    job runs on its peers. Another one is hung (alive, /health answers, generations never do):
    adopted and smoked before, it is warm, so its smoke gets no first-request allowance and fails
    in attempts × smoke.timeout_s. ready_timeout_s and the smoke's first timeout are 10 minutes
    here: a wait on either server would take that long; the whole command must take far less."""
    from fleet.servers import stop_servers
    from flows.fleet import fleet
    from test_bringup import port_block, sim_config
    from test_generate_flow import prompts, shard_ids

    cfg = sim_config(tmp_path, port_block(4), n=4, generation={"max_tokens": 16},
                     servers={"ready_timeout_s": 600, "extra_args_by_index": {3: ["--hang-after", "1"]}},
                     smoke={"first_timeout_s": 600, "timeout_s": 3})
    stopped = None
    try:
        state = fleet(config=cfg, action="bringup", return_state=True)
        rows = state.result(raise_on_failure=False)
        assert state.is_completed(), rows
        stopped = next(r["pid"] for r in rows if r["server"] == 1)
        os.kill(stopped, signal.SIGSTOP)
        inp, out = prompts(tmp_path / "in.jsonl", 60), tmp_path / "out"
        t0 = time.monotonic()
        state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
        took = time.monotonic() - t0
        res = state.result(raise_on_failure=False)
        assert state.is_completed(), res
        assert res["completed"] == 60 and len(set(shard_ids(out))) == 60
        manifest = json.loads((out / "manifest.json").read_text())
        assert sorted(s["name"] for s in manifest["servers"]) == ["local/0", "local/2"]
        assert took < 300, f"generate took {took:.0f} s: it waited on the stopped server"
    finally:
        if stopped:
            try:
                os.kill(stopped, signal.SIGCONT)
            except OSError:
                pass
        stop_servers(LocalNode(), cfg, cfg.nodes[0])


# -- the static scan -------------------------------------------------------------------------------

# Calls that block until something happens, and how each one is bounded:
#   .communicate/.wait/.join/.acquire/.get/.result: a timeout argument (a positional one counts for
#   wait/join/acquire(blocking, timeout)/get(block, timeout));
#   .select: a timeout; subprocess.run/check_output/call: timeout=;
#   .recv/.recv_stderr/.accept/.sendall/.exec_command/.invoke_subsystem: only where the line says why it is bounded.
# A call is allowed when its line (or the line above) carries `# bounded: <why>`.
_NEEDS_TIMEOUT = {"communicate", "wait", "join", "acquire", "get", "result", "select", "wait_for"}
_ALWAYS_JUSTIFY = {"recv", "recv_stderr", "accept", "exec_command", "invoke_subsystem", "recv_exit_status"}
# Names too common to judge by the method alone: only on an owner whose name says what it is
# (a Prefect state's .result() and a context's .get() never wait; a future's and a queue's do).
_OWNER_HINT = {"result": ("fut",), "get": ("queue", "lines", "inbox"), "accept": ("listener", "sock")}
_SUBPROCESS = {"run", "check_output", "check_call", "call"}


def _has_timeout(call: ast.Call, name: str) -> bool:
    if any(k.arg in ("timeout", "timeout_s") for k in call.keywords):
        return not any(k.arg == "timeout" and isinstance(k.value, ast.Constant) and k.value.value is None
                       for k in call.keywords)
    if name in ("wait", "join", "select", "result", "communicate") and len(call.args) >= (2 if name == "communicate" else 1):
        return True
    if name in ("acquire", "get") and len(call.args) >= 2:
        return True
    if name == "acquire" and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value is False:
        return True
    if name == "get" and call.args and not (isinstance(call.args[0], ast.Constant) and call.args[0].value is True):
        return True   # dict.get(key) / Queue.get(False): never blocks
    if any(k.arg in ("blocking", "block") and isinstance(k.value, ast.Constant) and k.value.value is False
           for k in call.keywords):
        return True
    return False


def _unbounded_waits(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        owner = node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        hint = _OWNER_HINT.get(name)
        if hint and not (any(h in owner_name.lower() for h in hint) or (name == "get" and owner_name == "q")):
            continue
        if isinstance(owner, ast.Name) and owner.id == "subprocess" and name in _SUBPROCESS:
            bad = not any(k.arg == "timeout" for k in node.keywords)
        elif name in _ALWAYS_JUSTIFY:
            bad = True
        elif name in _NEEDS_TIMEOUT:
            if name == "get" and not node.args and not node.keywords:
                bad = True          # Queue.get(): forever
            elif name == "get":
                bad = not _has_timeout(node, name) and any(
                    k.arg == "block" for k in node.keywords)
            elif name == "wait_for":
                bad = len(node.args) < 2 and not any(k.arg == "timeout" for k in node.keywords)
            else:
                bad = not _has_timeout(node, name)
        else:
            continue
        if not bad:
            continue
        here = lines[node.lineno - 1]
        above = lines[node.lineno - 2] if node.lineno >= 2 else ""
        if "# bounded:" in here or above.strip().startswith("# bounded:"):
            continue
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        found.append(f"{where}:{node.lineno}: .{name}(…) without a timeout: {here.strip()}")
    return found


def test_every_wait_in_fleet_has_a_timeout() -> None:
    """Protects issue 23's rule: each subprocess, SSH command, channel read, thread join, queue
    get and event wait in fleet/ (flows/ and tasks/ too) has a timeout, or a `# bounded: why`
    comment on its line saying what bounds it (the allow-list). A new unbounded wait fails here."""
    files = sorted(p for d in ("fleet", "flows", "tasks") for p in (ROOT / d).rglob("*.py"))
    found = [f for p in files for f in _unbounded_waits(p)]
    assert not found, "waits without a timeout (add one, or `# bounded: why` on the line):\n" + "\n".join(found)


def test_the_static_scan_finds_unbounded_waits(tmp_path: Path) -> None:
    """The scan itself: it must flag each kind of unbounded wait and pass the bounded forms, or
    the check above could pass while it looks at nothing."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import subprocess, queue, threading\n"
        "def f(p, q, t, e, lock, chan, sel, d):\n"
        "    p.communicate()\n"                        # 3 bad
        "    p.communicate(timeout=5)\n"
        "    p.wait()\n"                               # 5 bad
        "    e.wait(1.0)\n"
        "    t.join()\n"                               # 7 bad
        "    ', '.join(x)\n"
        "    q.get()\n"                                # 9 bad
        "    d.get('k')\n"
        "    lock.acquire()\n"                         # 11 bad
        "    lock.acquire(timeout=3)\n"
        "    chan.recv(100)\n"                         # 13 bad
        "    chan.recv(100)  # bounded: after select\n"
        "    subprocess.run(['x'])\n"                  # 15 bad
        "    subprocess.run(['x'], timeout=1)\n"
        "    p.wait(timeout=None)\n"                   # 17 bad
        "    sel.select()\n"                           # 18 bad
        "    fut.result()\n"                           # 19 bad
        "    state.result()\n"
        "    ctx.get()\n"
        "    self._listener.accept()\n"               # 22 bad
    )
    found = _unbounded_waits(sample)
    assert [int(f.split(":")[1]) for f in found] == [3, 5, 7, 9, 11, 13, 15, 17, 18, 19, 22], found
