"""One behaviour suite for the node seam, run against every transport (`node` fixture:
local subprocess and SSH to a real sshd). Both must behave the same: that is what lets
the rest of fleet ignore which one it holds."""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import wait_until
from fleet.errors import CommandFailed, CommandNotFound, CommandTimeout
from fleet.node import Node
from fleet.node.ssh import SSHNode


def test_run_returns_exit_code_and_output(node: Node) -> None:
    ok = node.run(["sh", "-c", "echo out; echo err >&2"])
    assert (ok.exit_code, ok.stdout, ok.stderr, ok.ok) == (0, "out\n", "err\n", True)
    assert ok.seconds >= 0

    res = node.run(["sh", "-c", "echo out; echo boom >&2; exit 3"], check=False)
    assert (res.exit_code, res.stdout, res.stderr, res.ok) == (3, "out\n", "boom\n", False)


def test_nonzero_exit_raises_with_host_command_and_stderr(node: Node) -> None:
    with pytest.raises(CommandFailed) as info:
        node.run(["sh", "-c", "echo boom >&2; exit 3"])
    err = info.value
    assert err.exit_code == 3 and not err.transient
    text = str(err)
    assert node.host in text and "exit code 3" in text and "boom" in text and "remedy:" in text


def test_argv_passes_through_literally(node: Node, tmp_path: Path) -> None:
    """Protects against shell injection: each argv item arrives as exactly one argument."""
    marker = tmp_path / "injected"
    args = ["a b", "it's", 'say "hi"', "$HOME", "a;b", "`id`", f"$(touch {marker})", f"; touch {marker}",
            "*", "", "back\\slash", "new\nline", "ünï", "--help"]
    res = node.run(["printf", "%s\\0", *args])
    assert res.stdout.split("\0")[:-1] == args
    assert not marker.exists()


def test_env_is_passed(node: Node) -> None:
    res = node.run(["sh", "-c", 'printf "%s|%s" "$FLEET_A" "$FLEET_B"'], env={"FLEET_A": "x y $z", "FLEET_B": "2"})
    assert res.stdout == "x y $z|2"


def test_input_is_passed_and_large_output_does_not_deadlock(node: Node) -> None:
    text = "hello\nwörld\n" * 50_000  # ~650 kB: more than any pipe or SSH window holds
    assert node.run(["cat"], input=text).stdout == text
    # Both pipes full at once: a reader that drains them one after the other would stall.
    res = node.run(["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' o; head -c 3000000 /dev/zero | tr '\\0' e >&2"])
    assert (len(res.stdout), len(res.stderr)) == (3_000_000, 3_000_000)


def test_stdin_is_closed_when_no_input(node: Node) -> None:
    """A command reading stdin must see EOF at once, not hang until the timeout."""
    assert node.run(["cat"], timeout=10).stdout == ""


def test_concurrent_runs_on_one_node(node: Node) -> None:
    """Parallel launches share one node object; sshd refuses more than 10 sessions per
    connection by default, so the SSH node must queue rather than fail."""
    with ThreadPoolExecutor(14) as pool:
        outs = list(pool.map(lambda i: node.run(["sh", "-c", f"sleep 0.2; echo {i}"]).stdout, range(14)))
    assert outs == [f"{i}\n" for i in range(14)]


def test_a_thousand_quick_commands_at_once_on_one_connection_all_succeed(node: Node, tmp_path: Path) -> None:
    """Quick commands from many threads, as a node's parallel stages send them. Over SSH two faults
    showed (once the test sshd stopped running this machine's ~/.bashrc per command and commands
    took milliseconds): sshd refuses a channel while it is still closing an earlier session ("no
    more sessions"), and the seam then took the connection for dead (paramiko leaves the refusal in
    `saved_exception`) and replaced it, failing every command running on it; and a lone EOF sent
    after paramiko's thread had sent the CLOSE of a command already ended made sshd drop the whole
    connection ("ieof packet referred to nonexistent channel"). ~3 % of 3,000 commands failed."""
    transport = getattr(node, "connect", lambda: None)()

    def one(i: int) -> str:
        if i % 10 == 0:
            node.write_text(str(tmp_path / f"w{i % 40}"), str(i))
        return node.run(["sh", "-c", f"echo {i}"]).stdout

    with ThreadPoolExecutor(14) as pool:
        outs = list(pool.map(one, range(1200)))
    assert outs == [f"{i}\n" for i in range(1200)]
    if transport is not None:   # the one connection served them all: none was taken for dead
        assert node.connect() is transport


def test_command_not_found(node: Node) -> None:
    with pytest.raises(CommandNotFound) as info:
        node.run(["fleet-no-such-command", "x"])
    assert info.value.exit_code == 127 and "fleet-no-such-command" in str(info.value)
    assert node.run(["fleet-no-such-command"], check=False).exit_code == 127


def test_timeout_raises_quickly_and_kills_the_command(node: Node, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f'echo $$ > {pids}.tmp; sleep 60 & echo $! >> {pids}.tmp; mv {pids}.tmp {pids}; wait'
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        node.run(["sh", "-c", script], timeout=1)
    assert time.monotonic() - t0 < 30   # the command would run 60 s; a busy machine is slow, not that slow
    assert info.value.transient
    shell, child = (int(p) for p in pids.read_text().split())
    wait_until(lambda: not node.is_alive(shell) and not node.is_alive(child), timeout=30,
               what="the timed-out command and its child to be gone")


def test_stream_yields_lines_as_they_come(node: Node, tmp_path: Path) -> None:
    """The first line must arrive while the command still runs: it waits for a file that
    the test creates only after it has seen that line."""
    gate = tmp_path / "gate"
    script = f'echo first; while [ ! -e {gate} ]; do sleep 0.02; done; echo second; echo third >&2'
    lines = node.stream(["sh", "-c", script], timeout=30)
    assert next(lines) == "first"
    gate.touch()
    assert list(lines) == ["second", "third"]


def test_stream_raises_on_nonzero_exit(node: Node) -> None:
    seen: list[str] = []
    with pytest.raises(CommandFailed) as info:
        for line in node.stream(["sh", "-c", "echo partial; echo why >&2; exit 4"], timeout=30):
            seen.append(line)
    assert seen == ["partial", "why"]
    assert info.value.exit_code == 4 and "why" in str(info.value)


def test_put_get_round_trip_binary(node: Node, tmp_path: Path) -> None:
    data = bytes(range(256)) * 512 + os.urandom(300_000)
    src, back = tmp_path / "src.bin", tmp_path / "back" / "copy.bin"
    src.write_bytes(data)
    remote = str(tmp_path / "remote" / "deep" / "blob.bin")  # parents do not exist yet
    node.put(src, remote)
    node.get(remote, back)
    assert back.read_bytes() == data
    assert node.exists(remote)


def _detached_script(child_file: Path) -> list[str]:
    # The detached shell spawns a child, so stop() must take down the whole group.
    return ["sh", "-c", f'echo started; sleep 300 & echo $! > {child_file}; wait']


def test_start_detached_outlives_connection_and_stop_kills_group(node: Node, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    log, pidf, childf = tmp_path / "logs" / "d.log", tmp_path / "run" / "d.pid", tmp_path / "child.pid"
    d = node.start_detached(_detached_script(childf), log_path=str(log), pid_path=str(pidf), cwd=str(tmp_path))
    assert node.read_pid(str(pidf)) == d.pid and d.pgid == d.pid
    wait_until(lambda: "started" in node.read_text(str(log)), what="the detached process to log")
    child = int(wait_until(lambda: childf.exists() and childf.read_text().strip(), what="the child pid"))
    assert node.is_alive(d.pid) and node.is_alive(child)

    if isinstance(node, SSHNode):
        # The process must not depend on the connection that started it.
        node.close()
        node = SSHNode.from_config(request.getfixturevalue("sshd").node_config())
        request.addfinalizer(node.close)
        assert node.is_alive(d.pid) and node.is_alive(child)

    res = node.stop(d.pid, grace_s=5)
    assert res.was_running and not res.killed
    assert not node.is_alive(d.pid) and not node.is_alive(child)
    assert not node.stop(d.pid, grace_s=1).was_running


def test_stop_kills_a_process_that_ignores_sigterm(node: Node, tmp_path: Path) -> None:
    log, pidf = tmp_path / "stubborn.log", tmp_path / "stubborn.pid"
    script = 'trap "" TERM; echo ready; while :; do sleep 0.1; done'
    d = node.start_detached(["sh", "-c", script], log_path=str(log), pid_path=str(pidf))
    wait_until(lambda: "ready" in node.read_text(str(log)), what="the TERM trap to be set")
    res = node.stop(d.pid, grace_s=1)
    assert res.was_running and res.killed
    wait_until(lambda: not node.is_alive(d.pid), timeout=30, what="the stubborn process to die")


# -- port forwarding --------------------------------------------------------------------------

class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like real inference clients
    disable_nagle_algorithm = True  # headers and body go out in two writes

    def do_GET(self) -> None:
        body = f"path={self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _get_fresh(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog of 5 drops SYNs from a burst of clients (1 s retries)


@pytest.fixture
def http_server() -> Iterator[int]:
    server = _Server(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_forward_port_serves_many_concurrent_requests(node: Node, http_server: int) -> None:
    with node.forward_port(http_server) as fwd:
        base = f"http://127.0.0.1:{fwd.local_port}"
        assert httpx.get(f"{base}/one").text == "path=/one"
        # A keep-alive pool of 32 connections, as the generation runner would hold.
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        with httpx.Client(base_url=base, limits=limits, timeout=20) as client, ThreadPoolExecutor(32) as pool:
            bodies = list(pool.map(lambda i: client.get(f"/r{i}").text, range(200)))
        assert bodies == [f"path=/r{i}" for i in range(200)]
        # Fresh connections too (no pooling): every accept opens a new tunnel.
        with ThreadPoolExecutor(16) as pool:
            fresh = list(pool.map(lambda i: _get_fresh(fwd.local_port, f"/f{i}"), range(48)))
        assert fresh == [f"path=/f{i}" for i in range(48)]
    if isinstance(node, SSHNode):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", fwd.local_port), timeout=2).close()
