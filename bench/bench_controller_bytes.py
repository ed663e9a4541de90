"""What the controller reads from the store, against what the runners read: bytes per process.

    .venv/bin/python bench/bench_controller_bytes.py --rows 1000 3000 [--tree /tmp/old-checkout]

moto's S3 server on a loopback port, and in front of it a TCP proxy (in this process) that every
client of the job talks to (AWS_ENDPOINT_URL). For each connection the proxy finds the process at
the other end (its port in /proc/net/tcp, the socket's inode among /proc/<pid>/fd) and counts the
bytes each way against it: the controller (the `fleet generate` process this bench starts) or a
runner (any other process: the nodes' detached runners). The input is put into the bucket by this
process straight to moto, not through the proxy. Two local nodes of sim servers (bench_multinode's
config), a JSONL input on the store, the output on the store.

`--tree DIR` runs the `fleet generate` of another checkout (e.g. `git worktree add --detach DIR main`):
the before figure. One line of JSON per row count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_block(n: int) -> int:
    """The first of `n` consecutive free loopback ports (the nodes' servers' base_port)."""
    import random

    from fleet.demo import free_port_block

    start = random.randrange(30000, 45000)   # another run of the bench beside this one starts elsewhere
    return free_port_block(n, start=start)


def _inode_of(client_port: int, server_port: int) -> str | None:
    """The socket inode of the client end 127.0.0.1:client_port → :server_port (/proc/net/tcp)."""
    want_local = f"0100007F:{client_port:04X}"
    want_remote = f":{server_port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[1].endswith(f":{client_port:04X}") and f[2].endswith(want_remote) and \
                    (f[1] == want_local or table.endswith("6")):
                return f[9]
    return None


def _pid_of(inode: str) -> int | None:
    target = f"socket:[{inode}]"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        return int(d.name)
                except OSError:
                    continue
        except OSError:
            continue
    return None


def _kind(method: str, target: str) -> str:
    """What a request is for, from its method and path: the input, a part's shards, a part's small
    files, the job's control files, the merged output, a listing."""
    path, _, query = target.partition("?")
    if method == "GET" and ("list-type" in query or "prefix=" in query):
        return "GET listing"
    parts = path.strip("/").split("/")
    key = "/".join(parts[1:])
    if key.startswith("in/"):
        what = "input"
    elif "/_parts/" in f"/{key}":
        what = "part shard" if "/shards/" in key else "part file"
    elif "/_control/" in f"/{key}":
        what = "control"
    elif "/shards/" in key:
        what = "output shard"
    else:
        what = "output file" if key else "bucket"
    return f"{method} {what}"


class Proxy:
    """A counting TCP proxy on loopback in front of `upstream_port` (see the module docstring)."""

    def __init__(self, upstream_port: int, controller: list[int]) -> None:
        self.port = _free_port()
        self.upstream = upstream_port
        self.controller = controller          # [pid] once the controller is started
        self.down: dict[str, int] = {}        # role -> bytes from the store to the client
        self.up: dict[str, int] = {}
        self.conns: dict[str, int] = {}
        self.by_kind: dict[tuple[str, str], int] = {}    # (role, request kind) -> bytes down
        self.requests: dict[tuple[str, str], int] = {}   # (role, request kind) -> requests
        self._loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self._loop.run_forever, daemon=True)

    def role(self, client_port: int) -> str:
        inode = _inode_of(client_port, self.port)
        pid = _pid_of(inode) if inode else None
        if pid is None:
            return "unknown"
        if self.controller and pid == self.controller[0]:
            return "controller"
        return "this bench" if pid == os.getpid() else "runners"

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, into: dict[str, int], role: str,
                    last: list[str], requests: bool) -> None:
        """Copy r → w, counting. Upstream (`requests`): each request line's kind goes into `last`; a
        response's bytes count against the kind of the connection's last request (HTTP/1.1 in order)."""
        import re

        try:
            while True:
                data = await r.read(65536)
                if not data:
                    break
                into[role] = into.get(role, 0) + len(data)
                if requests:
                    for m in re.finditer(rb"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1", data):
                        last[0] = _kind(m.group(1).decode(), m.group(2).decode())
                        self.requests[(role, last[0])] = self.requests.get((role, last[0]), 0) + 1
                else:
                    self.by_kind[(role, last[0])] = self.by_kind.get((role, last[0]), 0) + len(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        role = self.role(cw.get_extra_info("peername")[1])
        self.conns[role] = self.conns.get(role, 0) + 1
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        last = ["?"]
        await asyncio.gather(self._pipe(cr, uw, self.up, role, last, True),
                             self._pipe(ur, cw, self.down, role, last, False))

    def start(self) -> None:
        async def serve() -> None:
            await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        self._t.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(10)


def _moto(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    import httpx

    port = _free_port()
    log = (tmp / "moto.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=2).status_code < 500:
                return proc, port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("moto did not start: " + (tmp / "moto.log").read_text()[-2000:])
        time.sleep(0.2)


def one(rows: int, tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    from bench_multinode import config, prompts
    from fleet.demo import to_toml

    tmp = Path(tempfile.mkdtemp(prefix="bench-bytes-"))
    moto, moto_port = _moto(tmp)
    controller: list[int] = []
    proxy = Proxy(moto_port, controller)
    proxy.start()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
           "XDG_STATE_HOME": str(tmp / "state"), "PREFECT_HOME": str(tmp / "prefect"),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                           "AWS_ENDPOINT_URL")})
    from fleet.generation.data.objstore import Store

    Store("s3://bench").fs.mkdir("bench")
    inp = prompts(tmp / "in.jsonl", rows)
    Store("s3://bench").put_file(str(inp), "in/prompts.jsonl")
    cfg = config(tmp, _port_block(3), args)
    (tmp / "fleet.toml").write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"   # the job's every client through the proxy
    env["PYTHONPATH"] = str(tree)
    t0 = time.monotonic()
    log = (tmp / "generate.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "generate", "-c", str(tmp / "fleet.toml"),
                             "--input", "s3://bench/in/prompts.jsonl", "--output", "s3://bench/out"],
                            cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    controller.append(proc.pid)
    try:
        rc = proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _stop_nodes(cfg)
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait()
    wall = time.monotonic() - t0
    return {"rows": rows, "tree": str(tree), "rc": rc, "wall_s": round(wall, 1),
            "input_bytes": inp.stat().st_size,
            "controller_down_bytes": proxy.down.get("controller", 0), "runners_down_bytes": proxy.down.get("runners", 0),
            "controller_up_bytes": proxy.up.get("controller", 0), "runners_up_bytes": proxy.up.get("runners", 0),
            "unknown_down_bytes": proxy.down.get("unknown", 0), "connections": proxy.conns,
            "controller_down_by_kind": {k: v for (r, k), v in sorted(proxy.by_kind.items()) if r == "controller"},
            "controller_requests_by_kind": {k: v for (r, k), v in sorted(proxy.requests.items()) if r == "controller"},
            "log": str(tmp / "generate.log")}


def _stop_nodes(cfg: Any) -> None:
    """The runners and sim servers the job left (the flow stops nothing it adopted)."""
    from fleet.node import connect
    from fleet.servers import stop_servers

    for n in cfg.nodes:
        with connect(n) as node:
            node.run(["sh", "-c", 'for p in "$1"/jobs/*/runner.pid; do [ -f "$p" ] && { read -r pid _ < "$p"; '
                      'kill -9 "$pid"; }; done; true', "x", n.workdir], check=False)
            stop_servers(node, cfg, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose `fleet generate` runs")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tokens-per-s", type=float, default=2000)
    ap.add_argument("--mrr", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=250)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    for rows in args.rows:
        print(json.dumps(one(rows, args.tree.resolve(), args)), flush=True)


if __name__ == "__main__":
    main()
