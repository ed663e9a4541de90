"""The version of a job's input, pinned when the job is planned and checked on every read after.

A job's chunks are byte (or row) ranges of its input, read by runners minutes or days after the
plan was cut. An input rewritten in between gave a mixed output reported complete: rows of the old
version in the first chunks, half-lines at the old offsets and foreign ids in the later ones. So the
plan records what identifies the version it was cut from (`pin_of`), every read of a range asks for
that version where the store can serve one (`source`), and checks after the read that the version is
still the one read (`check`), whatever the store:

- S3: `VersionId` where the bucket versions (the range is read from that version: a rewrite after
  the plan changes nothing; the version deleted stops the job), else the `ETag`;
- GCS: the object's `generation` (a new one on every write);
- the Hub (`hf://`): the repository's commit at plan time (ranges read `repo@<commit>/path`) and
  the file's blob id (a git object id: its content's hash);
- a local file: size, modification time and inode.

Why a check after the read suffices where the store cannot serve a version: every identity above
changes on every write, or is derived from the content (an ETag, a blob id), so the same identity
after the read means the bytes read were that version's (stores are read-after-write consistent).

A check that fails raises `InputChanged` with one line: what the version was, what is there now,
and the remedy (a new job into a new --output, or the version restored).
"""

from __future__ import annotations

import os
from typing import Any

from fleet.errors import InputChanged

__all__ = ["IDENTITY", "changed", "check", "check_local", "pin_of", "source"]

# the keys of a pin that say which version it is (the others say where: path, revision)
IDENTITY = ("version_id", "etag", "generation", "blob_id", "size", "mtime_ns", "ino")
REMEDY = "start a new job into a new --output, or restore the version the job was planned on"


def _split(url: str) -> tuple[Any, str]:
    from fleet.generation.data.objstore import Store

    parent, _, name = url.rstrip("/").rpartition("/")
    store = Store(parent)
    return store.fs, store._p(name)


def _hf_commit(fs: Any, path: str) -> str | None:
    """The commit the Hub's repository is at now (the revision a pinned read names)."""
    resolved = fs.resolve_path(path)
    info = fs._api.repo_info(resolved.repo_id, repo_type=resolved.repo_type, revision=resolved.revision)
    sha: str | None = getattr(info, "sha", None)
    return sha


def _identity(info: dict[str, Any]) -> dict[str, Any]:
    """What a store's `info()` says of an object's version."""
    out: dict[str, Any] = {"size": int(info.get("size") or 0)}
    if info.get("VersionId") not in (None, "", "null"):
        out["version_id"] = info["VersionId"]
    for key, name in (("ETag", "etag"), ("generation", "generation"), ("blob_id", "blob_id")):
        if info.get(key) not in (None, ""):
            out[name] = str(info[key])
    return out


def pin_of(url: str) -> dict[str, Any]:
    """The version of the input at `url` (a store URL or a local path) now: see the module docstring.

    `mtime_ns` of a URL is the stamp plans recorded before the pin (ETag, else modification time, else
    blob id): kept so a plan cut by an older fleet is still compared on what it recorded."""
    from fleet.generation.data.objstore import is_url

    if not is_url(url):
        path = url[len("file://"):] if url.startswith("file://") else url
        st = os.stat(path)
        return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    fs, path = _split(url)
    fs.invalidate_cache(path)
    info = fs.info(path)
    pin: dict[str, Any] = {"path": url, **_identity(info)}
    pin["mtime_ns"] = str(info.get("ETag") or info.get("LastModified") or info.get("mtime") or info.get("blob_id"))
    if url.startswith("hf://"):
        commit = _hf_commit(fs, path)
        if commit:
            pin["revision"] = commit
    return pin


def source(url: str, pin: dict[str, Any] | None) -> tuple[Any, str, dict[str, Any]]:
    """(filesystem, path, keyword arguments of `open`/`cat_file`) that read the pinned version of `url`
    where the store serves versions (a versioned S3 bucket, a Hub commit), else its current object."""
    if pin and pin.get("version_id") and url.split("://", 1)[0] in ("s3", "s3a"):
        import fsspec

        from fleet.generation.data.objstore import _options

        fs = fsspec.filesystem("s3", version_aware=True, **_options("s3"))
        return fs, url.split("://", 1)[1], {"version_id": pin["version_id"]}
    if pin and pin.get("revision") and url.startswith("hf://"):
        fs, path = _split(url)
        resolved = fs.resolve_path(path)
        from huggingface_hub import constants

        repo = constants.REPO_TYPES_URL_PREFIXES.get(resolved.repo_type, "") + resolved.repo_id
        return fs, f"{repo}@{pin['revision']}/{resolved.path_in_repo}", {}
    fs, path = _split(url)
    return fs, path, {}


def _describe(pin: dict[str, Any] | None) -> str:
    if not pin:
        return "gone"
    keys = [k for k in IDENTITY if k in pin and not (k == "mtime_ns" and "ino" not in pin)]
    return ", ".join(f"{k} {pin[k]}" for k in keys)


def changed(url: str, pin: dict[str, Any], now: dict[str, Any] | None) -> InputChanged:
    """The error of an input whose pinned version is not there: one line, the remedy."""
    return InputChanged(f"the input changed since the job was planned: {url} was {_describe(pin)}, "
                        f"now {_describe(now)}", remedy=REMEDY, path=url)


def _same(pin: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether `now` is the pinned version: on every identity key both hold (a plan from before a key was
    recorded is compared on the ones it has)."""
    keys = [k for k in IDENTITY if k in pin and k in now]
    return bool(keys) and all(str(pin[k]) == str(now[k]) for k in keys)


def check(url: str, pin: dict[str, Any] | None) -> None:
    """InputChanged unless the pinned version of `url` is what a read of it returns (module docstring)."""
    from fleet.generation.data.objstore import is_url

    if not pin:
        return
    if not is_url(url):
        check_local(url, pin)
        return
    fs, path, kw = source(url, pin)
    try:
        fs.invalidate_cache(path)
        info = fs.info(path, **kw)
    except FileNotFoundError:
        raise changed(url, pin, None) from None
    except (OSError, ValueError) as exc:   # a version id the store no longer knows: botocore says 400/404
        if kw and ("version" in str(exc).lower() or "NoSuchVersion" in str(exc)):
            raise changed(url, pin, None) from None
        raise
    now = _identity(info)
    if "mtime_ns" in pin and not any(k in pin for k in IDENTITY[:4]):   # a plan from before the pin
        now["mtime_ns"] = str(info.get("ETag") or info.get("LastModified") or info.get("mtime")
                              or info.get("blob_id"))
    if not _same(pin, now):
        raise changed(url, pin, now)


def check_local(path: str, pin: dict[str, Any], st: os.stat_result | None = None) -> None:
    """InputChanged unless the local file (or the open file whose `fstat` is `st`) is the pinned one."""
    try:
        st = st or os.stat(path)
    except FileNotFoundError:
        raise changed(path, pin, None) from None
    now = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    if not _same(pin, now):
        raise changed(path, pin, now)
