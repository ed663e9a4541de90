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
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=120,
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


# Every spelling of a flag fleet owns that each engine's own parser reads as that flag (issue 33,
# item 5), with the config field the refusal names. vLLM: FlexibleArgumentParser folds `_` into `-`
# in a `--name` (up to its first `.`, a dotted name is the flag with a JSON value), then argparse
# (unique prefixes, `=`). SGLang and the sim: plain argparse. transformers serve: click (exact names
# and `=` only).
OWNED_SPELLINGS: dict[str, list[tuple[list[str], str, str]]] = {
    "vllm": [
        (["--api_key", "sk-in-argv"], "--api-key", "servers.api_key"),
        (["--api-key=sk-in-argv"], "--api-key", "servers.api_key"),
        (["--api_k", "sk-in-argv"], "--api-key", "servers.api_key"),
        (["--api-key.x", "sk-in-argv"], "--api-key", "servers.api_key"),
        (["--served_model_name", "other"], "--served-model-name", "model.served_name"),
        (["--served-model_name=x"], "--served-model-name", "model.served_name"),
        (["--served_model", "other"], "--served-model-name", "model.served_name"),
        (["--tensor_parallel_size", "8"], "--tensor-parallel-size", "servers.tensor_parallel"),
        (["--tensor_parallel_size=8"], "--tensor-parallel-size", "servers.tensor_parallel"),
        (["--tensor-par", "8"], "--tensor-parallel-size", "servers.tensor_parallel"),
        (["-tp", "8"], "-tp", "servers.tensor_parallel"),
        (["-tp=8"], "-tp", "servers.tensor_parallel"),
        (["-t", "8"], "-tp", "servers.tensor_parallel"),
        (["--ho", "0.0.0.0"], "--host", "servers.host"),
        (["--po=1"], "--port", "servers.base_port"),
        (["--model=/x"], "--model", "model.source"),
    ],
    "sglang": [
        (["--host=0.0.0.0"], "--host", "servers.host"),
        (["--ho", "0.0.0.0"], "--host", "servers.host"),
        (["--por", "1"], "--port", "servers.base_port"),
        (["--api-k=x"], "--api-key", "servers.api_key"),
        (["--admin-api", "x"], "--admin-api-key", "servers.api_key"),
        (["--model-p", "/x"], "--model-path", "model.source"),
        (["--served-model", "x"], "--served-model-name", "model.served_name"),
        (["--tp-s=2"], "--tp-size", "servers.tensor_parallel"),
        (["--tensor-parallel=2"], "--tensor-parallel-size", "servers.tensor_parallel"),
    ],
    "sim": [
        (["--host=0.0.0.0"], "--host", "servers.host"),
        (["--hos", "0.0.0.0"], "--host", "servers.host"),
        (["--port=1"], "--port", "servers.base_port"),
        (["--api-k", "x"], "--api-key", "servers.api_key"),
        (["--model-n=x"], "--model-name", "model.served_name"),
        (["--model-pa", "/x"], "--model-path", "model.source"),
    ],
    "transformers": [
        (["--host", "0.0.0.0"], "--host", "servers.host"),
        (["--host=0.0.0.0"], "--host", "servers.host"),
        (["--port", "1"], "--port", "servers.base_port"),
        (["--port=1"], "--port", "servers.base_port"),
    ],
}


@pytest.mark.parametrize(("kind", "args", "flag", "field"),
                         [(k, *row) for k, rows in OWNED_SPELLINGS.items() for row in rows])
def test_every_spelling_of_an_owned_flag_each_engine_parses_is_refused(kind: str, args: list[str], flag: str,
                                                                       field: str) -> None:
    """`engine.extra_args = ["--api_key", "sk-in-argv"]` was accepted for vLLM: its parser folds `_`
    into `-`, so the key sat in argv and, coming last, won; `--served_model_name other` gave a model
    name the runner does not send. Every spelling the engine parses is refused, naming the flag and
    the setting to use, and never the value (a key)."""
    text = _config_error(engine={"kind": kind, "extra_args": ["--log-level", "info", *args]})
    assert "engine.extra_args" in text and flag in text and field in text, text
    assert "sk-in-argv" not in text and "\n" not in text


@pytest.mark.parametrize(("kind", "args"), [
    ("vllm", ["--max_num_seqs", "8", "--enable_prefix_caching", "--compilation-config.level", "3"]),
    ("sglang", ["--hostname-x", "--tokenizer-path", "/t", "--h", "x"]),
    ("transformers", ["--po", "1", "--port_x", "1", "--log-level", "info"]),   # click: no prefixes, no folding
    ("sim", ["--fail-rate", "0.1"]),
])
def test_spellings_no_engine_reads_as_an_owned_flag_pass(kind: str, args: list[str]) -> None:
    assert FleetConfig(engine={"kind": kind, "extra_args": args}).engine.extra_args == args


def test_the_spelling_tables_are_what_the_real_parsers_read() -> None:
    """The sim's own argparse parser and `transformers serve`'s click command (both installed) read
    every spelling of the table above as the flag it names (so the table is the parsers' rules,
    not a guess), and the click command refuses the prefixes fleet lets through for it."""
    from fleet.sim.options import build_parser

    dest = {"--host": "host", "--port": "port", "--api-key": "api_key", "--model-name": "model_name",
            "--model-path": "model_path"}
    for args, flag, _ in OWNED_SPELLINGS["sim"]:
        value = "7" if flag == "--port" else "x"
        argv = [a if "=" not in a else a.split("=")[0] + "=" + value for a in args]
        argv = argv if "=" in args[0] else [argv[0], value]
        ns = build_parser().parse_args(argv if flag == "--port" else [*argv, "--port", "1"])
        assert str(getattr(ns, dest[flag])) == value, (args, ns)
    pytest.importorskip("transformers.cli.serve")
    import click
    import typer

    from transformers.cli.transformers import app

    group = app if isinstance(app, click.Group) else typer.main.get_command(app)
    serve = group.commands["serve"]   # type: ignore[attr-defined]
    for args, flag, _ in OWNED_SPELLINGS["transformers"]:
        value = "7" if flag == "--port" else "127.0.0.9"
        argv = [f"{args[0].split('=')[0]}={value}"] if "=" in args[0] else [args[0], value]
        assert str(serve.make_context("serve", ["/m", *argv]).params[flag[2:]]) == value
    for bad in (["--po", "1"], ["--port_x", "1"]):
        with pytest.raises(click.NoSuchOption):
            serve.make_context("serve", ["/m", *bad])


def test_an_underscore_api_key_for_vllm_is_one_config_line_from_the_cli(tmp_path: Path) -> None:
    r = _fleet("status", "-c", _minimal(tmp_path),
               env={"FLEET_ENGINE__KIND": "vllm", "FLEET_ENGINE__EXTRA_ARGS": '["--api_key","sk-in-argv"]'})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "servers.api_key" in r.stderr and "sk-in-argv" not in r.stderr + r.stdout
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr


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
    import hashlib

    # named as fleet.jobs.job_dir names it: <fleet>-<10 hex of the output> (only those are a fleet's jobs)
    jdir = workdir / "jobs" / f"{fleet}-{hashlib.sha256(str(output).encode()).hexdigest()[:10]}"
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


# -- 2 + 3. no secret in argv, secrets typed and masked everywhere -----------------------------

class CmdlineWatcher:
    """Records the command line of every process that appears while it runs (polling /proc, so
    a process that lives less than one poll can slip by; the launch shells and servers live
    far longer). `seen` maps pid -> argv text."""

    def __init__(self) -> None:
        import threading

        self.before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in self.before:
                    continue
                try:
                    text = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if text:
                    self.seen[int(entry)] = text   # the last argv wins (an exec replaces it)
                    self.seen.setdefault(-int(entry), text)   # and the first one is kept too
            self._stop.wait(0.005)

    def __enter__(self) -> CmdlineWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _scan_tree(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            hits += [f"{p}: {n[:6]}…" for n in needles if n.encode() in data]
    return hits


def test_secrets_appear_nowhere_after_a_bringup_and_a_job(tmp_path: Path, prefect_api, capfd) -> None:
    """The key was in `ps` for the server's life; HF_TOKEN from engine.env was in the flow run's
    parameters, job.json, servers/*.json and manifest.json. With known secrets, a bring-up and a
    generation job (sim servers, the detached runner) then a teardown: every file under the
    workdir and the output, every artifact and the flow runs' parameters and logs read back
    through the Prefect API, the captured output, and the command line of every process started
    meanwhile hold neither secret. The servers did enforce the key (a request without it is 401)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    from flows.fleet import fleet
    from test_bringup import port_block, sim_config
    from test_generate_flow import prompts

    key, token = "sk-fleet-test-5b8e1c0d9a", "hf_testTOKEN_q2w3e4r5t6"
    base = port_block(2)
    cfg = sim_config(tmp_path, base, n=2, generation={"max_tokens": 16},
                     servers={"api_key": key},
                     engine={"env": {"HF_TOKEN": token, "NCCL_DEBUG": "WARN"}, "env_public": ["NCCL_DEBUG"]})
    inp = prompts(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out"
    runs = []
    try:
        with CmdlineWatcher() as watch:
            state = fleet(config=cfg, action="bringup", return_state=True)
            runs.append(state.state_details.flow_run_id)
            assert state.is_completed(), state.message
            r = httpx.post(f"http://127.0.0.1:{base}/v1/chat/completions", json={"model": "x", "messages": []})
            assert r.status_code == 401   # the key reached the server and is enforced
            state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
            runs.append(state.state_details.flow_run_id)
            res = state.result(raise_on_failure=False)
            assert state.is_completed(), res
            assert res["completed"] == 40
            # the processes hold the secrets where they belong: in their environment
            from fleet.node import LocalNode
            from fleet.servers import server_paths

            pid = LocalNode().read_pid(server_paths(cfg.nodes[0].workdir, cfg.name, 0).pid)
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert token.encode() in environ and b"NCCL_DEBUG=WARN" in environ
    finally:
        state = fleet(config=cfg, action="teardown", return_state=True)
        runs.append(state.state_details.flow_run_id)
    needles = [key, token]
    assert len(watch.seen) >= 4, watch.seen   # servers, launch shells, the runner at least
    leaked = {pid: cmd for pid, cmd in watch.seen.items() if any(n in cmd for n in needles)}
    assert not leaked, leaked
    work = Path(cfg.nodes[0].workdir)
    assert (work / "servers").is_dir() and (out / "manifest.json").exists()
    assert list(work.glob("jobs/*/job.json")), "no job.json to scan"
    assert not _scan_tree(work, needles) and not _scan_tree(out, needles)
    # records show what is not secret, mask what is
    rec = json.loads((work / "servers" / f"{cfg.name}-0.json").read_text())
    assert rec["env"]["NCCL_DEBUG"] == "WARN" and rec["env"]["HF_TOKEN"] == "**********"
    assert rec["env"]["FLEET_ENGINE_API_KEY"] == "**********"
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=runs)))
        assert len(flow_runs) == 3
        params = json.dumps([fr.parameters for fr in flow_runs], default=str)
        assert "HF_TOKEN" in params and not any(n in params for n in needles), params[:2000]
        arts = [a for fr in flow_runs for a in client.read_artifacts() if a.flow_run_id == fr.id]
        assert arts, "no artifacts to scan"
        art_text = json.dumps([[a.data, a.description, a.key] for a in arts], default=str)
        assert not any(n in art_text for n in needles)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=runs)))
        assert logs, "no logs to scan"
        assert not any(n in lg.message for lg in logs for n in needles)
    captured = capfd.readouterr()
    assert not any(n in captured.out + captured.err for n in needles)


def test_sglang_shim_hands_the_key_to_sglang_inside_the_process(tmp_path: Path) -> None:
    """SGLang reads its key only from --api-key. The argv fleet builds runs sglang's entry module
    through a shim that appends `--api-key KEY` to sys.argv from the environment: the module
    sees the key (and runs as __main__, as with `python -m`), /proc/self/cmdline never holds
    it, and the variable is gone before any worker could inherit it. (A stand-in sglang
    package records what it saw; real SGLang cannot be installed here.)"""
    from fleet.engines import ServerSpec, get_profile

    pkg = tmp_path / "pkg" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'name': __name__, 'env': 'FLEET_ENGINE_API_KEY' in os.environ,\n"
        "           'cmdline': open('/proc/self/cmdline', 'rb').read().decode()},\n"
        "          open(os.environ['SEEN'], 'w'))\n")
    key = "sk-shim-9d8c7b6a5f"
    cfg = FleetConfig(engine={"kind": "sglang"}, servers={"api_key": key})
    spec = ServerSpec(node="n", index=0, gpus=(), host="127.0.0.1", port=30123, model_path="/m", served_name="m",
                      python=sys.executable, workdir=str(tmp_path), api_key=key)
    profile = get_profile("sglang")
    argv = profile.argv(cfg, spec)
    assert not any(key in a for a in argv)
    env = {**os.environ, **profile.env(cfg, spec), "PYTHONPATH": str(tmp_path / "pkg"), "SEEN": str(tmp_path / "s")}
    subprocess.run(argv, env=env, check=True, timeout=60)
    seen = json.loads((tmp_path / "s").read_text())
    assert seen["name"] == "__main__" and not seen["env"]
    assert seen["argv"][-2:] == ["--api-key", key] and "--port" in seen["argv"]
    assert key not in seen["cmdline"] and "sglang.launch_server" in seen["cmdline"]


def test_detached_process_gets_its_env_from_a_file_never_from_argv(node: Node, tmp_path: Path) -> None:
    """start_detached passed env as `K=V` arguments of the launch shell: every value was in
    /proc/*/cmdline while it ran. Now it reaches the process through a 0600 file that the
    launch shell removes once read; over SSH the file's text travels on stdin."""
    secret = "tok-detached-4e5f6a7b"
    work = tmp_path / "w"
    det = node.start_detached(["sleep", "30"], log_path=str(work / "s.log"), pid_path=str(work / "s.pid"),
                              env={"HF_TOKEN": secret, "ODD": "a 'quoted' $value\nwith newline"}, cwd=str(tmp_path))
    try:
        assert secret.encode() not in Path(f"/proc/{det.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{det.pid}/environ").read_bytes().split(b"\0")
        assert f"HF_TOKEN={secret}".encode() in environ
        assert "ODD=a 'quoted' $value\nwith newline".encode() in environ
        assert not (work / "s.pid.env").exists()
        assert (work / "s.pid").stat().st_mode & 0o077 == 0
    finally:
        node.stop(det.pid, grace_s=1)


def test_write_text_never_follows_a_planted_symlink(node: Node, tmp_path: Path) -> None:
    """A symlink at servers/<name>.json.tmp made `fleet up` overwrite a root-owned 0600 file
    through it. Writes go through a fresh mktemp file and a rename: the planted link's target
    is untouched, and the file written is 0600."""
    target = tmp_path / "victim"
    target.write_text("original")
    d = tmp_path / "servers"
    d.mkdir(mode=0o700)
    (d / "r.json.tmp").symlink_to(target)
    (d / "r.json").symlink_to(target)
    node.write_text(str(d / "r.json"), "new")
    assert target.read_text() == "original"
    assert not (d / "r.json").is_symlink() and (d / "r.json").read_text() == "new"
    assert (d / "r.json").stat().st_mode & 0o777 == 0o600


def test_a_reused_pid_is_never_signalled_or_adopted(node: Node, tmp_path: Path) -> None:
    """A pid file outlives its process; the pid may be reused by anything. read_pid checks the
    recorded start time and the expected command line, so stop/adopt never touch the stranger."""
    work = tmp_path / "w"
    det = node.start_detached(["sh", "-c", "sleep 30", "x", "--port", "31999"], log_path=str(work / "a.log"),
                              pid_path=str(work / "a.pid"), cwd=str(tmp_path))
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        assert node.read_pid(str(work / "a.pid"), expect="--port 31999") == det.pid
        assert node.read_pid(str(work / "a.pid"), expect="--port 31998") is None   # another command line
        pid, start = (work / "a.pid").read_text().split()
        (work / "a.pid").write_text(f"{stranger.pid} {start}\n")   # the pid now names another process
        assert node.read_pid(str(work / "a.pid")) is None
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
        node.stop(det.pid, grace_s=1)


# -- 4. the workdir is ours or refused ------------------------------------------------------------

NOBODY = 65534


def test_default_workdir_is_per_user_never_a_shared_path() -> None:
    """The default was /tmp/fleet: whoever created it first owned every fleet's pid files."""
    wd = FleetConfig().nodes[0].workdir
    assert wd == str(Path.home() / ".cache" / "fleet") or wd.endswith("/fleet") and not wd.startswith("/tmp")
    ssh = FleetConfig(nodes=[{"kind": "ssh", "host": "h", "user": "alice"}]).nodes[0].workdir
    assert ssh == "/home/alice/.cache/fleet"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs chown (root)")


@needs_root
def test_planted_pid_file_in_another_users_workdir_is_refused_and_nothing_is_killed(node: Node, tmp_path: Path) -> None:
    """Another local user created the workdir first and planted servers/<name>.pid naming any
    process group: `fleet down` killed it. A workdir not owned by the connecting user is now
    refused before any record in it is read, and the process lives."""
    from fleet.servers import stop_servers

    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        work = tmp_path / "work"
        (work / "servers").mkdir(parents=True)
        (work / "servers" / "t-0.json").write_text(json.dumps({"index": 0, "port": 31000}))
        (work / "servers" / "t-0.pid").write_text(f"{victim.pid}\n")
        for p in (work, work / "servers"):
            os.chown(p, NOBODY, NOBODY)
        cfg = FleetConfig(name="t", nodes=[{"name": "n", "workdir": str(work)}])
        with pytest.raises(ConfigError) as info:
            stop_servers(node, cfg, cfg.nodes[0])
        assert f"belongs to uid {NOBODY}" in str(info.value) and "workdir" in str(info.value)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("where", ["workdir", "subdir", "parent"])
def test_workdir_writable_by_others_is_refused(node: Node, tmp_path: Path, where: str) -> None:
    """A workdir (or a directory under it) that group or others can write, or a parent anyone can
    write without the sticky bit, lets someone else plant or swap files: refused, naming it."""
    from fleet.workdir import ensure_workdir

    parent = tmp_path / "p"
    work = parent / "w w"
    (work / "servers").mkdir(parents=True, mode=0o700)
    os.chmod(parent, 0o755)
    os.chmod(work, 0o700)
    target = {"workdir": work, "subdir": work / "servers", "parent": parent}[where]
    os.chmod(target, 0o777 if where == "parent" else 0o770)
    with pytest.raises(ConfigError) as info:
        ensure_workdir(node, str(work))
    assert str(target) in str(info.value)
    os.chmod(target, 0o1777 if where == "parent" else 0o700)   # sticky parent (like /tmp) or fixed: fine
    assert ensure_workdir(node, str(work))


def test_fleet_creates_its_directories_0700_and_files_0600(node: Node, tmp_path: Path) -> None:
    """Every file fleet wrote was 0644 and every directory 0755: logs, records and job files
    readable by every user on the node."""
    from fleet.workdir import ensure_workdir

    os.chmod(tmp_path, 0o755)
    work = tmp_path / "a" / "b" / "work"
    assert ensure_workdir(node, str(work))
    for d in (tmp_path / "a", tmp_path / "a" / "b", work):
        assert d.stat().st_mode & 0o777 == 0o700, d
    node.write_text(str(work / "servers" / "r.json"), "{}")
    src = tmp_path / "script.py"
    src.write_text("print()")
    src.chmod(0o644)
    node.put(str(src), str(work / "bin" / "s.py"))
    det = node.start_detached(["sh", "-c", "echo hi; touch shared"], log_path=str(work / "servers" / "x.log"),
                              pid_path=str(work / "servers" / "x.pid"), cwd=str(tmp_path))
    from conftest import wait_until

    wait_until(lambda: (tmp_path / "shared").exists(), what="the detached command's own file")
    for f in ("servers/r.json", "bin/s.py", "servers/x.log", "servers/x.pid"):
        assert (work / f).stat().st_mode & 0o777 == 0o600, f
    for d in ("servers", "bin"):
        assert (work / d).stat().st_mode & 0o777 == 0o700, d
    # what the command itself writes (a job's output) follows the user's umask, not fleet's 077
    umask = os.umask(0o022)
    os.umask(umask)
    if umask & 0o044 == 0:   # a umask that lets others read (the usual 022)
        assert (tmp_path / "shared").stat().st_mode & 0o044, "the command ran under fleet's 077"
    node.stop(det.pid, grace_s=1)


def test_missing_workdir_is_not_created_by_status(node: Node, tmp_path: Path) -> None:
    """status/down on a node where fleet never ran: nothing recorded, nothing created."""
    from fleet.servers import records

    assert records(node, str(tmp_path / "never"), "t") == []
    assert not (tmp_path / "never").exists()


def test_a_config_read_back_masked_is_refused_not_used() -> None:
    """Flow-run parameters hold the config with its secrets masked. A run that took that JSON
    back as its config would have served with the key '**********' (or exported HF_TOKEN=
    '**********'): such a config is refused, saying where the secret must come from."""
    cfg = FleetConfig(servers={"host": "0.0.0.0", "api_key": "sk-real-1234567890"},
                      engine={"env": {"HF_TOKEN": "hf_real", "NCCL_DEBUG": "WARN"}, "env_public": ["NCCL_DEBUG"]})
    dumped = cfg.model_dump(mode="json")
    text = json.dumps(dumped)
    assert "sk-real" not in text and "hf_real" not in text and "WARN" not in text
    assert cfg.engine.shown_env() == {"HF_TOKEN": "**********", "NCCL_DEBUG": "WARN"}
    assert cfg.secrets() == ["sk-real-1234567890", "hf_real"]
    with pytest.raises(ConfigError) as info:
        from fleet.config import config_from_param

        config_from_param(dumped)
    assert "arrived masked" in str(info.value) and "sk-real" not in str(info.value)


def test_a_config_error_never_echoes_a_secret(tmp_path: Path) -> None:
    """pydantic's messages echo the input; a typo next to a key must not print the key."""
    p = tmp_path / "c.toml"
    p.write_text('[servers]\nhost = "0.0.0.0"\napi_key = ["sk-in-a-list-123"]\n[engine]\nenv = {HF_TOKEN = 5}\n')
    r = _fleet("status", "-c", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "sk-in-a-list-123" not in r.stderr and "servers.api_key" in r.stderr


@pytest.mark.ssh
def test_secrets_appear_nowhere_after_a_bringup_over_ssh(tmp_path: Path, sshd, prefect_api) -> None:
    """Over SSH the launch goes through sshd's `sh -c …` command strings and the env file through
    sftp/stdin: none of the processes started on the node (sshd sessions, shells, servers) ever
    holds the key or the token in its command line, and nothing written on the node does."""
    import httpx

    from flows.fleet import fleet
    from test_bringup import port_block, sim_config

    key, token = "sk-ssh-test-0c1d2e3f4a", "hf_sshTOKEN_z9y8x7"
    base = port_block(2)
    # a workdir with a space, a quote, a '*' and a leading '-' in a component: one path everywhere
    work = tmp_path / "-r w'o*rk"
    node = sshd.node_config(name="remote", workdir=str(work)).model_dump(mode="json")
    cfg = sim_config(tmp_path, base, n=2, node=node, servers={"api_key": key},
                     engine={"env": {"HF_TOKEN": token}})
    try:
        with CmdlineWatcher() as watch:
            state = fleet(config=cfg, action="bringup", return_state=True)
            assert state.is_completed(), state.message
            rows = state.result()
            r = httpx.get(f"http://127.0.0.1:{base}/v1/models")
            assert r.status_code == 401
            environ = Path(f"/proc/{rows[0]['pid']}/environ").read_bytes()
            assert f"HF_TOKEN={token}".encode() in environ.split(b"\0")
    finally:
        fleet(config=cfg, action="teardown", return_state=True)
    assert any("sshd" in c or "fleet-launch" in c for c in watch.seen.values()), "the watcher saw no session"
    leaked = {pid: cmd for pid, cmd in watch.seen.items() if key in cmd or token in cmd}
    assert not leaked, leaked
    assert (work / "servers" / "t-0.json").exists() and not _scan_tree(work, [key, token])


def test_fleet_config_block_masks_engine_env_in_the_api(prefect_api) -> None:
    """Prefect masks a SecretStr field but not the SecretStr values inside a dict: HF_TOKEN in a
    fleet-config block would show in clear in the UI and the API (the block keeps engine.env in
    a SecretDict of its own). Masked there; loading the block gives the real values back."""
    from prefect.client.orchestration import get_client

    from blocks.config import FleetConfigBlock

    cfg = FleetConfig(name="blk", servers={"api_key": "sk-blk-4444"},
                      engine={"env": {"HF_TOKEN": "hf_blk_5555", "NCCL_DEBUG": "WARN"}, "env_public": ["NCCL_DEBUG"]})
    FleetConfigBlock.of(cfg).save("blk-secrets", overwrite=True)
    with get_client(sync_client=True) as client:
        doc = client.read_block_document_by_name("blk-secrets", "fleet-config", include_secrets=False)
    shown = json.dumps(doc.data)
    assert "hf_blk_5555" not in shown and "sk-blk-4444" not in shown and "HF_TOKEN" in shown
    got = FleetConfigBlock.load("blk-secrets").fleet_config()
    assert got.api_key() == "sk-blk-4444" and got.engine.env_values()["HF_TOKEN"] == "hf_blk_5555"


def test_runner_gets_the_real_engine_env_back_for_a_relaunch(monkeypatch: pytest.MonkeyPatch) -> None:
    """job.json holds engine.env masked; a relaunch by the runner must still export the real
    HF_TOKEN, which the runner gets from its environment (FLEET_ENGINE_ENV), never from the file."""
    from fleet.generation.job.remote import runner_secret_env
    from fleet.generation.job.jobspec import fleet_config

    cfg = FleetConfig(servers={"api_key": "sk-run-1"}, engine={"env": {"HF_TOKEN": "hf_run_2"}})
    masked = json.loads(json.dumps(cfg.model_dump(mode="json")))
    assert masked["engine"]["env"]["HF_TOKEN"] == "**********"
    for k, v in runner_secret_env(cfg).items():
        monkeypatch.setenv(k, v)
    back = fleet_config(masked)
    assert back.api_key() == "sk-run-1" and back.engine.env_values() == {"HF_TOKEN": "hf_run_2"}


def test_an_endpoint_key_appears_nowhere_after_an_endpoints_only_job(tmp_path: Path, prefect_api, capfd,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint fleet did not start (`[[endpoints]]`, here a `fleet sim` the test runs with a
    key) takes its key from an environment variable where the flow runs; the runner needs it on
    its node. It must travel only through the detached runner's 0600 environment file: never in
    job.json, progress, the manifest, the rows, an artifact, a flow-run parameter or log, the
    captured output, or any command line. The flow's generate action also runs such a config
    with nothing to bring up (servers.count = 0: no server launched, no launch record)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    from flows.fleet import fleet
    from test_gen_endpoints import StandIn, prompts

    key = "sk-endpoint-8c1d4e7f20"
    monkeypatch.setenv("THEIR_ROUTER_KEY", key)
    standin = StandIn(tmp_path, "--tokens-per-s", "5000", "--model-name", "their-model", key=key)
    work = tmp_path / "work"
    cfg = FleetConfig(name="t", nodes=[{"name": "local", "workdir": str(work)}], engine={"kind": "sim"},
                      servers={"count": 0}, generation={"max_tokens": 16},
                      endpoints=[{"name": "router", "url": standin.url + "/v1", "api_key_env": "THEIR_ROUTER_KEY",
                                  "max_in_flight": 32}])
    inp, out = prompts(tmp_path / "in.jsonl", 60), tmp_path / "out"
    try:
        with CmdlineWatcher() as watch:
            standin.start()
            state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
            res = state.result(raise_on_failure=False)
            assert state.is_completed(), res
            assert (res["completed"], res["errors"]) == (60, 0)
    finally:
        standin.kill()
    assert not (work / "servers").exists() or not list((work / "servers").iterdir())   # nothing launched
    job = json.loads(next(work.glob("jobs/*/job.json")).read_text())
    assert [s.get("label") for s in job["servers"]] == ["endpoint/router"]
    assert job["servers"][0]["api_key_env"] == "ENDPOINT_API_KEY_0"
    leaked = {pid: cmd for pid, cmd in watch.seen.items() if key in cmd}
    assert any("fleet.generation.job.runner" in cmd for cmd in watch.seen.values()) and not leaked, leaked
    assert not _scan_tree(work, [key]) and not _scan_tree(out, [key])
    with get_client(sync_client=True) as client:
        run_id = state.state_details.flow_run_id
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        assert key not in json.dumps([fr.parameters for fr in runs], default=str)
        arts = [a for a in client.read_artifacts() if a.flow_run_id == run_id]
        assert arts and key not in json.dumps([[a.data, a.description, a.key] for a in arts], default=str)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        assert logs and not any(key in lg.message for lg in logs)
    captured = capfd.readouterr()
    assert key not in captured.out + captured.err


def test_store_credentials_reach_a_runner_only_through_its_env_file(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A job on object storage needs the store's credentials on every node. They could have ridden in
    job.json (a file on the node), in the runner's argv (`ps`), or in the store URL itself. start_job
    hands the variables of the controller's environment that the job's protocols name (AWS_* for s3://;
    HF_TOKEN, HF_ENDPOINT for hf://; for gs:// the content of the GOOGLE_APPLICATION_CREDENTIALS file,
    not its path) to start_detached's env (the 0600 file its launch shell removes, tested above), and
    job.json and argv name only URLs. A job gets no other protocol's secrets."""
    from fleet.generation.job.remote import start_job
    from fleet.node import LocalNode
    from test_objstore_nodes import service_account_file

    secret, hf_token = "aws-secret-9f8e7d6c5b", "hf_secTOKEN_1a2b3c4d5e"
    sa = tmp_path / "sa.json"
    key_line = service_account_file(sa, "http://127.0.0.1:9/token")
    for k, v in {"AWS_ACCESS_KEY_ID": "fleet-test", "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                 "HF_TOKEN": hf_token, "HF_ENDPOINT": "http://127.0.0.1:9", "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9",
                 "GOOGLE_APPLICATION_CREDENTIALS": str(sa)}.items():
        monkeypatch.setenv(k, v)   # every endpoint a dead loopback port: the runners started here reach nothing
    seen: list[tuple[list[str], dict[str, str]]] = []

    class Recording(LocalNode):   # the real local node; it only keeps what it was asked to start
        def start_detached(self, argv, **kw):  # type: ignore[no-untyped-def]
            seen.append((list(argv), dict(kw.get("env") or {})))
            return super().start_detached(argv, **kw)

    cfg = load_config(_minimal(tmp_path))
    node = Recording()
    h = start_job(node, cfg, cfg.nodes[0], input_path="s3://jobs/_inputs/chunk-00000.jsonl",
                  output=str(tmp_path / "out"), specs=[], store="s3://jobs/_parts/n/chunk-00000",
                  seed=["s3://jobs/_parts/m/chunk-00000"])
    node.stop(h.pid, grace_s=1)
    h2 = start_job(node, cfg, cfg.nodes[0], input_path="hf://datasets/u/d/in.jsonl", output=str(tmp_path / "out2"),
                   specs=[], store="gs://jobs/_parts/n/chunk-00000")
    node.stop(h2.pid, grace_s=1)
    job = Path(h.job_dir, "job.json").read_text() + Path(h2.job_dir, "job.json").read_text()
    assert json.loads(Path(h.job_dir, "job.json").read_text())["store"] == "s3://jobs/_parts/n/chunk-00000"
    assert not [s for s in (secret, hf_token, key_line, str(sa)) if s in job]
    (argv, env), (argv2, env2) = seen
    assert not [a for a in argv + argv2 if any(s in a for s in (secret, hf_token, key_line))]
    assert env["AWS_SECRET_ACCESS_KEY"] == secret and env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert not {"HF_TOKEN", "FLEET_GCS_CREDENTIALS_JSON", "STORAGE_EMULATOR_HOST"} & set(env)   # an s3:// job
    assert env2["HF_TOKEN"] == hf_token and key_line in env2["FLEET_GCS_CREDENTIALS_JSON"]
    assert not {"AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"} & set(env2)   # hf:// in, gs:// out


@pytest.mark.parametrize("content", ["export A='1'\nif then\n", "export A='1'\nexit 3\n"], ids=["syntax-error", "exits"])
def test_an_env_file_the_launch_shell_fails_on_is_removed_all_the_same(tmp_path: Path, content: str) -> None:
    """Fault: the launch shell removed its 0600 env file (API keys, store credentials) only after
    sourcing it: a file it failed on (`. file || exit 96`; a POSIX shell also exits at once on an
    error inside a dot script) stayed on the node with its secrets. Now it is unlinked as soon as
    it is opened, before a line of it is read; the launch fails and starts nothing."""
    from fleet.node.scripts import LAUNCH

    envfile, pidfile, log = tmp_path / "p.pid.env", tmp_path / "p.pid", tmp_path / "p.log"
    envfile.write_text(content + "export SECRET='sk-left-behind'\n")
    envfile.chmod(0o600)
    r = subprocess.run(["sh", "-c", LAUNCH, "fleet-launch", str(pidfile), str(log), str(tmp_path), str(envfile),
                        "--", "sh", "-c", f"echo started > {tmp_path / 'ran'}"], capture_output=True, timeout=30)
    assert r.returncode != 0
    assert not envfile.exists() and not (tmp_path / "ran").exists() and not pidfile.exists()
