"""`fleet status --check` and `fleet down --free-ramdisk`: the revalidation and RAM-disk freeing
the Prefect actions do, from the core command line (no Prefect server, no flow).

Real parts: a sim server process, the local node, the `fleet` command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)

ROOT = Path(__file__).parent.parent


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=dict(os.environ))


def _config(tmp_path: Path, work: Path, extra: str = "") -> Path:
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'name = "chk"\n[engine]\nkind = "sim"\n[model]\nserved_name = "sim-model"\n{extra}'
                   f'[servers]\ncount = 3\nbase_port = 39990\n'
                   f'[smoke]\ntimeout_s = 20.0\nfirst_timeout_s = 20.0\n'
                   f'[[nodes]]\nname = "local"\nkind = "local"\nworkdir = "{work}"\n')
    return cfg


def _record(work: Path, index: int, port: int, pid: int | None) -> None:
    base = work / "servers" / f"chk-{index}"
    base.with_suffix(".json").write_text(json.dumps({"fleet": "chk", "node": "local", "index": index, "port": port,
                                                      "host": "127.0.0.1", "gpus": [], "started_at": 1.0}))
    if pid is not None:
        base.with_suffix(".pid").write_text(f"{pid}\n")


def test_status_check_revalidates_every_server(tmp_path: Path, sims: Any) -> None:  # noqa: F811
    """Fault: `fleet status` could only read launch records; re-validation (health, one chat
    completion, log verdict) lived in a Prefect task, so checking a fleet needed a flow run.
    A live server is healthy, a recorded one without a process and one never launched are
    named unhealthy, and the exit code is 1."""
    work = tmp_path / "work"
    (work / "servers").mkdir(parents=True)
    sim = sims(log=work / "servers" / "chk-0.log")
    assert sim.proc is not None
    _record(work, 0, sim.port, sim.proc.pid)
    _record(work, 1, 39991, None)                 # recorded, but stopped: no pid file
    cfg = _config(tmp_path, work)                 # count = 3: server 2 was never launched

    r = fleet("status", "-c", str(cfg), "--check", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    servers = {s["index"]: s for s in json.loads(r.stdout)["servers"]}
    assert servers[0]["healthy"] and servers[0]["process"] == "alive" and servers[0]["health"] == "200"
    assert servers[0]["smoke_latency_s"] is not None
    assert not servers[1]["healthy"] and servers[1]["process"] == "no pid file"
    assert not servers[2]["healthy"] and "never launched" in servers[2]["problems"][0]

    table = fleet("status", "-c", str(cfg), "--check")
    assert table.returncode == 1 and table.stdout.split()[:4] == ["node", "server", "port", "pid"]
    assert "fleet status: local server 2" in table.stderr and "never launched" in table.stderr


def test_down_free_ramdisk_removes_only_what_fleet_staged(tmp_path: Path) -> None:
    """Fault: `fleet down` could not free the RAM-disk copy (only the teardown flow could). With
    --free-ramdisk it removes the staged copy (its staging manifest is there); without, it stays."""
    from fleet.staging import MANIFEST_NAME, fleet_root

    work = tmp_path / "work"
    (work / "servers").mkdir(parents=True)
    source = tmp_path / "models" / "m"
    source.mkdir(parents=True)
    ram = tmp_path / "ram"
    staged = Path(fleet_root(str(ram), "chk", os.getuid())) / "m-0123456789ab"
    staged.mkdir(parents=True)
    (staged / MANIFEST_NAME).write_text("{}")
    (staged / "weights.bin").write_bytes(b"x" * 1000)
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'name = "chk"\n[engine]\nkind = "sim"\n[model]\nsource = "{source}"\nstage = true\n'
                   f'[[nodes]]\nname = "local"\nkind = "local"\nworkdir = "{work}"\nramdisk = "{ram}"\n')

    r = fleet("down", "-c", str(cfg))
    assert r.returncode == 0 and staged.exists(), r.stdout + r.stderr
    r = fleet("down", "-c", str(cfg), "--free-ramdisk")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not staged.exists() and "freed" in r.stdout
    again = fleet("down", "-c", str(cfg), "--free-ramdisk")
    assert again.returncode == 0 and "already gone" in again.stdout
