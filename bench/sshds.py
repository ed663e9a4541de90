"""Throwaway OpenSSH servers on loopback for benches: `count` sshd processes, each on its own free
127.0.0.1 port, one generated host key and one authorized client key for all of them.

    with Sshds(20) as s:
        cfg = s.node_config(i, name="n07", workdir="/tmp/x/n07")   # a NodeConfig for fleet's SSH seam

The same configuration as the tests' session sshd (tests/conftest.py): keys only, no PAM, StrictModes off
for keys under /tmp. `cpu_s()` is the CPU the listeners and every session they served have used (the
sessions' CPU reaches the listener's children counters when it reaps them; live ones are read apart).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

SSHD = "/usr/sbin/sshd"


def _keygen(path: Path) -> str:
    """A new ed25519 key at `path`; its public key 'ssh-ed25519 AAAA…'."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    kind, b64 = path.with_suffix(".pub").read_text().split()[:2]
    return f"{kind} {b64}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ticks(pid: int, children: bool) -> int:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children else 0)


class Sshds:
    def __init__(self, count: int) -> None:
        if not os.path.exists(SSHD):
            raise SystemExit(f"{SSHD} is missing: apt-get install -y openssh-server")
        self.dir = Path(tempfile.mkdtemp(prefix="bench-sshd-"))
        self.client_key = self.dir / "client_ed25519"
        host_key = self.dir / "host_ed25519"
        self.host_key = _keygen(host_key)
        (self.dir / "authorized_keys").write_text(_keygen(self.client_key) + "\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        for i in range(count):
            port = _free_port()
            conf = self.dir / f"sshd_{i}.conf"
            conf.write_text("\n".join([
                f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}",
                f"PidFile {self.dir / f'sshd_{i}.pid'}", f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                "PermitRootLogin prohibit-password", "MaxStartups 200", "MaxSessions 20", "LogLevel ERROR",
                "Subsystem sftp internal-sftp",   # the runner zip put on a start (FIRST_START_OPS)
                "SetEnv SHLVL=1",   # no ~/.bashrc per command (tests/conftest.py says why): sshd's own cost
            ]) + "\n")
            self.procs.append(subprocess.Popen([SSHD, "-D", "-f", str(conf), "-E", str(self.dir / f"sshd_{i}.log")],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
            self.ports.append(port)
        for proc, port in zip(self.procs, self.ports):
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"sshd on port {port} exited with {proc.returncode}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"sshd on port {port} did not listen within 60 s")
                    time.sleep(0.05)
        self.cpu0 = self._cpu_ticks()

    def node_config(self, i: int, **fields: Any) -> Any:
        """A NodeConfig for the seam, on sshd number i % count."""
        from fleet.config import NodeConfig

        return NodeConfig(kind="ssh", host="127.0.0.1", port=self.ports[i % len(self.ports)], user=getpass.getuser(),
                          key_file=self.client_key, host_key=self.host_key, connect_timeout_s=30.0, **fields)

    def _cpu_ticks(self) -> int:
        total = 0
        for p in self.procs:
            total += _ticks(p.pid, children=True)
            for d in Path("/proc").iterdir():   # live sessions: their CPU is not in the counters yet
                if d.name.isdigit():
                    try:
                        ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    except (OSError, IndexError, ValueError):
                        continue
                    if ppid == p.pid:
                        total += _ticks(int(d.name), children=True)
        return total

    def cpu_s(self) -> float:
        """CPU seconds of the sshd side since the start."""
        return (self._cpu_ticks() - self.cpu0) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Sshds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
