"""Simulated SGLang servers for the benchmarks: start N, wait until each answers /health."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

SIM = ("-m", "fleet.sim")  # the simulated SGLang server
ROOT = Path(__file__).resolve().parents[1]  # -m finds fleet here when it is not installed


def start_sims(tokens_per_s: list[float], slots: int, seed: int | None = None,
               extra: list[list[str]] | None = None, ports: list[int] | None = None
               ) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """One sim per entry of `tokens_per_s` (its decode speed), `slots` max running requests each;
    `extra[i]`: more flags for sim i (faults, --lengths); `ports[i]`: its port (a relaunch), else a free one."""
    procs, urls = [], []
    for i, tps in enumerate(tokens_per_s):
        if ports is not None:
            port = ports[i]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        argv = [sys.executable, *SIM, "--port", str(port), "--startup-s", "0", "--tokens-per-s", str(tps),
                "--max-running-requests", str(slots), "--log-interval-s", "3600"]
        if seed is not None:
            argv += ["--seed", str(seed)]
        if extra is not None:
            argv += extra[i]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 120   # a loaded 2-core machine can take a minute to import a sim
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                for p in procs:   # none left behind
                    p.kill()
                    p.wait()
                raise SystemExit(f"sim at {url} not healthy")
            time.sleep(0.05)
    return procs, urls
