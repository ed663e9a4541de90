"""Why a job failed, in one line with its remedy (`Failure`, from any exception by `classify`),
and what keeps the last word writable: a little disk space set aside (`reserve_space`), the
store guarded so its first failing write becomes the job's failure (`GuardedStore`), and
`<job dir>/exit.json` (`write_exit`)."""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.generation.data.durable import write_json_atomic

__all__ = ["Failure", "GuardedStore", "OutputRemoved", "RESERVE_BYTES", "RESERVE_FILE", "classify",
           "reserve_space", "write_exit"]

log = logging.getLogger("fleet.generation")

RESERVE_FILE = ".reserve.tmp"    # a little space set aside so a full disk still gets its manifest
RESERVE_BYTES = 512 * 1024
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class Failure:
    """Why a job stopped failed: what progress.json, the manifest and exit.json say, and the CLI prints."""

    kind: str            # disk_full | output_removed | output_unwritable | input | input_changed | store | conflict |
                         # servers | fenced | internal
    cause: str           # one line: what failed, where (file, line, byte)
    remedy: str          # one line: what to do, then "run the same command again to resume"
    file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class OutputRemoved(OSError):
    """The output directory is gone (or replaced by another) under the running job."""


def _os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _target(path: str | None) -> str | None:
    """The file a temp file stands for: .progress.json.123.tmp -> progress.json, part-1.parquet.tmp -> part-1.parquet."""
    if not path:
        return path
    p = Path(path)
    name = p.name
    if name.endswith(".tmp"):
        name = name[:-4]
        if name.startswith("."):
            name = name[1:].rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].isdigit() else name[1:]
    return str(p.with_name(name))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def classify(exc: BaseException, out: Path, *, committed: int | None = None) -> Failure:
    """Turn any exception of a runner task into a Failure with its cause and remedy."""
    from fleet.errors import Fenced, FleetError, InputChanged, InputError, JobConflict, StoreError

    resume = "then run the same command again to resume" + (
        f": the {committed:,} committed rows are kept" if committed else ": committed rows are kept")
    if isinstance(exc, Fenced):   # a late attempt of a job that ended: nothing to resume
        return Failure("fenced", exc.reason, exc.remedy or "nothing: the job ended without this attempt")
    if isinstance(exc, InputChanged):   # not a broken input a repaired copy may continue: another version
        return Failure("input_changed", exc.reason, exc.remedy or "start a new job into a new --output")
    if isinstance(exc, StoreError):
        return Failure("store", exc.reason, exc.remedy or f"fix the store's access, {resume}")
    if isinstance(exc, InputError):
        return Failure("input", exc.reason, exc.remedy or "fix the input, then run the same command again")
    if isinstance(exc, JobConflict):
        return Failure("conflict", exc.reason, exc.remedy or "give this job its own --output")
    oserr = _os_error(exc)
    path = _target(getattr(exc, "path", None) or (oserr.filename if oserr is not None else None))
    if isinstance(oserr, OutputRemoved) or (oserr is not None and not out.is_dir()):
        return Failure("output_removed", f"output directory {out} was removed while the job ran",
                       f"run the same command again: the job starts over in a new {out} (the rows of the "
                       "removed directory are gone)", str(out))
    text = f"{exc} {oserr or ''}"
    if oserr is not None and (oserr.errno in _DISK_FULL or "No space left" in text or "errno 28" in text.lower()):
        try:
            st = os.statvfs(out)
            free = f"{_fmt_bytes(st.f_bavail * st.f_frsize)} free of {_fmt_bytes(st.f_blocks * st.f_frsize)}"
        except OSError:
            free = "free space unknown"
        return Failure("disk_full", f"disk full: no space left on device writing {path or out} ({free} on the "
                                    f"filesystem of {out})",
                       f"free space there (`df -h {out}`), {resume}; rows not committed are generated again",
                       path)
    if oserr is not None and oserr.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return Failure("output_unwritable", f"cannot write {path or out}: {oserr.strerror}",
                       f"make {out} writable (or pick another --output), {resume}", path)
    if oserr is not None:
        return Failure("output_unwritable", f"writing {path or out} failed: {oserr.strerror or oserr}",
                       f"fix the output filesystem, {resume}", path)
    if isinstance(exc, FleetError):
        return Failure("internal", exc.reason, exc.remedy or f"read the runner's log, {resume}")
    return Failure("internal", f"runner error: {type(exc).__name__}: {exc}"[:500],
                   f"a bug: the traceback is in the runner's log; {resume}")


def reserve_space(out: Path) -> Path | None:
    """Set RESERVE_BYTES aside in the output directory (OSError: the disk is already full)."""
    path = out / RESERVE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None   # a filesystem without fallocate: no reserve, the rest still works
        exc.filename = str(out / "shards")
        raise
    os.close(fd)
    return path


def write_exit(path: Path | None, pid: int, rc: int, state: str, failure: Failure | None,
               extra: dict[str, Any] | None = None) -> None:
    """<job dir>/exit.json: the runner's last word, outside the output directory (which may be full or gone)."""
    if path is None:
        return
    try:
        write_json_atomic(path, {"pid": pid, "rc": rc, "state": state, "at": time.time(),
                                 "failure": failure.as_dict() if failure else None, **(extra or {})}, sync=False)
    except OSError as exc:
        log.error("cannot write %s: %s", path, exc)


class GuardedStore:
    """The store as the dispatcher sees it: any write that raises is recorded as the job's failure."""

    def __init__(self, store: Any, on_error: Any) -> None:
        self._store = store
        self._on_error = on_error

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        try:
            return getattr(self._store, name)(*args, **kw)
        except Exception as exc:
            self._on_error(exc)
            raise

    def add_result(self, row: dict[str, Any]) -> Any:
        return self._call("add_result", row)

    def add_error(self, id: str, **kw: Any) -> Any:
        return self._call("add_error", id, **kw)

    def add_reject(self, reject: Any) -> Any:
        return self._call("add_reject", reject)

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], **kw: Any) -> Any:
        return self._call("add_quality_reject", row, reasons, **kw)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
