"""Where a job's data lives when it is not a local directory: one small seam over fsspec.

`--input` / `--output` may be fsspec URLs (`s3://bucket/prefix`, `gs://…`, `hf://datasets/…` to
read; `file://` and plain paths as before). `Store` is the few operations the runner's
publisher and the multi-node merge need: list a directory's names, put a whole file, read and
write small files, copy one object to another. A plain path or `file://` URL gets fsspec's local
filesystem (writes there go to a temporary name, then a rename: a reader sees a whole file or
none); on object storage a PUT is atomic by itself (an object is visible only once complete).

Credentials are never passed here: s3fs (botocore) reads the standard AWS_* environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL) or
its own config files; `store_env` names the variables the runner on a node needs, which travel
in start_detached's 0600 env file, never in argv, job.json or artifacts.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("fleet.generation.data.objstore")

__all__ = ["Store", "export_via_copy", "is_url", "store_env", "STORE_ENV", "STORE_PACKAGES"]

# The environment a node's runner needs to reach the store (botocore's names; AWS_ENDPOINT_URL is
# how an S3-compatible server other than AWS is named, e.g. a local one in the tests).
STORE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
             "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE")
# What the runner's venv on a node adds when its job reads or writes object storage.
STORE_PACKAGES = ["fsspec>=2024.2", "s3fs>=2024.2"]


# The extra (pyproject.toml) that brings each protocol's fsspec package.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "hf": "hf"}


def is_url(path: str) -> bool:
    """A location on object storage (or any fsspec filesystem but the local one)."""
    return "://" in path and not path.startswith("file://")


def store_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The store's credentials and endpoint from this process's environment, for a runner's env file."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in STORE_ENV if env.get(k)}


def _options(protocol: str) -> dict[str, Any]:
    """Options from the environment that fsspec does not read itself: an S3 endpoint (s3fs takes
    the endpoint as a client argument; some botocore versions ignore AWS_ENDPOINT_URL there)."""
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"client_kwargs": {"endpoint_url": endpoint}}
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

            extra = _EXTRAS.get(protocol)
            raise InputError(f"{root}: {exc}", remedy=f"pip install 'fleet[{extra}]'" if extra else
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
