"""Every store error is one line with its cause and remedy, never a traceback, never the secret.

Before anything starts (`fleet generate` exits 2): no credentials (botocore's NoCredentialsError
traceback, exit 1, before), a wrong secret (a raw "PermissionError: Forbidden" traceback, exit 1,
before), an input or an output bucket that does not exist, an output that cannot be written (a test
object is put and removed at plan time). Mid-job: the output bucket deleted under a running job (the
controller died on an unhandled FileNotFoundError with 7 tracebacks, before) ends as a Failed run with
the cause and the remedy.

The refusals are real S3 answers: moto's server on loopback for a missing bucket, and for a refused
signature or a refused PUT a stand-in on loopback that answers as S3 does (403 with S3's XML error
body), in front of moto (`Refusing`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_multinode import _cli, _wait, plan_state, state_home  # noqa: F401
from test_objstore import SECRET, s3  # noqa: F401  (fixture)
from test_objstore_pin import one_node


@dataclass
class Refusing:
    """A stand-in S3 endpoint in front of moto: `refuse` maps an HTTP method to the S3 error code it answers
    with 403 (every method when "*" is in it); anything else is forwarded to moto as it is."""

    url: str
    refuse: dict[str, str]


@pytest.fixture
def refusing(s3: str) -> Iterator[Refusing]:
    upstream = os.environ["AWS_ENDPOINT_URL"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    front = Refusing(f"http://127.0.0.1:{server.server_address[1]}", {})

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code = front.refuse.get(self.command) or front.refuse.get("*")
            if code:
                data = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{code}'
                        f'</Message><RequestId>1</RequestId></Error>').encode()
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return
            req = urllib.request.Request(upstream + self.path, data=body or None, method=self.command,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            try:
                resp = urllib.request.urlopen(req, timeout=30)
                status, headers, data = resp.status, resp.headers, resp.read()
            except urllib.error.HTTPError as exc:
                status, headers, data = exc.code, exc.headers, exc.read()
            self.send_response(status)
            for k, v in headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    server.RequestHandlerClass = Handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()


def _generate(tmp_path: Path, inp: str, out: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`fleet generate` with this environment (plus `env`; a value None removes it): (exit code, output)."""
    cfg = one_node(tmp_path)
    log = tmp_path / "gen.log"
    saved = dict(os.environ)
    try:
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc = _cli(cfg, tmp_path, inp, out, log)   # type: ignore[arg-type]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, log.read_text(errors="replace")


def _one_line(rc: int, text: str, *want: str) -> None:
    assert rc == 2, text[-3000:]
    assert "Traceback" not in text and SECRET not in text, text[-3000:]
    line = [ln for ln in text.splitlines() if ln.startswith(("fleet generate:", "fleet: error:"))]
    assert line and all(w in line[-1] for w in want), text[-3000:]
    assert " — " in line[-1]   # a remedy after the cause


def test_store_errors_before_anything_starts_are_one_line_exit_2(tmp_path: Path, s3: str, refusing: Refusing) -> None:
    """No credentials, a wrong secret, a missing input or output bucket, an output the credentials may not
    write: `fleet generate` exits 2 with one line (cause — remedy), no traceback, no secret."""
    from fleet.generation.data.objstore import Store

    Store(s3).put_file(str(prompts(tmp_path / "in.jsonl", 5)), "in/p.jsonl")
    inp = f"{s3}/in/p.jsonl"
    no_creds = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None,
                "AWS_PROFILE": None, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true"}
    rc, text = _generate(tmp_path, inp, f"{s3}/out", no_creds)
    _one_line(rc, text, "no credentials", inp)
    refusing.refuse = {"*": "SignatureDoesNotMatch"}
    rc, text = _generate(tmp_path, inp, f"{s3}/out", {"AWS_ENDPOINT_URL": refusing.url})
    _one_line(rc, text, "refused the credentials", inp)
    refusing.refuse = {"PUT": "AccessDenied"}   # reads allowed, writes refused
    rc, text = _generate(tmp_path, inp, f"{s3}/out", {"AWS_ENDPOINT_URL": refusing.url})
    _one_line(rc, text, "permission denied", f"{s3}/out", "permission to write")
    rc, text = _generate(tmp_path, inp, "s3://no-such-bucket/out")
    _one_line(rc, text, "bucket s3://no-such-bucket does not exist")
    rc, text = _generate(tmp_path, "s3://no-such-bucket/in.jsonl", f"{s3}/out")
    _one_line(rc, text, "s3://no-such-bucket/in.jsonl", "does not exist")
    assert not [n for n in Store(s3).names() if n.startswith("_fleet-write-test")] and \
        not [n for n in Store(f"{s3}/out").names() if n.startswith("_fleet-write-test")]   # the test write removed


@pytest.mark.timeout(600)
def test_output_bucket_deleted_mid_job_is_a_failed_run_with_its_remedy(tmp_path: Path, state_home: Path, s3: str,
                                                                       stop_everything) -> None:
    """The output bucket deleted while the job runs: the run ends Failed with the store's cause and a remedy
    in one line, the controller raises nothing unhandled (no traceback anywhere in the command's output)."""
    from fleet.generation.data.objstore import Store

    cfg = one_node(tmp_path)
    stop_everything(cfg)
    fs = Store(s3).fs
    fs.mkdir("outb")
    out = "s3://outb/job"
    log = tmp_path / "gen.log"
    proc = _cli(cfg, tmp_path, prompts(tmp_path / "in.jsonl", 200), out, log)   # type: ignore[arg-type]
    try:
        def first_part() -> bool:
            parts = Store(f"{out}/_parts/local").names()
            return plan_state(state_home) is not None and \
                any(Store(f"{out}/_parts/local/{p}").names("shards") for p in parts)

        _wait(proc, log, first_part, "the first shard in the store", timeout=300)
        import time

        deadline = time.monotonic() + 60
        while True:   # the runner writes on meanwhile: objects first, then the bucket, until it is gone
            try:
                fs.invalidate_cache()
                fs.rm(fs.find("outb") or [])
                fs.rmdir("outb")
                break
            except OSError:
                assert time.monotonic() < deadline, "could not delete the output bucket"
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc != 0 and "Traceback" not in text, text[-6000:]
    line = [ln for ln in text.splitlines() if ln.startswith("fleet generate: FAILED:")]
    assert line and "s3://outb" in line[-1] and "does not exist" in line[-1] and " — " in line[-1], text[-3000:]
    assert json.dumps(text).count("FileNotFoundError") == 0, text[-3000:]


def test_store_error_names_the_cause_and_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The translation itself (pure): each store error of the three packages becomes its one line with a
    remedy, a secret that an error's text happens to hold is masked, and a bug (a plain KeyError) or one of
    fleet's own errors is left as it is."""
    from botocore.exceptions import NoCredentialsError

    from fleet.errors import InputChanged, StoreError
    from fleet.generation.data.storeerrors import store_error, translated

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    url = "s3://b/in.jsonl"
    cases = [(NoCredentialsError(), "no credentials"),
             (PermissionError(f"SignatureDoesNotMatch: the signature of {SECRET} is wrong"), "refused the credentials"),
             (PermissionError("AccessDenied"), "permission denied"),
             (PermissionError("Forbidden"), "wrong credentials, or no permission"),
             (FileNotFoundError("The specified bucket does not exist"), "the bucket s3://b does not exist"),
             (FileNotFoundError("b/in.jsonl"), "not found"),
             (OSError("connection reset"), "OSError: connection reset")]
    for exc, want in cases:
        err = store_error(exc, url, "reading")
        assert isinstance(err, StoreError) and want in err.reason and err.remedy, (exc, err)
        assert SECRET not in err.one_line() and "\n" not in err.one_line()
    assert store_error(KeyError("x"), url, "reading") is None
    changed = InputChanged("the input changed")
    assert store_error(changed, url, "reading") is None
    with pytest.raises(InputChanged):
        with translated(url, "reading"):
            raise changed
    with pytest.raises(StoreError, match="bucket s3://b does not exist.*") as info:
        with translated(url, "writing"):
            raise FileNotFoundError("NoSuchBucket")
    assert "run the same command again" in (info.value.remedy or "")


def test_a_pin_is_compared_on_the_keys_both_sides_hold(tmp_path: Path) -> None:
    """The pin of a local file is its size, mtime and inode; a rewrite in place changes it, a plan from
    before the pin (size and mtime only) is compared on those, and the error is the one line with the remedy."""
    from fleet.errors import InputChanged
    from fleet.generation.data.pin import check, check_local, pin_of

    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"id": "a"}\n')
    pin = pin_of(str(f))
    assert set(pin) == {"path", "size", "mtime_ns", "ino"}
    check(str(f), pin)
    check_local(str(f), {k: pin[k] for k in ("size", "mtime_ns")})   # an older plan's keys
    os.utime(f, ns=(pin["mtime_ns"] + 10**9, pin["mtime_ns"] + 10**9))
    with pytest.raises(InputChanged) as info:
        check(str(f), pin)
    assert info.value.one_line().startswith("the input changed since the job was planned: ") and \
        "start a new job into a new --output" in info.value.one_line()
    f.unlink()
    with pytest.raises(InputChanged, match="now gone"):
        check(str(f), pin)
