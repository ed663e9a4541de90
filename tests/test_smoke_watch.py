"""The smoke watches the server's process and log, as readiness does (fleet/smoke.py ServerWatch).

Real parts: sim server processes on 127.0.0.1, their log files, the local node's watch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import SmokeConfig
from fleet.engines import get_profile
from fleet.errors import ServerFailed
from fleet.node import LocalNode
from fleet.smoke import ServerWatch, smoke
from test_sim import FAST, Sim

SIM_CLASSIFY = get_profile("sim").classify


@pytest.fixture
def sims(tmp_path: Path):
    started: list[Sim] = []

    def start(*flags: str) -> Sim:
        sim = Sim(tmp_path, "--startup-s", "0", *FAST, *flags)
        started.append(sim)
        sim.wait_ready()
        return sim

    yield start
    for sim in started:
        sim.stop()


def watch_of(sim: Sim) -> ServerWatch:
    return ServerWatch.start(LocalNode(), sim.proc.pid, str(sim.log_path), SIM_CLASSIFY, index=1, port=sim.port)


def test_server_dying_on_its_first_request_fails_the_smoke_at_once_with_its_log(sims) -> None:
    """Fault: a server that dies on its first real request. The smoke used to retry the dead port
    ("RemoteProtocolError … Connection refused" × attempts, 16 s of backoff) and never said why;
    now the first failed attempt checks the process and the log and fails with the log's fatal
    line, the exit and the log tail, with no further attempt."""
    sim = sims("--crash-after", "1")
    cfg = SmokeConfig(first_timeout_s=30, timeout_s=30, attempts=4, backoff_s=30)  # exhausting would take minutes
    with pytest.raises(ServerFailed) as err:
        smoke(sim.url, "sim-model", cfg, node="local", index=1, watch=watch_of(sim))
    exc = err.value
    assert "server 1 on port" in exc.reason and "during the smoke" in exc.reason
    assert "Scheduler hit an exception" in exc.reason or f"process {sim.proc.pid} exited" in exc.reason
    assert "smoke failed after" not in exc.reason  # the attempts were not run out against a dead port
    assert "illegal memory access" in exc.stderr_tail  # the log's tail: the cause
    assert exc.remedy and str(sim.log_path) in exc.remedy


def test_fatal_log_line_while_a_request_hangs_fails_without_waiting_for_the_timeout(sims, tmp_path: Path) -> None:
    """Fault: the server's scheduler dies but its HTTP front end keeps the connection open (the
    request hangs). The watch runs while the request is in flight: the fatal line fails the smoke
    without waiting out smoke.first_timeout_s."""
    sim = sims("--hang-requests")
    real = watch_of(sim)
    calls = 0

    def watch() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # call 1 is before the attempt; call 2 is with the request in flight
            with open(sim.log_path, "a") as f:
                f.write("Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access\n")
        real()

    cfg = SmokeConfig(first_timeout_s=600, timeout_s=600, attempts=1)
    with pytest.raises(ServerFailed) as err:
        smoke(sim.url, "sim-model", cfg, node="local", index=1, watch=watch, watch_every_s=0.2)
    assert "fatal log line during the smoke" in err.value.reason
    assert "Scheduler hit an exception" in err.value.reason
    assert sim.proc.poll() is None  # alive all along: only the log told


def test_watch_reads_only_what_the_log_gained(sims) -> None:
    """A fatal line logged before the smoke began (e.g. an old crash in a relaunched server's
    appended log) is not blamed on this smoke: the watch starts at the log's current end."""
    sim = sims()
    with open(sim.log_path, "a") as f:
        f.write("Scheduler hit an exception: an old crash, before this smoke\n")
    res = smoke(sim.url, "sim-model", SmokeConfig(first_timeout_s=30, attempts=1), watch=watch_of(sim))
    assert res.ok and res.completion_tokens


def test_probes_of_plain_http_servers_load_no_ca_bundle_and_https_loads_it_once(sims, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: every HTTP client fleet made (each server's readiness poll, smoke, info fetch) built
    its own TLS context and loaded the CA bundle again, 30–50 ms of CPU each: 7 in a `fleet up` of
    two servers, 25 with eight, though the servers speak plain HTTP. Then one per process — still
    ≈ 65 ms of an adopt-only `fleet up` whose servers all speak plain HTTP, twice that when two
    threads asked first at once. Now a plain-http client gets a context with no CA loaded (one that
    would refuse every certificate), and an https one shares one context built once, however many
    threads ask at once (fleet/net.py tls_context); a spy counts the CA contexts built."""
    import ssl
    from concurrent.futures import ThreadPoolExecutor

    from fleet import net
    from fleet.smoke import fetch_server_info

    servers = [sims(), sims()]  # started first: their own readiness wait is not fleet's
    built: list[object] = []
    real = ssl.create_default_context

    def counting(*args: object, **kwargs: object) -> ssl.SSLContext:
        built.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    net._default_context.cache_clear()
    try:
        for sim in servers:
            assert sim.url.startswith("http://")
            assert smoke(sim.url, "sim-model", SmokeConfig(first_timeout_s=30, attempts=1)).ok
            fetch_server_info(sim.url)
        assert built == []   # plain HTTP: no CA bundle read
        unused = net.tls_context(servers[0].url)
        assert unused.verify_mode == ssl.CERT_REQUIRED and unused.check_hostname and unused.get_ca_certs() == []
        with ThreadPoolExecutor(8) as pool:   # eight first https callers at once
            contexts = list(pool.map(lambda _: net.tls_context("https://example.invalid/v1"), range(8)))
        assert len(built) == 1 and all(c is contexts[0] for c in contexts)
        assert net.tls_context() is contexts[0]   # URLs not known: the full context too
    finally:
        net._default_context.cache_clear()  # the next test builds its own, unspied


def test_cold_server_that_hangs_on_its_first_request_fails_on_no_sign_of_life_not_after_the_allowance(sims) -> None:
    """Fault (issue 23): a never-smoked server that accepts its first request and never answers
    (a deadlocked engine) held the bring-up for the whole first-request allowance (5 min by
    default, sized for CUDA graph capture). Now a server that, while that request waits, uses
    under a CPU-second and logs nothing for smoke.stall_s is failed then, saying so. The
    allowance here is 10 minutes: the smoke must end on the stall, not on the timeout."""
    sim = sims("--hang-requests")
    cfg = SmokeConfig(first_timeout_s=600, timeout_s=600, attempts=1, stall_s=3)
    with pytest.raises(ServerFailed) as err:
        smoke(sim.url, "sim-model", cfg, node="local", index=1, watch=watch_of(sim), watch_every_s=0.2)
    assert "no sign of life for" in err.value.reason and "not warming up" in err.value.reason, err.value.reason
    assert "600 s allowance" in err.value.reason and "timeout" not in err.value.reason
    assert sim.proc.poll() is None  # alive all along: only its silence told


def test_cold_server_slow_on_its_first_request_but_logging_keeps_its_allowance(sims) -> None:
    """The other side of the stall rule: a server warming up on its first request (here 8 s, with
    the scheduler's log lines coming as it works) is not hung, even though the request waits far
    longer than smoke.stall_s: it keeps its first-request allowance and passes."""
    sim = sims("--first-request-delay-s", "8", "--log-interval-s", "0.5")
    cfg = SmokeConfig(first_timeout_s=600, timeout_s=600, attempts=1, stall_s=3)
    res = smoke(sim.url, "sim-model", cfg, node="local", index=1, watch=watch_of(sim), watch_every_s=0.2)
    assert res.ok and res.latency_s is not None and res.latency_s > cfg.stall_s, res.timeline()


def test_a_stopped_process_of_the_servers_group_reads_as_stopped(tmp_path: Path) -> None:
    """Engines run several processes (SGLang's scheduler, vLLM's engine core) in the group their
    leader heads: one of them stopped (SIGSTOP) serves nothing, while the HTTP leader looks alive.
    The node's state check names the whole group stopped, so readiness and the smoke fail it at
    once; continued, it is alive again."""
    import os
    import signal
    import subprocess

    from conftest import wait_until

    lead = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > \"$0\"; wait", str(tmp_path / "child")],
                            start_new_session=True)
    node = LocalNode()
    try:
        wait_until(lambda: (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip(), timeout=30,
                   what="the group's child")
        child = int((tmp_path / "child").read_text())
        assert node.process_state(lead.pid) == "alive"
        os.kill(child, signal.SIGSTOP)
        wait_until(lambda: node.process_state(lead.pid) == "stopped", timeout=30, what="the group read as stopped")
        state, _, ticks = node.watch_cpu(lead.pid, str(tmp_path / "none.log"), 0)
        assert state == "stopped" and ticks is not None
        os.kill(child, signal.SIGCONT)
        wait_until(lambda: node.process_state(lead.pid) == "alive", timeout=30, what="alive once continued")
    finally:
        os.killpg(lead.pid, signal.SIGKILL)
        lead.wait(timeout=30)
