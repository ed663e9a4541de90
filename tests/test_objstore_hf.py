"""`hf://datasets/…` inputs through the same Store seam, against a stand-in of the Hub's HTTP API on
loopback (no Hub is reachable here): the handful of endpoints huggingface_hub's HfFileSystem calls to
read a dataset repo's files — the repo info (`/api/datasets/<id>[/revision/<rev>]`), the tree listing
(`/api/datasets/<id>/tree/<rev>[/<dir>]`), paths-info (POST `/api/datasets/<id>/paths-info/<rev>`) and
the file itself (`/datasets/<id>/resolve/<rev>/<path>`, with HTTP Range, ETag, X-Repo-Commit,
Content-Length). Anything else it asks is answered 404 and recorded, so a test sees it.

A runner on an SSH node reading an hf:// input with the controller's HF_TOKEN and HF_ENDPOINT:
tests/test_objstore_nodes.py. What is not tested on hf://: private or gated repos (the stand-in
takes any token), Xet-stored files (it names no xetHash, so files come over plain HTTP ranges).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import threading
from typing import Any
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_multinode import _cli, _run_to_end, plan_state, state_home, two_nodes  # noqa: F401
from test_objstore import s3, store_ids  # noqa: F401  (fixture)

REPO = "fleet-test/prompts"
SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    """The stand-in's content (one dataset repo, one revision) and what it was asked."""

    url: str
    files: dict[str, bytes] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    ranged: int = 0
    # when a list: (the asking process's command line, its Authorization header) of every request
    peers: list[tuple[str, str | None]] | None = None

    def oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def entry(self, path: str) -> dict[str, object]:
        if path in self.files:
            return {"type": "file", "oid": self.oid(path), "size": len(self.files[path]), "path": path}
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}

    def children(self, folder: str, recursive: bool) -> list[dict[str, object]] | None:
        """A folder's entries (every file and folder below it when `recursive`); None: no such folder."""
        prefix = f"{folder}/" if folder else ""
        below = [p for p in self.files if p.startswith(prefix)]
        if folder and not below:
            return None
        names: set[str] = set()
        for p in below:
            parts = p[len(prefix):].split("/")
            for depth in range(1, len(parts) + 1 if recursive else 2):
                names.add(prefix + "/".join(parts[:depth]))
        return [self.entry(n) for n in sorted(names)]


def peer_argv(client: tuple[str, int], server_port: int) -> str:
    """The command line of the process on this machine at the other end of a loopback connection to
    `server_port` (from the kernel's socket table), "?" when it is not found."""
    import psutil

    for c in psutil.net_connections(kind="tcp"):
        if c.pid and c.laddr and c.laddr.port == client[1] and c.raddr and c.raddr.port == server_port:
            try:
                return " ".join(psutil.Process(c.pid).cmdline())
            except psutil.Error:
                return "?"
    return "?"


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    api = f"/api/datasets/{REPO}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _json(self, body: object, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _missing(self, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, path: str, head: bool) -> None:
            if path not in hub.files:
                return self._missing("EntryNotFound")
            data, rng = hub.files[path], self.headers.get("Range")
            status, start, end = 200, 0, len(data) - 1
            if rng:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                assert m, rng
                start, end = int(m[1]), min(int(m[2]) if m[2] else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
                hub.ranged += 1
            self.send_response(status)
            self.send_header("ETag", f'"{hub.oid(path)}"')
            self.send_header("X-Repo-Commit", SHA)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if not head:
                self.wfile.write(data[start:end + 1])

        def _note(self) -> None:
            if hub.peers is not None:
                hub.peers.append((peer_argv(self.client_address, self.server.server_address[1]),
                                  self.headers.get("Authorization")))

        def _get(self, head: bool) -> None:
            self._note()
            u = urlsplit(self.path)
            path, query = unquote(u.path), parse_qs(u.query)
            if path in (api, f"{api}/revision/main", f"{api}/revision/{SHA}"):
                return self._json({"id": REPO, "sha": SHA, "private": False, "disabled": False, "gated": False,
                                   "siblings": [{"rfilename": p} for p in sorted(hub.files)]})
            for rev in ("main", SHA):
                if path == f"{api}/tree/{rev}" or path.startswith(f"{api}/tree/{rev}/"):
                    folder = path[len(f"{api}/tree/{rev}"):].strip("/")
                    got = hub.children(folder, query.get("recursive", ["False"])[0].lower() == "true")
                    return self._missing("EntryNotFound") if got is None else self._json(got)
                if path.startswith(f"/datasets/{REPO}/resolve/{rev}/"):
                    return self._file(path[len(f"/datasets/{REPO}/resolve/{rev}/"):], head)
            if path == "/api/agent-harnesses":   # huggingface_hub asks it for its user agent, whatever the read
                return self._json({"standardEnvVars": [], "harnesses": {}})
            if path.startswith(f"{api}") or path.startswith(f"/datasets/{REPO}"):
                hub.unknown.append(f"{self.command} {self.path}")
                return self._missing("EntryNotFound")
            hub.unknown.append(f"{self.command} {self.path}")
            self._missing("RepoNotFound")

        def do_GET(self) -> None:
            self._get(head=False)

        def do_HEAD(self) -> None:
            self._get(head=True)

        def do_POST(self) -> None:
            self._note()
            path = unquote(urlsplit(self.path).path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            if path in (f"{api}/paths-info/main", f"{api}/paths-info/{SHA}"):
                asked = parse_qs(body).get("paths", [])
                return self._json([hub.entry(p) for p in asked if p in hub.files or hub.children(p, False)])
            hub.unknown.append(f"POST {self.path}")
            self._missing("RepoNotFound")

    return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Hub]:
    """The stand-in Hub on a loopback port; HF_ENDPOINT points at it (here and in the processes this test
    starts), no token, offline mode off, the Hub cache under tmp_path."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Hub("")))
    hub = Hub(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    import fsspec
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)   # read at import: this process may have imported it
    # the file URL's template is built from the endpoint at import too (a worker that imported
    # huggingface_hub earlier, through transformers or datasets, asked the real Hub for the file)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # Loopback only: a name other than the stand-in's is refused here, before any packet leaves.
    real_getaddrinfo = socket.getaddrinfo

    def loopback_only(host: Any, *args: Any, **kw: Any) -> Any:
        if host not in ("127.0.0.1", "localhost", "::1", None) and not str(host).startswith("127."):
            raise OSError(f"test_objstore_hf: no traffic off loopback (asked for {host!r})")
        return real_getaddrinfo(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    hffs = fsspec.get_filesystem_class("hf")   # kept: a test may hide huggingface_hub until teardown
    hffs.clear_instance_cache()
    try:
        yield hub
    finally:
        hffs.clear_instance_cache()
        server.shutdown()
        server.server_close()


def test_hf_jsonl_input_planned_in_byte_ranges_and_parquet_read_by_rows(hub: Hub, tmp_path: Path) -> None:
    """An hf://datasets/ input is read in place like one on S3: a JSONL file planned in byte ranges (read
    over HTTP Range requests, never downloaded whole per chunk) that hold every line once, its version
    known by the file's blob id (a changed file refuses the old plan), a Parquet file read by row ranges."""
    from fleet.errors import InputChanged
    from fleet.generation.data.ranges import in_place, parquet_rows, read_rows, read_span, url_id
    from fleet.generation.multinode.chunks import split_input

    lines = [json.dumps({"id": f"r{i}", "prompt": "q" * (i % 9)}) for i in range(120)]
    hub.files["data/p.jsonl"] = ("\n".join(lines) + "\n").encode()
    table = pa.table({"id": [f"p{i}" for i in range(300)]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=50)
    hub.files["data/p.parquet"] = (tmp_path / "in.parquet").read_bytes()
    url = f"hf://datasets/{REPO}/data/p.jsonl"
    assert in_place(url)
    plan = split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=25)
    assert len(plan.chunks) > 2 and all(c.span is not None for c in plan.chunks)
    before = hub.ranged
    got = b"".join(read_span(url, c.span) for c in plan.chunks)  # type: ignore[arg-type]
    assert got.decode().splitlines() == lines and hub.ranged > before
    assert url_id(url)["blob_id"] == hub.oid("data/p.jsonl") and url_id(url)["revision"] == SHA
    hub.files["data/p.jsonl"] = ("\n".join(lines[:60]) + "\n").encode()   # another version of the input
    with pytest.raises(InputChanged):
        split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=25)
    purl = f"hf://datasets/{REPO}/data/p.parquet"
    assert parquet_rows(purl) == 300
    ids = [i for first in range(0, 300, 70) for i in read_rows(purl, first, min(70, 300 - first)).column(0).to_pylist()]
    assert ids == [f"p{i}" for i in range(300)]
    assert hub.unknown == []


def test_hf_output_and_a_missing_huggingface_hub_are_refused_with_the_remedy(hub: Hub, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:// is read-only here: an hf:// --output was taken as any store URL (its runners would fail to
    commit, one Hub commit per shard at best) — refused before anything starts. Without huggingface_hub
    an hf:// input failed deep in fsspec's import; now the error says which extra to install."""
    import fsspec

    from fleet.config import FleetConfig
    from fleet.errors import InputError
    from fleet.generation.data.objstore import Store
    from fleet.generation.job.validate import plan_job

    hub.files["p.jsonl"] = b'{"id": "a", "prompt": "hi"}\n'
    cfg = FleetConfig(name="t", nodes=[{"name": "local", "workdir": str(tmp_path / "w")}], engine={"kind": "sim"})
    with pytest.raises(InputError, match="read-only") as e:
        plan_job(cfg, input=f"hf://datasets/{REPO}/p.jsonl", output=f"hf://datasets/{REPO}/out")
    assert "s3://" in (e.value.remedy or "")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # as where it is not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "hf", raising=False)
    with pytest.raises(InputError, match="huggingface_hub") as e:
        Store(f"hf://datasets/{REPO}")
    assert "fleet[hf]" in (e.value.remedy or "")


@pytest.mark.timeout(900)   # one bring-up and a 300-row job over two nodes, on a shared 2-core machine
def test_hf_input_job_reads_every_row_exactly_once(tmp_path: Path, state_home: Path, hub: Hub, s3: str,
                                                   stop_everything) -> None:
    """`fleet generate --input hf://datasets/<user>/<name>/<file>.jsonl` with the output on object storage,
    two local nodes with sim servers: each runner reads its own byte ranges from the Hub, every input id
    ends exactly once in the store's merged output, and the Hub was asked nothing the stand-in lacks."""
    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 100, "shard_rows": 25},
                    sim={"tokens_per_s": 200, "max_running_requests": 8})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 300)
    hub.files["train/prompts.jsonl"] = inp.read_bytes()
    want = [json.loads(ln)["id"] for ln in inp.read_text().splitlines() if ln.strip()]
    out = f"{s3}/job"
    log = tmp_path / "gen.log"
    _run_to_end(_cli(cfg, tmp_path, f"hf://datasets/{REPO}/train/prompts.jsonl", out, log), log, timeout=600)   # type: ignore[arg-type]
    ids = store_ids(out)
    assert sorted(ids) == sorted(want) and len(ids) == len(set(ids))
    pdir, st = plan_state(state_home)  # type: ignore[misc]
    assert all(c["state"] == "done" for c in st["chunks"].values()) and len(st["chunks"]) > 1
    assert not (pdir / "source").exists()   # read in place by the runners, never staged on this machine
    assert hub.unknown == [] and hub.ranged > 0
