"""Preflight: parsers on real text, and the whole inspection on the local node with a fake nvidia-smi."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.config import FleetConfig
from fleet.node import LocalNode
from fleet.preflight import (
    evaluate, gather, is_network_fs, mount_for, parse_listening_ports, parse_meminfo, parse_mounts,
    parse_nvidia_smi, render,
)

# `nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version
#  --format=csv,noheader,nounits` as printed by the driver: ", " separated, no units.
H200_CSV = """0, NVIDIA H200, GPU-5b1c4b1e-93a0-2d0e-a1f6-3f4a2b9c7d10, 143771, 0, 143181, 580.159.04
1, NVIDIA H200, GPU-7e2a9d44-0c1b-4f55-8e2e-9a0b1c2d3e4f, 143771, 81234, 61947, 580.159.04
"""
MIG_CSV = "0, NVIDIA A100-SXM4-80GB, GPU-11111111-2222-3333-4444-555555555555, [N/A], [N/A], [N/A], 535.104.05\n"

MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=923000000k 0 0
10.0.0.5:/export /workspace nfs4 rw,relatime,vers=4.1 0 0
s3fs /mnt/bucket fuse.s3fs rw,nosuid,nodev 0 0
overlay /var/lib/docker/overlay2/x/merged overlay rw 0 0
/dev/nvme0n1p1 /mnt/my\\040disk ext4 rw 0 0
"""

PROC_NET_TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:7531 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1
"""


def test_parse_nvidia_smi_h200() -> None:
    gpus = parse_nvidia_smi(H200_CSV)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H200" and gpus[0].memory_total_mib == 143771
    assert gpus[1].memory_used_mib == 81234 and gpus[1].driver_version == "580.159.04"


def test_parse_real_nvidia_smi_from_the_lent_h200() -> None:
    """The exact bytes nvidia-smi printed on the lent H200 machine (bench/gpu_bench.py saved them)."""
    text = (Path(__file__).parent / "data" / "nvidia_smi_h200.csv").read_text()
    (gpu,) = parse_nvidia_smi(text)
    assert (gpu.index, gpu.name, gpu.memory_total_mib, gpu.driver_version) == (0, "NVIDIA H200", 143771, "580.159.04")
    assert gpu.uuid.startswith("GPU-") and gpu.memory_used_mib + gpu.memory_free_mib <= gpu.memory_total_mib


def test_parse_nvidia_smi_na_values_and_garbage() -> None:
    gpus = parse_nvidia_smi(MIG_CSV + "No devices were found\n\x00\x01junk\n")
    assert len(gpus) == 1 and gpus[0].memory_total_mib == -1


def test_parse_mounts_and_network_detection() -> None:
    mounts = parse_mounts(MOUNTS)
    assert mount_for("/workspace/venv", mounts).fstype == "nfs4"
    assert mount_for("/workspace", mounts).fstype == "nfs4"
    assert mount_for("/workspacex/venv", mounts).fstype == "ext4"
    assert mount_for("/dev/shm/model", mounts).fstype == "tmpfs"
    assert mount_for("/mnt/my disk/x", mounts).mountpoint == "/mnt/my disk"
    assert mount_for("/mnt/bucket/m", mounts).network
    for fs in ("nfs", "nfs4", "cifs", "smb3", "fuse.s3fs", "fuse.sshfs", "fuse.gcsfuse", "lustre", "9p",
               "ceph", "glusterfs"):
        assert is_network_fs(fs), fs
    for fs in ("ext4", "xfs", "tmpfs", "overlay", "btrfs", "fuse.fuse-overlayfs"):
        assert not is_network_fs(fs), fs


def test_parse_meminfo_and_ports() -> None:
    total, avail = parse_meminfo("MemTotal:       24684084 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n")
    assert total == 24684084 * 1024 and avail == 20000000 * 1024
    assert parse_listening_ports(PROC_NET_TCP) == {30000}  # 0x7530 listening; 0x7531 is an established socket


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake nvidia-smi on PATH printing the H200 CSV (no GPU on this machine)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "nvidia-smi"
    tool.write_text("#!/bin/sh\ncat <<'EOF'\n" + H200_CSV + "EOF\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return tool


def _cfg(tmp_path: Path, **kw) -> FleetConfig:
    base = {"nodes": [{"name": "local", "workdir": str(tmp_path / "work")}],
            "venv": {"path": str(tmp_path / "venv")}}
    base.update(kw)
    return FleetConfig(**base)


def test_gather_local_with_fake_gpus(tmp_path: Path, fake_nvidia_smi: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"x" * 4096)
    cfg = _cfg(tmp_path, engine={"kind": "sglang"}, servers={"count": 2, "base_port": 39000},
               model={"source": str(model), "stage_margin_gb": 0.001})
    report = gather(LocalNode(), cfg, cfg.nodes[0])
    assert report.reachable and report.nvidia_smi == "ok" and len(report.gpus) == 2
    assert report.cpu_count and report.cpu_count >= 1 and report.mem_total_bytes
    assert report.path("model_source").size_bytes >= 4096
    assert report.path("ramdisk").fstype == "tmpfs"
    assert report.ports == {39000: True, 39001: True}
    assert report.ok, render([report])


def test_no_nvidia_smi_means_zero_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node without nvidia-smi is a valid answer: zero GPUs; an engine that needs GPUs fails the check."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    cfg = _cfg(tmp_path, engine={"kind": "sglang"})
    report = gather(LocalNode(), cfg, cfg.nodes[0])
    assert report.reachable and report.gpus == [] and report.nvidia_smi == "absent"
    assert not report.ok and [c.name for c in report.failures()] == ["gpus"]


def test_ramdisk_too_small_is_a_hard_failure(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"x" * 1000)
    cfg = _cfg(tmp_path, model={"source": str(model), "stage_margin_gb": 1e6})
    report = gather(LocalNode(), cfg, cfg.nodes[0])
    assert [c.name for c in report.failures()] == ["ramdisk-room"]


def test_busy_port_is_reported(tmp_path: Path) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        cfg = _cfg(tmp_path, servers={"count": 1, "ports": [port]})
        report = gather(LocalNode(), cfg, cfg.nodes[0])
        assert report.ports == {port: False}
        assert any(c.name == "ports" and not c.ok for c in report.checks)
    finally:
        s.close()


def test_venv_on_network_fs_is_refused_with_remedy(tmp_path: Path) -> None:
    from fleet.preflight import NodeReport, PathInfo

    cfg = _cfg(tmp_path, venv={"path": "/workspace/venv"})
    report = NodeReport(node="n", host="h", reachable=True, python="/usr/bin/python3",
                        paths=[PathInfo("venv", "/workspace/venv", "/workspace/venv", False, "nfs4", "/workspace",
                                        True, 10**12)])
    checks = evaluate(report, cfg, cfg.nodes[0])
    bad = [c for c in checks if not c.ok and c.hard]
    assert [c.name for c in bad] == ["venv-local-fs"]
    assert "nfs4" in bad[0].detail and "local disk" in bad[0].remedy


def _fleet(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_cli_preflight_json(tmp_path: Path, fake_nvidia_smi: Path) -> None:
    p = tmp_path / "f.toml"
    p.write_text(f'[[nodes]]\nname = "local"\nworkdir = "{tmp_path}/w"\n[venv]\npath = "{tmp_path}/v"\n'
                 '[engine]\nkind = "sglang"\n[servers]\ncount = 2\nbase_port = 39100\n')
    r = _fleet("preflight", "-c", str(p), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    node = data["nodes"][0]
    assert data["ok"] and node["ok"] and len(node["gpus"]) == 2
    assert {"node", "host", "reachable", "gpus", "cpu_count", "mem_total_bytes", "paths", "ports", "checks"} <= set(node)
    r = _fleet("preflight", "-c", str(p))
    assert r.returncode == 0 and "NVIDIA H200" in r.stdout


@pytest.mark.parametrize("text,needle", [
    ("[servers\n", "not valid TOML"),
    ("[servers]\nbogus = 1\n", "servers.bogus: unknown key"),
    ('[servers]\ncount = "x"\n', "servers.count"),
    ("[servers]\nbase_port = 99999\n", "servers.base_port"),
    ("[servers]\nports = [30000, 30000]\n", "two servers on one port"),
])
def test_cli_bad_config_is_one_clear_line(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    r = _fleet("preflight", "-c", str(p))
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 2


def test_cli_missing_key_file_is_one_clear_line(tmp_path: Path) -> None:
    p = tmp_path / "k.toml"
    p.write_text(f'[[nodes]]\nname = "n"\nkind = "ssh"\nhost = "127.0.0.1"\nport = 9\nkey_file = "{tmp_path}/nope"\n')
    r = _fleet("preflight", "-c", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nope" in r.stderr


@pytest.mark.ssh
def test_cli_preflight_over_ssh(tmp_path: Path, sshd, fake_nvidia_smi: Path) -> None:
    """`fleet preflight` against a real sshd: the node is inspected over SSH (host key pinned)."""
    p = tmp_path / "ssh.toml"
    p.write_text(f'[[nodes]]\nname = "remote"\nkind = "ssh"\nhost = "127.0.0.1"\nport = {sshd.port}\n'
                 f'user = "{sshd.user}"\nkey_file = "{sshd.key_file}"\nhost_key = "{sshd.host_key}"\n'
                 f'workdir = "{tmp_path}/w"\n[venv]\npath = "{tmp_path}/v"\n[servers]\ncount = 1\nbase_port = 39200\n')
    r = _fleet("preflight", "-c", str(p), "--json")
    assert r.returncode == 0, r.stderr
    node = json.loads(r.stdout)["nodes"][0]
    assert node["reachable"] and node["host"] == "127.0.0.1" and node["cpu_count"] >= 1
    assert {pi["role"] for pi in node["paths"]} >= {"workdir", "ramdisk", "venv"}


@pytest.mark.ssh
def test_cli_preflight_warns_when_every_command_pays_a_slow_shell_start(tmp_path: Path, sshd,
                                                                        fake_nvidia_smi: Path) -> None:
    """A node whose login shell runs slow startup files for every SSH command (bash reads ~/.bashrc
    for them: conda or pyenv init there) makes each of fleet's hundreds of commands that much slower:
    `fleet preflight` says so, softly, with the guard that fixes it (the same node without it is quicker)."""
    from conftest import start_sshd

    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("sleep 0.6\n")   # what a slow `conda init` block costs each command
    started: list = []
    try:
        reports = {}
        for label, setenv in (("slow", f"HOME={home}"), ("guarded", "SHLVL=1")):
            d = tmp_path / label
            d.mkdir()
            _, port = start_sshd(d, sshd.dir / "host_ed25519", sshd.dir / "authorized_keys", d / "log", 30, started,
                                 setenv=setenv)
            p = tmp_path / f"{label}.toml"
            p.write_text(f'[[nodes]]\nname = "remote"\nkind = "ssh"\nhost = "127.0.0.1"\nport = {port}\n'
                         f'user = "{sshd.user}"\nkey_file = "{sshd.key_file}"\nhost_key = "{sshd.host_key}"\n'
                         f'workdir = "{tmp_path}/w"\n[venv]\npath = "{tmp_path}/v"\n[servers]\ncount = 1\n'
                         'base_port = 39200\n')
            r = _fleet("preflight", "-c", str(p), "--json")
            assert r.returncode == 0, r.stderr
            reports[label] = json.loads(r.stdout)["nodes"][0]
            text = _fleet("preflight", "-c", str(p)).stdout
            if label == "slow":
                assert "[warn] command-latency: a no-op command takes" in text and "~/.bashrc" in text, text
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
    assert reports["slow"]["command_s"] >= 0.6
    latency = {k: next(c for c in r["checks"] if c["name"] == "command-latency") for k, r in reports.items()}
    assert not latency["slow"]["ok"] and not latency["slow"]["hard"] and "return" in latency["slow"]["remedy"]
    # (no bound on the guarded node's time: a busy machine may make any command slow; only the order)
    assert reports["guarded"]["command_s"] < reports["slow"]["command_s"]


def test_cli_preflight_unreachable_node_is_one_line_exit_2(tmp_path: Path) -> None:
    from conftest import free_port

    p = tmp_path / "down.toml"
    p.write_text(f'[[nodes]]\nname = "gone"\nkind = "ssh"\nhost = "127.0.0.1"\nport = {free_port()}\n'
                 f'host_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"\n')
    r = _fleet("preflight", "-c", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "gone unreachable" in r.stderr


def test_free_port_block_and_port_remedy() -> None:
    """A busy port's remedy names the setting to change (servers.base_port, or servers.ports when
    ports are explicit) and a block of ports that is free now."""
    from fleet.config import FleetConfig
    from fleet.preflight import free_port_block, port_remedy

    assert free_port_block({30100, 30101, 30105}, 4, 30099) == 30106
    assert free_port_block({30100, 30103}, 2, 30099) == 30101
    assert free_port_block({65531, 65533, 65535}, 2, 65530) is None
    cfg = FleetConfig(servers={"count": 2, "base_port": 30100})
    fix = port_remedy(cfg, [30101], {30100, 30101, 30102}, 2)
    assert fix.startswith("change servers.base_port (ports 30103-30104 are free now: base_port = 30103, "
                          "or FLEET_SERVERS__BASE_PORT=30103), or stop what listens there")
    explicit = FleetConfig(servers={"count": 1, "ports": [30100]})
    assert port_remedy(explicit, [30100], {30100}, 1).startswith("give servers.ports other ports")
