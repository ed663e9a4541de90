"""A runner on an SSH node reaching object storage of every protocol with the controller's credentials.

Real parts: the loopback sshd of the test session (the node), a sim server launched there, the
runner started there from its own venv, the GCS emulator (`gcs`, tests/test_objstore_gcs.py) and
the stand-in Hub (`hub`, tests/test_objstore_hf.py) on loopback, and a stand-in of Google's OAuth
token endpoint on loopback that the service-account credentials below name (google-auth posts its
signed JWT there, as it would to Google's). Each stand-in notes which process asked it (the
kernel's socket table), so a test sees that the runner on the node, not only the controller,
authenticated.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from fleet.config import FleetConfig
from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_objstore import store_ids
from test_objstore_gcs import gcs  # noqa: F401  (fixture)
from test_multinode_ssh import sim_servers_up
from test_objstore_hf import REPO, Hub, hub, peer_argv  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
SA_EMAIL = "runner@fleet-test.iam.gserviceaccount.com"
HF_SECRET = "hf_nodeTOKEN_8d7c6b5a4f3e"


def service_account_file(path: Path, token_uri: str) -> str:
    """A Google service-account key file (a fresh RSA key) whose token endpoint is `token_uri`; returns
    one line of its private key's body (what must never be found anywhere else)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({"type": "service_account", "project_id": "fleet-test", "private_key_id": "k1",
                                "private_key": pem, "client_email": SA_EMAIL, "client_id": "1",
                                "token_uri": token_uri}))
    return pem.splitlines()[3]


@dataclass
class TokenServer:
    """The stand-in token endpoint: (the asking process's command line, the JWT's issuer) per request."""

    url: str
    asked: list[tuple[str, str]] = field(default_factory=list)


@pytest.fixture
def google_token() -> Iterator[TokenServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    tokens = TokenServer(f"http://127.0.0.1:{server.server_address[1]}/token")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
            claims = form.get("assertion", ["..."])[0].split(".")[1]
            iss = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)) or b"{}").get("iss", "")
            tokens.asked.append((peer_argv(self.client_address, server.server_address[1]), iss))
            body = json.dumps({"access_token": "ya29.fleet-test", "expires_in": 3600, "token_type": "Bearer"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server.RequestHandlerClass = Handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield tokens
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def gcs_signed_in(google_token: TokenServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  request: pytest.FixtureRequest) -> Iterator[tuple[str, Path, str]]:
    """The GCS emulator with GOOGLE_APPLICATION_CREDENTIALS naming a service-account file on this machine
    (set before gcsfs first connects: it then asks no metadata server): (bucket URL, the file, a line of
    its key)."""
    where = tmp_path / "controller-only"
    where.mkdir()
    key_line = service_account_file(where / "sa.json", google_token.url)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(where / "sa.json"))
    yield request.getfixturevalue("gcs"), where / "sa.json", key_line


def test_the_scheme_table_matches_the_extras_and_a_runner_gets_only_what_its_urls_need() -> None:
    """Runners on nodes got s3fs and the AWS_* variables whatever their job's URLs: a gs:// or hf:// job
    had no gcsfs / huggingface_hub and none of their credentials on the node. Now the packages and the
    variables come from one table by protocol: each protocol's packages are its extra in pyproject.toml,
    a job gets those of its own URLs only, and a local job gets none."""
    from fleet.generation.data.objstore import SCHEMES, store_env, store_env_names, store_packages

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, sch in SCHEMES.items():
        assert list(sch.packages) == extras[sch.extra], name
    assert extras["aws"] == [*extras["s3"], "prefect-aws>=0.7"] and "prefect-aws>=0.7" in extras["test"]
    assert store_packages(["/data/in.jsonl", None, "file:///x"]) == []
    assert store_packages(["s3://b/in.jsonl", "s3://b/out"]) == ["fsspec>=2024.2", "s3fs>=2024.2"]
    assert store_packages([f"hf://datasets/{REPO}/p.jsonl", "gs://b/out", "gs://b/_parts/n/c"]) == \
        ["fsspec>=2024.2", "gcsfs>=2024.2", "huggingface_hub>=0.23"]
    env = {"AWS_SECRET_ACCESS_KEY": "a", "HF_TOKEN": "h", "HF_ENDPOINT": "http://127.0.0.1:9", "STORAGE_EMULATOR_HOST": "e",
           "OTHER": "o"}
    assert store_env(["s3://b/out"], env) == {"AWS_SECRET_ACCESS_KEY": "a"}
    assert store_env([f"hf://datasets/{REPO}/p.jsonl", "gs://b/out"], env) == \
        {"HF_TOKEN": "h", "HF_ENDPOINT": "http://127.0.0.1:9", "STORAGE_EMULATOR_HOST": "e"}
    assert "GOOGLE_APPLICATION_CREDENTIALS" in store_env_names(["gs://b"]) and store_env(["/local"], env) == {}


def test_a_google_credentials_file_goes_to_a_runner_as_content_and_a_bad_one_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GOOGLE_APPLICATION_CREDENTIALS names a file on the controller's machine: handed on as a path it named
    nothing on a node (or another file). Its content goes instead, under FLEET_GCS_CREDENTIALS_JSON, and the
    path does not; a path that cannot be read, or a file that is no credentials JSON, is refused with the
    remedy before anything starts, and the error never shows the file's content."""
    from fleet.config import FleetConfig
    from fleet.errors import ConfigError
    from fleet.generation.data.objstore import GCS_CREDENTIALS_JSON, store_env
    from fleet.generation.job.validate import plan_job

    sa = tmp_path / "sa.json"
    key_line = service_account_file(sa, "http://127.0.0.1:9/token")
    env = store_env(["gs://b/out"], {"GOOGLE_APPLICATION_CREDENTIALS": str(sa)})
    assert list(env) == [GCS_CREDENTIALS_JSON] and json.loads(env[GCS_CREDENTIALS_JSON]) == json.loads(sa.read_text())
    (tmp_path / "notes.txt").write_text(f"not json {key_line}")
    cfg = FleetConfig(name="t", nodes=[{"name": "local", "workdir": str(tmp_path / "w")}], engine={"kind": "sim"})
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hi"}\n')
    for bad in (tmp_path / "missing.json", tmp_path / "notes.txt"):
        with pytest.raises(ConfigError) as e:
            store_env(["gs://b/out"], {"GOOGLE_APPLICATION_CREDENTIALS": str(bad)})
        assert str(bad) in str(e.value) and key_line not in str(e.value) and e.value.remedy
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "notes.txt"))
    with pytest.raises(ConfigError, match="not a Google credentials JSON"):
        plan_job(cfg, input=str(inp), output="gs://b/out")   # refused before bring-up, before the store is asked


def _ssh_config(tmp_path: Path, sshd, port: int) -> FleetConfig:  # type: ignore[no-untyped-def]
    node = sshd.node_config(name="remote", workdir=str(tmp_path / "rwork"), servers=1, base_port=port,
                            ramdisk=str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    return FleetConfig(
        name="objnodes", nodes=[node.model_dump(mode="json")],
        engine={"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 200, "max_running_requests": 8}},
        model={"source": "/dev/null/sim-model", "served_name": "sim-model"},
        venv={"path": sys.prefix, "use_existing": True},   # the sim server's; the runner builds its own
        servers={"ready_timeout_s": 60, "stop_grace_s": 2},
        # one chunk: each runner start over SSH costs seconds here, and one runner shows it all
        generation={"max_tokens": 8, "chunk_rows": 1000, "shard_rows": 25},
    )


@pytest.mark.ssh
@pytest.mark.timeout(900)   # a runner venv install over SSH and a 150-row job, on a shared 2-core machine
def test_ssh_node_runner_reads_hf_writes_gs_with_the_controllers_credentials(
        tmp_path: Path, sshd, gcs_signed_in: tuple[str, Path, str], hub: Hub,  # type: ignore[no-untyped-def]
        google_token: TokenServer, monkeypatch: pytest.MonkeyPatch, stop_everything) -> None:
    """Runners on SSH nodes got s3fs and AWS_* only: a job reading hf:// and writing gs:// failed there (no
    gcsfs nor huggingface_hub in the runner's venv, no HF_TOKEN/HF_ENDPOINT, and GOOGLE_APPLICATION_CREDENTIALS
    naming a file the node lacks). Now a job from hf:// to gs:// whose chunk runs on an SSH node (the
    multi-node controller that `fleet generate` runs, here without Prefect): the runner venv gets gcsfs and
    huggingface_hub (not s3fs), the runner reads its byte range from the Hub with the controller's HF_TOKEN
    and puts its commits on gs:// authenticated as the controller's service account (its key handed over as
    content: the token endpoint was asked by the runner's own process); every id ends exactly once in the
    store, and neither secret is in any file on the node or in the controller's state."""
    from fleet.generation.job.remote import RUNNER_PACKAGES
    from fleet.generation.multinode.chunks import ControllerLock
    from fleet.generation.multinode.controller import Controller, NodeWork
    from test_bringup import port_block
    from test_security import _scan_tree

    bucket, sa_file, key_line = gcs_signed_in
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    hub.peers = []
    cfg = _ssh_config(tmp_path, sshd, port_block(1))
    stop_everything(cfg)
    specs = sim_servers_up(cfg)
    inp = prompts(tmp_path / "in.jsonl", 150)
    hub.files["train/prompts.jsonl"] = inp.read_bytes()
    want = [json.loads(ln)["id"] for ln in inp.read_text().splitlines()]
    out = f"{bucket}/job"
    pdir = tmp_path / "plan"
    ctl = Controller(cfg, pdir, out, {"remote": NodeWork("remote", specs)}, poll_s=0.2)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            ctl.node_loop("remote")
        except BaseException as exc:  # the test reports it
            errors.append(exc)

    with ControllerLock(pdir):
        ctl.prepare(f"hf://datasets/{REPO}/train/prompts.jsonl")
        th = threading.Thread(target=loop, daemon=True)
        th.start()
        th.join(timeout=600)
        ctl.stop()
        assert not th.is_alive() and not errors, errors
        manifest = ctl.finalize(out)
    ids = store_ids(out)
    assert sorted(ids) == sorted(want) and len(ids) == len(set(ids)) and manifest["counts"]["completed"] == 150
    stamp = json.loads((tmp_path / "rwork" / "runner-venv" / ".fleet-venv.json").read_text())
    assert stamp["request"]["packages"] == [*RUNNER_PACKAGES, "fsspec>=2024.2", "gcsfs>=2024.2", "huggingface_hub>=0.23"]
    runner = [auth for who, auth in hub.peers if "fleet-runner.pyz" in who]
    assert runner and set(runner) == {f"Bearer {HF_SECRET}"}, hub.peers[:5]
    assert any("fleet-runner.pyz" in who and iss == SA_EMAIL for who, iss in google_token.asked), google_token.asked
    assert hub.unknown == []
    hits = _scan_tree(tmp_path, [HF_SECRET, key_line])   # the node's workdir and logs, the plan and state
    assert [h for h in hits if not h.startswith(f"{sa_file.parent}/")] == []
