"""Where a job's data lives when it is not a local directory: one small seam over fsspec.

`--input` / `--output` may be fsspec URLs (`s3://bucket/prefix`, `gs://…`, `hf://datasets/…` to
read; `file://` and plain paths as before). `Store` is the few operations the runner's
publisher and the multi-node merge need: list a directory's names, put a whole file, read and
write small files, copy one object to another. A plain path or `file://` URL gets fsspec's local
filesystem (writes there go to a temporary name, then a rename: a reader sees a whole file or
none); on object storage a PUT is atomic by itself (an object is visible only once complete).

Credentials are never passed here: each protocol's package reads its own environment (SCHEMES:
s3fs/botocore the AWS_* variables, gcsfs/google-auth GOOGLE_APPLICATION_CREDENTIALS and
STORAGE_EMULATOR_HOST, huggingface_hub HF_TOKEN and HF_ENDPOINT) or its own config files.
`store_env` gives a node's runner the variables its job's URLs need, which travel in
start_detached's 0600 env file (removed once read), never in argv, job.json or artifacts.
GOOGLE_APPLICATION_CREDENTIALS names a file on the controller's machine, which a node does not
have: its content travels instead (GCS_CREDENTIALS_JSON), and the runner builds its credentials
from that (`_gcs_credentials`); nothing of it is written on the node.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("fleet.generation.data.objstore")

__all__ = ["Store", "SCHEMES", "Scheme", "export_via_copy", "is_url", "scheme_of", "store_env", "store_env_names",
           "store_packages", "STORE_ENV", "GCS_CREDENTIALS_FILE", "GCS_CREDENTIALS_JSON"]


@dataclass(frozen=True)
class Scheme:
    """What a protocol needs where a runner uses it: its extra (pyproject.toml), the packages a node's
    runner venv adds, and the environment variables (by name) the runner is given."""

    extra: str
    packages: tuple[str, ...]
    env: tuple[str, ...]


# GOOGLE_APPLICATION_CREDENTIALS is a path on the controller's machine: its content goes to a runner
# under GCS_CREDENTIALS_JSON (store_env), never the path, and never a copy of the file on the node.
GCS_CREDENTIALS_FILE = "GOOGLE_APPLICATION_CREDENTIALS"
GCS_CREDENTIALS_JSON = "FLEET_GCS_CREDENTIALS_JSON"
_GCS_CREDENTIALS_MAX = 64 * 1024   # a service-account key is ~2.4 KB; anything far larger is not one

_S3 = Scheme("s3", ("s3fs>=2024.2",),
             # botocore's names; AWS_ENDPOINT_URL names an S3-compatible server other than AWS (a local one in tests)
             ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
              "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"))
_GS = Scheme("gs", ("gcsfs>=2024.2",),
             # STORAGE_EMULATOR_HOST: a GCS emulator (tests); GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT: gcsfs's bucket-type
             # probe speaks gRPC, which an emulator does not (a minute lost per bucket)
             (GCS_CREDENTIALS_FILE, "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "GCSFS_DEFAULT_PROJECT",
              "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"))
_HF = Scheme("hf", ("huggingface_hub>=0.23",),
             ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_DISABLE_TELEMETRY"))
SCHEMES: dict[str, Scheme] = {"s3": _S3, "s3a": _S3, "gs": _GS, "gcs": _GS, "hf": _HF}
# Every name a store's credentials may come under (a FLEET_STORE_SECRET block holds some of them; a
# FLEET_STORE_AWS_BLOCK block gives AWS_* ones: blocks/credentials.py).
STORE_ENV = tuple(dict.fromkeys(k for sch in SCHEMES.values() for k in sch.env))


def is_url(path: str) -> bool:
    """A location on object storage (or any fsspec filesystem but the local one)."""
    return "://" in path and not path.startswith("file://")


def scheme_of(url: str) -> str | None:
    """The protocol of a URL (`s3`, `gs`, `hf`, …); None for a local path or `file://`."""
    return url.split("://", 1)[0] if is_url(url) else None


def _schemes(urls: Iterable[str | None]) -> list[Scheme]:
    found = [SCHEMES[p] for p in (scheme_of(u) for u in urls if u) if p in SCHEMES]
    return list(dict.fromkeys(found))


def store_packages(urls: Iterable[str | None]) -> list[str]:
    """The packages a runner venv adds for a job that reads or writes these URLs (none for local paths)."""
    pkgs = [p for sch in _schemes(urls) for p in sch.packages]
    return ["fsspec>=2024.2", *sorted(set(pkgs))] if pkgs else []


def store_env_names(urls: Iterable[str | None]) -> list[str]:
    """The environment variables a runner for these URLs is given, by name (GCS_CREDENTIALS_FILE stands
    for its content, GCS_CREDENTIALS_JSON)."""
    return [k for sch in _schemes(urls) for k in sch.env]


def store_env(urls: Iterable[str | None], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of this process's environment that a runner for these URLs needs, for its env
    file: only the names its schemes list, and for GOOGLE_APPLICATION_CREDENTIALS the file's content
    (GCS_CREDENTIALS_JSON), read here. ConfigError, never echoing the file, when it is not a credentials
    JSON file."""
    env = os.environ if environ is None else environ
    out = {k: env[k] for k in store_env_names(urls) if env.get(k)}
    path = out.pop(GCS_CREDENTIALS_FILE, None)
    if path:
        out[GCS_CREDENTIALS_JSON] = _credentials_json(path)
    return out


def _credentials_json(path: str) -> str:
    """The content of a Google credentials file, checked to be one (a JSON object with a `type`)."""
    from fleet.errors import ConfigError

    remedy = (f"point {GCS_CREDENTIALS_FILE} at a service-account or application-default credentials JSON "
              "file on this machine, or unset it to let each node use its own default credentials")
    try:
        with open(path, "rb") as f:
            raw = f.read(_GCS_CREDENTIALS_MAX + 1)
    except OSError as exc:
        raise ConfigError(f"{GCS_CREDENTIALS_FILE} names {path}, which cannot be read: {exc.strerror}",
                          remedy=remedy) from None
    try:
        info = json.loads(raw) if len(raw) <= _GCS_CREDENTIALS_MAX else None
    except ValueError:
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("type"), str):
        raise ConfigError(f"{GCS_CREDENTIALS_FILE} names {path}, which is not a Google credentials JSON file "
                          f"(an object with a \"type\", at most {_GCS_CREDENTIALS_MAX // 1024} KB)", remedy=remedy)
    return json.dumps(info, separators=(",", ":"))


@lru_cache(maxsize=4)
def _gcs_credentials(text: str) -> Any:
    """google-auth credentials from GCS_CREDENTIALS_JSON (every type a credentials file may hold), one
    object per process: fsspec caches a filesystem by its arguments, and a new object each time would
    mean a new filesystem and a new token request for every Store."""
    import google.auth

    creds, _ = google.auth.load_credentials_from_dict(  # type: ignore[no-untyped-call]  # google-auth's own annotation gap
        json.loads(text), scopes=["https://www.googleapis.com/auth/devstorage.full_control"])
    return creds


def _options(protocol: str) -> dict[str, Any]:
    """Options from the environment that fsspec does not read itself: an S3 endpoint (s3fs takes
    the endpoint as a client argument; some botocore versions ignore AWS_ENDPOINT_URL there), and a
    runner's GCS credentials handed over as content (GCS_CREDENTIALS_JSON)."""
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"client_kwargs": {"endpoint_url": endpoint}}
    if protocol in ("gs", "gcs") and os.environ.get(GCS_CREDENTIALS_JSON):   # a runner given the controller's file
        return {"token": _gcs_credentials(os.environ[GCS_CREDENTIALS_JSON])}
    return {}


class Store:
    """One directory tree, local or on object storage, named by a path or URL (`root`)."""

    def __init__(self, root: str) -> None:
        import fsspec

        self.root = root.rstrip("/")
        protocol = root.split("://", 1)[0] if "://" in root else "file"
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.root, **_options(protocol))
        except ImportError as exc:   # fsspec knows the protocol but its package is not installed here
            from fleet.errors import InputError

            sch = SCHEMES.get(protocol)
            raise InputError(f"{root}: {exc}", remedy=f"pip install 'fleet[{sch.extra}]'" if sch else
                             "install the fsspec package for this protocol") from exc
        self.local = protocol == "file"

    def url(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def child(self, *parts: str) -> Store:
        return Store(self.url(*parts))

    def _p(self, rel: str) -> str:
        return posixpath.join(self.path, rel) if rel else self.path

    def names(self, rel: str = "") -> list[str]:
        """The names directly under `rel` (none when it does not exist), fresh (no listing cache)."""
        p = self._p(rel)
        self.fs.invalidate_cache(p)
        try:
            return sorted(posixpath.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))
        except FileNotFoundError:
            return []

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self._p(rel))
        return bool(self.fs.exists(self._p(rel)))

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            with self.fs.open(self._p(rel), "rb") as f:
                data: bytes = f.read()
                return data
        except FileNotFoundError:
            return None

    @contextmanager
    def open_read(self, rel: str) -> Iterator[IO[bytes]]:
        with self.fs.open(self._p(rel), "rb") as f:
            yield f

    @contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A file that appears at `rel` whole when the block ends without an error, else not at all."""
        p = self._p(rel)
        if self.local:
            self.fs.makedirs(posixpath.dirname(p), exist_ok=True)
            tmp = f"{p}.tmp"
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            return
        f = self.fs.open(p, "wb")
        try:
            yield f
        except BaseException:
            discard = getattr(f, "discard", None)   # an unfinished upload never becomes the object
            if discard is not None:
                try:
                    discard()
                except Exception as exc:   # never finalized, the upload is no object anyway (GCS's expires);
                    log.warning("could not abort the upload of %s: %s", p, exc)   # the first error is the one
                f.closed = True   # nothing left to close: its __del__ must not finish the upload
            raise
        f.close()

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel) as f:
            f.write(data)

    def remove_tree(self) -> int:
        """Every object under this directory removed; how many."""
        self.fs.invalidate_cache(self.path)
        found = self.fs.find(self.path)
        for path in found:
            self.fs.rm(path)
        return len(found)

    def put_file(self, local: str, rel: str) -> None:
        """Upload a whole local file to `rel` (visible only once complete)."""
        with open(local, "rb") as src, self.open_write(rel) as dst:
            while block := src.read(1 << 22):
                dst.write(block)

    def get_file(self, rel: str, local: str) -> None:
        """Download `rel` to `local` (a temporary name, then a rename)."""
        tmp = f"{local}.tmp"
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        with self.open_read(rel) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
        os.replace(tmp, local)

    def copy_from(self, src: Store, rel_src: str, rel: str) -> None:
        """Copy a file of `src` to `rel` here: server-side within one filesystem, else streamed."""
        if type(src.fs) is type(self.fs) and not self.local:
            self.fs.copy(src._p(rel_src), self._p(rel))
            return
        with src.open_read(rel_src) as f, self.open_write(rel) as g:
            while block := f.read(1 << 22):
                g.write(block)


def export_via_copy(src: str, dest: str, export: Callable[[str, str], T]) -> T:
    """`fleet export` where the output directory or the destination is on object storage: the output
    read through a temporary local copy (shards, record files, manifest), the export written to a
    local file, then put at `dest` when that is a URL — with every side file the export wrote beside
    it (DEST_flagged.jsonl, DEST_error.jsonl, DEST_skipped.jsonl). Returns what `export` returned."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleet-export-") as tmp:
        local = src
        if is_url(src):
            store, local = Store(src), os.path.join(tmp, "output")
            for name in store.names("shards"):
                store.get_file(f"shards/{name}", os.path.join(local, "shards", name))
            for name in ("manifest.json", "errors.jsonl", "rejects.jsonl", "quality_rejects.jsonl"):
                if store.exists(name):
                    store.get_file(name, os.path.join(local, name))
        if not is_url(dest):
            return export(local, dest)
        parent, _, name = dest.rstrip("/").rpartition("/")
        written = os.path.join(tmp, "written")
        os.makedirs(written)
        result = export(local, os.path.join(written, name))
        for f in sorted(os.listdir(written)):
            Store(parent).put_file(os.path.join(written, f), f)
        return result
