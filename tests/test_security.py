"""Safe on a shared or public node (issue 11): each test names the attack it stops.

Real parts: the conftest sshd, the local and SSH nodes, the Prefect test server for the flow-level
checks, the `fleet` CLI as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.config import FleetConfig, load_config
from fleet.errors import ConfigError, HostKeyError
from fleet.node import Node

ROOT = Path(__file__).parent.parent


def _fleet(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=cwd or ROOT)


def _minimal(tmp_path: Path) -> str:
    p = tmp_path / "min.toml"
    p.write_text(f'[[nodes]]\nname = "n"\nworkdir = "{tmp_path}/w"\n')
    return str(p)


def _config_error(**kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, **kw)
    return str(info.value)


# -- 1. binding -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_public_bind_with_an_empty_key_is_refused(key: str) -> None:
    """`FLEET_SERVERS__HOST=0.0.0.0 FLEET_SERVERS__API_KEY= fleet up` started a server open to
    anyone: the guard checked `is None`, the launch treated "" as no key. Blank is no key."""
    text = _config_error(servers={"host": "0.0.0.0", "api_key": key})
    assert "servers.api_key" in text and "0.0.0.0" in text


def test_public_bind_with_an_empty_key_from_the_environment_is_refused(tmp_path: Path) -> None:
    """The exact command of the report: env vars, empty key, exit 2, one clear message."""
    r = _fleet("status", "-c", _minimal(tmp_path), env={"FLEET_SERVERS__HOST": "0.0.0.0", "FLEET_SERVERS__API_KEY": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "without an API key" in r.stderr and "servers.api_key" in r.stderr


def test_public_bind_with_a_key_and_loopback_without_one_are_accepted() -> None:
    assert FleetConfig(servers={"host": "0.0.0.0", "api_key": "k" * 20}).api_key() == "k" * 20
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert FleetConfig(servers={"host": host}).api_key() is None
    # a blank key on loopback is simply no key (never an empty --api-key)
    assert FleetConfig(servers={"api_key": " "}).api_key() is None


@pytest.mark.parametrize(("kind", "args", "flag", "field"), [
    ("sglang", ["--host", "0.0.0.0"], "--host", "servers.host"),
    ("sglang", ["--host=0.0.0.0"], "--host", "servers.host"),
    ("sglang", ["--ho", "0.0.0.0"], "--host", "servers.host"),           # argparse prefix
    ("sglang", ["--port=1"], "--port", "servers.base_port"),
    ("sglang", ["--api-key", ""], "--api-key", "servers.api_key"),
    ("sglang", ["--model", "/x"], "--model", "model.source"),
    ("sglang", ["--model-path=/x"], "--model-path", "model.source"),
    ("sglang", ["--tp", "2"], "--tp", "servers.tensor_parallel"),
    ("sglang", ["--tensor-parallel-size=2"], "--tensor-parallel-size", "servers.tensor_parallel"),
    ("vllm", ["-tp", "2"], "-tp", "servers.tensor_parallel"),
    ("vllm", ["--api-key=x"], "--api-key", "servers.api_key"),
    ("vllm", ["--model=/x"], "--model", "model.source"),
    ("transformers", ["--host", "0.0.0.0"], "--host", "servers.host"),
    ("sim", ["--api-key="], "--api-key", "servers.api_key"),
])
def test_extra_args_may_not_set_what_fleet_owns(kind: str, args: list[str], flag: str, field: str) -> None:
    """`FLEET_ENGINE__EXTRA_ARGS='["--host","0.0.0.0"]'` bound 0.0.0.0 without a key: argparse
    lets the later flag win. Refused, naming the flag and the config field to use instead."""
    text = _config_error(engine={"kind": kind, "extra_args": ["--log-level", "info", *args]})
    assert "engine.extra_args" in text and flag in text and field in text
    text = _config_error(engine={"kind": kind}, servers={"extra_args_by_index": {1: args}})
    assert "servers.extra_args_by_index[1]" in text and field in text


def test_extra_args_that_fleet_does_not_own_pass() -> None:
    cfg = FleetConfig(engine={"kind": "sglang", "extra_args": [
        "--mem-fraction-static", "0.8", "--model-loader-extra-config={}", "--tokenizer-path", "/t", "--hostname-x"]})
    assert "--tokenizer-path" in cfg.engine.extra_args


def test_extra_args_host_from_the_environment_is_refused_by_the_cli(tmp_path: Path) -> None:
    r = _fleet("status", "-c", _minimal(tmp_path), env={"FLEET_ENGINE__EXTRA_ARGS": '["--host","0.0.0.0"]'})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "servers.host" in r.stderr


# -- 5. argument hygiene ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["/tmp/a\nb", "/tmp/a\x00b", "/tmp/\x1b[31m"])
def test_control_characters_in_paths_are_refused(bad: str) -> None:
    """A newline in the workdir made `status`/`down` say "no servers recorded" and exit 0 with
    servers running. Control characters never reach a node: the config is refused."""
    for kw, key in ((dict(nodes=[{"workdir": bad}]), "workdir"), (dict(model={"source": bad}), "model.source"),
                    (dict(venv={"path": bad}), "venv.path"), (dict(nodes=[{"ramdisk": bad}]), "ramdisk")):
        text = _config_error(**kw)
        assert key in text and "control character" in text


def test_control_character_in_workdir_is_one_clear_cli_line(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[[nodes]]\nname = "n"\nworkdir = "/tmp/x\\ny"\n')
    r = _fleet("status", "-c", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nodes.0.workdir" in r.stderr and "control character" in r.stderr


def test_node_paths_must_be_absolute() -> None:
    """A relative workdir starting with '-' would be an option to find/rm on the node."""
    assert "absolute" in _config_error(nodes=[{"workdir": "-rf"}])


ODD_NAMES = ["with space", "star *", "it's \"quoted\"", "-dash", "glob ?[a]"]


@pytest.mark.parametrize("odd", ODD_NAMES)
def test_preflight_paths_with_spaces_globs_quotes_and_dashes(node: Node, tmp_path: Path, odd: str) -> None:
    """`for pair in $roles` split '/models/with space' in two and globbed '*': preflight failed on a
    directory that exists. Each path is now one positional argument, over SSH as locally."""
    from fleet.preflight import gather

    base = tmp_path / odd
    for d in ("work", "model", "venv"):
        (base / d).mkdir(parents=True)
    (base / "model" / "config.json").write_text("{}")
    # decoys a word-split or glob would hit
    (tmp_path / "with").mkdir()
    cfg = FleetConfig(nodes=[{"name": "n", "workdir": str(base / "work"), "ramdisk": str(base)}],
                      model={"source": str(base / "model"), "stage": False}, venv={"path": str(base / "venv")})
    report = gather(node, cfg, cfg.nodes[0])
    assert report.reachable, report.error
    for role, path in (("workdir", base / "work"), ("model_source", base / "model"), ("venv", base / "venv")):
        info = report.path(role)
        assert info is not None and info.path == str(path) and info.exists, (role, info)
    assert (report.path("model_source").size_bytes or 0) >= 2   # du of the one directory, not of nothing


def _fake_job(workdir: Path, fleet: str, output: Path) -> None:
    jdir = workdir / "jobs" / f"{fleet}-abc"
    jdir.mkdir(parents=True)
    (jdir / "job.json").write_text(json.dumps({"output": str(output), "servers": []}))
    output.mkdir(parents=True)
    (output / "manifest.json").write_text("{}")
    (output / "shard-0.parquet").write_bytes(b"x")


@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def test_fetch_remote_cannot_inject_options_or_leave_the_job_output(kind: str, tmp_path: Path, request) -> None:
    """`fleet fetch --remote=-delete` became `find -delete` and wiped the remote user's current
    directory. --remote must be an absolute path inside a job's output; anything else is refused
    before anything runs, and nothing is deleted."""
    work, out = tmp_path / "work dir", tmp_path / "out *"
    _fake_job(work, "t", out)
    victim = tmp_path / "cwd"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    node = {"name": "n", "workdir": str(work)}
    if kind == "ssh":
        sshd = request.getfixturevalue("sshd")
        node.update(kind="ssh", host=sshd.host, port=sshd.port, user=sshd.user, key_file=str(sshd.key_file),
                    host_key=sshd.host_key)
    cfgp = tmp_path / "f.toml"
    cfgp.write_text(f"name = \"t\"\n[[nodes]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in node.items()))
    for bad in ("-delete", "relative/dir", "/etc", str(out.parent), f"{out}/../..", f"{out}x"):
        r = _fleet("fetch", "-c", str(cfgp), f"--remote={bad}", "--output", str(tmp_path / "dl"), cwd=victim)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "fleet: config error: --remote" in r.stderr, r.stderr
    assert (victim / "precious").read_text() == "keep" and (out / "manifest.json").exists()
    assert not (tmp_path / "dl").exists()
    r = _fleet("fetch", "-c", str(cfgp), f"--remote={out}", "--output", str(tmp_path / "dl"), cwd=victim)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["manifest.json", "shard-0.parquet"]
    # no --remote: the newest job's output (found without word-splitting the workdir with a space)
    r = _fleet("fetch", "-c", str(cfgp), "--output", str(tmp_path / "dl2"), cwd=victim)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "dl2" / "manifest.json").exists()


# -- 6. host keys ------------------------------------------------------------------------------

@pytest.mark.ssh
def test_changed_host_key_is_fatal_in_preflight_not_unreachable(sshd, tmp_path: Path) -> None:
    """`fleet up` re-wrapped HostKeyError as a transient NodeUnreachable and tried three times.
    gather() now raises it as it is (fatal: Prefect's retry condition never retries it)."""
    from fleet.node import connect
    from fleet.preflight import gather

    wrong = Path(f"{sshd.unauthorized_key}.pub").read_text().strip()
    cfg = FleetConfig(nodes=[sshd.node_config(host_key=wrong, workdir=str(tmp_path / "w")).model_dump()])
    with connect(cfg.nodes[0]) as node, pytest.raises(HostKeyError) as info:
        gather(node, cfg, cfg.nodes[0])
    assert not info.value.transient and "does not match" in str(info.value)


@pytest.mark.ssh
def test_changed_host_key_fails_the_provision_task_once(sshd, tmp_path: Path, prefect_api) -> None:
    """The provision task ends on the HostKeyError after one run: no retry, no second handshake."""
    from prefect import flow

    from tasks.bringup import provision

    wrong = Path(f"{sshd.unauthorized_key}.pub").read_text().strip()
    cfg = FleetConfig(name="hk", nodes=[sshd.node_config(host_key=wrong, workdir=str(tmp_path / "w")).model_dump()])

    seen: list = []

    @flow
    def one() -> None:
        fut = provision.submit(cfg, cfg.nodes[0].name)
        fut.wait()
        seen.append(fut.task_run_id)

    one(return_state=True)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        tr = client.read_task_run(seen[0])
    assert tr.state.is_failed() and "HostKeyError" in (tr.state.message or "")
    assert tr.run_count == 1
