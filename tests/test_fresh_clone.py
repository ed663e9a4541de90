"""README's three ways to run fleet from Prefect, walked as written on a fresh `git clone` of this
repository in a new temporary directory: `fleet deploy` (with a process worker), the YAML recipe (with
the same worker command) and `python -m flows.serve` — each bringup, generate and teardown run must end
Completed, the job's rows exactly once.

Why a clone: a deployment that finds its code only by accident (an entrypoint relative to the
directory it was registered from, `path: '.'`, the worker's CWD) passes where it was written and
crashes on a new machine: Prefect's process worker runs each flow run in a fresh temporary directory.

Which code runs: the clone shares this test run's venv (no second install), whose `fleet` package is
installed (editable) from another checkout. PYTHONPATH puts the clone first, so `fleet`, `prefect
worker start`, `flows.serve` and every flow run import the clone's code (`clone` proves it before
any test); the deployments' pull step names the clone, and the configs the recipes read by relative
path exist only in the clone (under another fleet name than the checkout's own file). The clone is of
the checkout's HEAD: uncommitted changes are not in it.

Real parts: `prefect server start`, a process worker from an unrelated directory, sim servers, the CLI as
README types it. Each walk has its own clone and server (and, for the two pool recipes, its own worker):
the three run side by side on three test workers, not one after the other on one (≈ 15 min at load 12);
and none depends on what another left on a shared server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import compile_sources, free_port, port_block, seed_prefect_home
from conftest import wait_until as poll
from test_deployments import stop_group
from test_generate_flow import prompts, shard_ids

# Three flow runs through a worker or `serve`, each a fresh Python process, after a server (and a worker)
# start: ≈ 2–5 min a test at load 12 on 2 cores, past the default 300 s.
pytestmark = [pytest.mark.prefect, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent   # the test run's venv (not resolved: a venv's python is a link)
ACTIONS = ("bringup", "revalidate", "generate", "teardown")
ROWS = 40
# A wait on the Prefect server asks it every half second, not every 20 ms (wait_until's default): each
# request costs the server and this process CPU that the suite's other tests are waiting for.
API_POLL_S = 0.5


def readme_block(heading: str) -> list[str]:
    """The commands of the indented block under README's `heading`, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text.split(heading, 1)[1]
    block = re.search(r"\n\n((?:    .*\n)+)", section)
    assert block, f"no indented command block under {heading!r}"
    return [re.split(r"\s+#\s", ln.strip(), maxsplit=1)[0].strip() for ln in block.group(1).splitlines()]


README_DEPLOY = [
    "./dev.sh setup && . .venv/bin/activate",
    "PREFECT_SERVER_ANALYTICS_ENABLED=false prefect server start",
    "export PREFECT_API_URL=http://127.0.0.1:4200/api",
    "fleet deploy -c deployments/configs/ssh-sglang.toml",
    "prefect worker start --pool fleet-pool",
    "prefect deployment run fleet/bringup-b200 --watch",
    "prefect deployment run fleet/generate-b200 --param input=/data/prompts.jsonl --param output=/data/out --watch",
    "prefect deployment run fleet/teardown-b200 --param free_ramdisk=true --watch",
]
README_YAML = [
    "prefect work-pool create fleet-pool --type process",
    "prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml",
    "prefect deployment run fleet/bringup --param config=deployments/configs/local-sim.toml --watch",
]
README_SERVE = ["python -m flows.serve --config deployments/configs/local-sim.toml"]


@dataclass
class Clone:
    """A fresh clone, its shell environment (the venv activated, PREFECT_API_URL exported) and its Prefect
    server; `sh` runs one README line there."""

    root: Path
    tmp: Path
    env: dict[str, str]
    procs: list[tuple[subprocess.Popen, int]] = field(default_factory=list)   # (background process, SIGINTs)

    def sh(self, line: str, *, timeout: float = 240, check: bool = True, **subst: str) -> subprocess.CompletedProcess:
        argv, env = self.argv(line, **subst)
        res = subprocess.run(argv, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            pytest.fail(f"`{line}` exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def argv(self, line: str, **subst: str) -> tuple[list[str], dict[str, str]]:
        """The line's words (README's placeholders replaced: `subst`, then the server's port), and its
        environment (leading VAR=value words go there, as in a shell)."""
        for old, new in subst.items():
            line = line.replace(old, new)
        words = shlex.split(line.replace("127.0.0.1:4200", self.env["PREFECT_API_URL"].split("//")[1][:-4]))
        env = dict(self.env)
        while "=" in words[0]:
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        return words, env

    def api(self, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.env["PREFECT_API_URL"] + path
        r = httpx.post(url, json=body, timeout=30) if body is not None else httpx.get(url, timeout=30)
        r.raise_for_status()
        return r.json()

    def run(self, line: str, **subst: str) -> dict[str, Any]:
        """`prefect deployment run … --watch` as README types it: the flow run, which must be Completed."""
        res = self.sh(line, check=False, **subst)
        m = re.search(r"UUID: ([0-9a-f-]{36})", res.stdout)
        assert m, f"no flow run id in:\n{res.stdout}\n{res.stderr}"
        fr = self.api(f"/flow_runs/{m.group(1)}")
        print(f"\n{line.split()[3]}: {fr['name']} {fr['state']['type']} {fr['state']['message']!r}")
        worker = self.tmp / "worker.log"
        assert res.returncode == 0 and fr["state"]["type"] == "COMPLETED", (
            fr["state"], res.stdout[-2000:], worker.read_text()[-3000:] if worker.exists() else "")
        return fr


def sim_fleet(c: Clone, rel: str, name: str) -> dict[str, Any]:
    """Write a sim fleet named `name` over the clone's `rel` (that file holds a GPU fleet or the checkout's
    own local-sim fleet: the runs' names say which file was read, and from where); its data."""
    from fleet.demo import to_toml

    home = c.tmp / name
    model = home / "models" / "sim-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"w" * 50_000)
    (home / "ram").mkdir()
    data = {
        "name": name,
        "nodes": [{"name": "local", "workdir": str(home / "work"), "ramdisk": str(home / "ram")}],
        "engine": {"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 5000}},
        "model": {"source": str(model), "stage_margin_gb": 0.0},
        "venv": {"path": str(home / "venv")},
        "servers": {"count": 2, "base_port": port_block(2), "ready_timeout_s": 60, "stop_grace_s": 2},
        "smoke": {"first_timeout_s": 10, "timeout_s": 3, "attempts": 2, "backoff_s": 0.1},
        "generation": {"max_tokens": 16},
    }
    (c.root / rel).write_text(to_toml(data))
    return data


def start(c: Clone, line: str, *, cwd: Path, log: str, sigints: int) -> subprocess.Popen:
    argv, env = c.argv(line)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=open(c.tmp / log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    c.procs.append((proc, sigints))
    return proc


def start_server(c: Clone, line: str) -> None:
    port = free_port()
    c.env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    proc = start(c, f"{line} --host 127.0.0.1 --port {port}", cwd=c.root, log="server.log", sigints=1)

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prefect server exited {proc.returncode}:\n{(c.tmp / 'server.log').read_text()[-3000:]}")
        try:
            return httpx.get(c.env["PREFECT_API_URL"] + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    poll(healthy, timeout=180, interval=API_POLL_S, what="prefect server /api/health")   # ≈ 5–10 s idle; minutes at load 12


@pytest.fixture
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clone]:
    """A fresh clone and README's `prefect server start` for it (each test its own: the walks run in
    parallel, and none sees another's pool, deployments or runs)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    tmp = tmp_path_factory.mktemp("fresh")
    root = tmp / "fleet"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(root)], check=True, timeout=120)
    subprocess.run(["git", "-C", str(root), "checkout", "--quiet", "--detach", head], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent),
               PYTHONPATH=str(root), PREFECT_HOME=str(seed_prefect_home(tmp / "prefect-home")),
               # test pace only: the worker and `serve` look for new runs every 2 s, not every 10 s (each
               # look costs the server CPU: test_deployments.prefect_server)
               PREFECT_WORKER_QUERY_SECONDS="2", PREFECT_RUNNER_POLL_FREQUENCY="2")
    c = Clone(root, tmp, env)
    (tmp / "elsewhere").mkdir()
    # where the clone's environment finds each package (find_spec: the file `import` would run, without
    # running it: importing `flows` imports Prefect, ≈ 2–3 s of CPU for a path)
    where = subprocess.run(["python", "-c", "import importlib.util; print('\\n'.join("
                            "importlib.util.find_spec(m).origin for m in ('fleet', 'flows', 'tasks', 'blocks')))"],
                           cwd=tmp / "elsewhere", env=env, capture_output=True, text=True, check=True).stdout.split()
    assert len(where) == 4 and all(Path(f).is_relative_to(root) for f in where), \
        f"the clone's env imports {where}, not {root}"
    compile_sources(root)   # as the checkout's (conftest.compile_sources): each process would compile them again
    try:
        start_server(c, README_DEPLOY[1])
        yield c
    finally:
        for proc, sigints in reversed(c.procs):   # worker or serve, then the server
            stop_group(proc, sigints=sigints)


def start_worker(c: Clone) -> None:
    """README's `prefect worker start --pool fleet-pool`, from an unrelated directory; registered."""
    worker = start(c, README_DEPLOY[4], cwd=c.tmp / "elsewhere", log="worker.log", sigints=2)
    poll(lambda: worker.poll() is None and c.api("/work_pools/fleet-pool/workers/filter", {}), timeout=90,
         interval=API_POLL_S, what="the worker to register with fleet-pool")


def teardown_all(c: Clone, *names: str) -> None:
    """Stop whatever a failed test left running (by the clone's own CLI, no worker needed; after a
    passed walk its teardown run stopped everything)."""
    for rel in names:
        c.sh(f"fleet down -c {rel}", check=False)


def test_readme_fleet_deploy_block_on_a_fresh_clone(clone: Clone) -> None:
    """Fault: `fleet deploy` registered deployments with no pull step (`path: '.'`) and an entrypoint relative
    to the directory it ran in; a process worker runs each flow in a fresh temporary directory, so every run
    Crashed (FileNotFoundError …/flows/fleet.py) on a fresh clone, on a pool `fleet deploy` created or a
    default one. Now each deployment sets its working directory to the checkout fleet is installed from:
    README's block, as written, brings the fleet up, runs a job (each row exactly once) and tears it down."""
    c = clone
    lines = readme_block("### One command per fleet")
    assert lines == README_DEPLOY, "README's `fleet deploy` block changed: walk the new one here"
    sim_fleet(c, "deployments/configs/ssh-sglang.toml", "b200")
    out = c.sh(lines[3]).stdout
    assert "work pool fleet-pool created" in out, out
    start_worker(c)
    data = c.tmp / "data"
    data.mkdir()
    prompts(data / "prompts.jsonl", ROWS)
    try:
        fr = c.run(README_DEPLOY[5])
        assert fr["name"] == "bringup-b200" and fr["state"]["message"].startswith("2 server(s) up")
        deps = {d["name"]: d for d in c.api("/deployments/filter", {}) if d["name"].endswith("-b200")}
        assert set(deps) == {f"{a}-b200" for a in ACTIONS}
        for d in deps.values():   # the code the worker ran: the clone's
            assert d["entrypoint"] == "flows/fleet.py:fleet" and d["work_pool_name"] == "fleet-pool"
            assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory":
                                        {"directory": str(c.root)}}]
        fr = c.run(README_DEPLOY[6], **{"/data/": f"{data}/"})
        assert fr["name"] == "generate-b200"
        ids = shard_ids(data / "out")
        assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))   # every row, exactly once
        fr = c.run(README_DEPLOY[7])
        assert fr["name"] == "teardown-b200" and "stopped 2 server(s)" in fr["state"]["message"]
    except BaseException:
        teardown_all(c, "deployments/configs/ssh-sglang.toml")
        raise


def walk_generic(c: Clone, bringup: str, fleet_name: str, *params: str) -> None:
    """bringup as README types it, then generate and teardown the same way; each Completed, rows once."""
    out = c.tmp / f"out-{fleet_name}"
    inp = prompts(c.tmp / f"in-{fleet_name}.jsonl", ROWS)
    fr = c.run(bringup)
    assert fr["name"] == f"bringup-{fleet_name}" and fr["state"]["message"].startswith("2 server(s) up")
    extra = " ".join(f"--param {p}" for p in params)
    fr = c.run(f"prefect deployment run fleet/generate {extra} --param input={inp} --param output={out} --watch")
    assert fr["name"] == f"generate-{fleet_name}"
    assert sorted(shard_ids(out)) == sorted(f"r{i}" for i in range(ROWS))   # every row, exactly once
    fr = c.run(f"prefect deployment run fleet/teardown {extra} --param free_ramdisk=true --watch")
    assert fr["name"] == f"teardown-{fleet_name}" and "stopped 2 server(s)" in fr["state"]["message"]


def test_readme_yaml_recipe_on_a_fresh_clone(clone: Clone) -> None:
    """The YAML recipe on a fresh clone, with README's worker on its pool: its pull step sets the directory
    `prefect deploy` ran in, so a relative config path is read there (the clone's file, whose fleet is
    `yaml-sim`)."""
    c = clone
    lines = readme_block("### The YAML recipe")
    assert lines == README_YAML, "README's YAML block changed: walk the new one here"
    rel = "deployments/configs/local-sim.toml"
    sim_fleet(c, rel, "yaml-sim")
    c.sh(lines[0])
    c.sh(lines[1])
    start_worker(c)
    for d in c.api("/deployments/filter", {}):
        if d["name"] in ACTIONS:
            assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory":
                                        {"directory": str(c.root)}}]
    try:
        walk_generic(c, lines[2], "yaml-sim", f"config={rel}")
    except BaseException:
        teardown_all(c, rel)
        raise


def test_readme_serve_on_a_fresh_clone(clone: Clone) -> None:
    """`python -m flows.serve` from the fresh clone on a fresh server (no pool, no worker, no deployments
    before it: each registered one is serve's), then bringup, generate, teardown through the served
    deployments."""
    c = clone
    assert readme_block("### Without a work pool") == README_SERVE
    rel = "deployments/configs/local-sim.toml"
    sim_fleet(c, rel, "serve-sim")
    serve = start(c, README_SERVE[0], cwd=c.root, log="serve.log", sigints=2)

    def served() -> bool:
        if serve.poll() is not None:
            pytest.fail(f"flows.serve exited {serve.returncode}:\n{(c.tmp / 'serve.log').read_text()[-3000:]}")
        return len([d for d in c.api("/deployments/filter", {}) if d["name"] in ACTIONS]) == 4

    poll(served, timeout=120, interval=API_POLL_S, what="flows.serve to register its four deployments")
    try:
        walk_generic(c, "prefect deployment run fleet/bringup --watch", "serve-sim")
    except BaseException:
        teardown_all(c, rel)
        raise
