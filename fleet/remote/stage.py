#!/usr/bin/env python3
"""Stage a model directory into a RAM disk, once per node (standard library only).

fleet uploads this file to the node and runs it with the node's bare ``python3``
(3.8 or newer); nothing here may import beyond the standard library.

    python3 stage.py --src DIR (--dst DIR | --ramdisk DIR --fleet NAME) --streams N [--verify] [--plan-only]
                     [--max-mb-s R]

With ``--ramdisk R --fleet F`` the destination is this user's and this fleet's own
``R/fleet-<uid>/F/<source directory name>-<key>`` (`destination`): the key is a digest of the
source's real path and every file's path, size and mtime, so two fleets or two users never share
(and never rewrite) one copy, and a changed source is a new copy beside the one live servers may
still map. ``R/fleet-<uid>`` and ``R/fleet-<uid>/F`` are created mode 0700 and must belong to
this user (another user's directory there is refused, never written into).

The manifest ``DST/.fleet-stage.json`` is the single source of truth for the copy:

* It is rewritten with ``"complete": false`` before the first byte changes in DST and
  only says ``"complete": true`` once every file is in place, so a copy killed half-way is
  never mistaken for a finished one (readers check ``complete``).
* Each entry names a file that is fully in place: every file is written to
  ``NAME.fleet-part``, fsync'd and renamed, and only then entered. While copying, the
  incomplete manifest is refreshed every few seconds, so a re-run after a kill keeps what
  was already finished and copies only the rest.
* A file is skipped when DST holds it with the size the manifest recorded and the manifest
  recorded the source's current size and mtime_ns (and, with --verify, when the SHA-256
  of the staged copy matches the source). Everything else in DST (stale files, leftover
  ``*.fleet-part``) is removed.

Exit codes (the EXIT_* names below): 0 done; 2 bad source or arguments; 3 not enough space
in DST (the partial copy stays marked incomplete); 4 an I/O error while reading or writing;
130 interrupted; 1 a bug (traceback). One JSON object is printed on stdout at the end;
progress goes to stderr every ~2 s, each line starting with LOG_PREFIX.

One file on purpose: it is uploaded and run as it is, so it cannot import its own helpers.
`stage` runs the named steps in order: destination -> lock_dst -> seed (--ramdisk) -> plan ->
clear_stale -> reverify (--verify) -> check_room -> copy_todo -> finish_copy.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

MANIFEST = ".fleet-stage.json"
LOCK = ".fleet-stage.lock"
PART = ".fleet-part"
FORMAT = 1
# Files are split into chunks copied by different streams, so a model of a few huge
# shards still uses every stream; slices bound the time between progress/abort checks.
CHUNK = 256 * 2**20
SLICE = 16 * 2**20
PROGRESS_S = 2.0
MANIFEST_FLUSH_S = 5.0

# The exit codes and the lines fleet reads back (fleet/staging.py imports these names; this
# file stays importable there because it uses only the standard library).
EXIT_BUG = 1  # with a traceback
EXIT_USAGE = 2
EXIT_NOSPACE = 3
EXIT_IO = 4
EXIT_INTERRUPTED = 130
LOG_PREFIX = "fleet-stage: "  # every stderr line
ERROR_MARK = "error: "  # the line that says why it failed


class StageError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def log(msg: str) -> None:
    sys.stderr.write(LOG_PREFIX + msg + "\n")
    sys.stderr.flush()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0
    return str(n)


# -- looking at the source and the destination ------------------------------------------

class SrcFile:
    __slots__ = ("rel", "path", "size", "mtime_ns", "mode", "via_symlink")

    def __init__(self, rel: str, path: str, st: os.stat_result, via_symlink: bool) -> None:
        self.rel = rel
        self.path = path
        self.size = st.st_size
        self.mtime_ns = st.st_mtime_ns
        self.mode = stat.S_IMODE(st.st_mode)
        self.via_symlink = via_symlink


def walk_source(src: str) -> tuple[dict[str, SrcFile], list[str], list[dict[str, str]]]:
    """Every file under src, symlinks followed (to files and directories; a link back to an
    ancestor directory is reported, not followed).

    Returns (files, dirs, ignored); ignored lists what is not a copyable file (broken
    symlinks, sockets, fifos, devices, directory cycles), each with a reason.
    An unreadable directory is an error: skipping it would stage a model with holes.
    """
    files: dict[str, SrcFile] = {}
    dirs: list[str] = []
    ignored: list[dict[str, str]] = []

    def visit(abs_dir: str, rel_dir: str, ancestors: frozenset[tuple[int, int]]) -> None:
        st = os.stat(abs_dir)
        key = (st.st_dev, st.st_ino)
        if key in ancestors:
            ignored.append({"path": rel_dir, "reason": "directory cycle (symlink back to an ancestor)"})
            return
        ancestors = ancestors | {key}
        try:
            entries = sorted(os.scandir(abs_dir), key=lambda e: e.name)
        except OSError as exc:
            raise StageError("cannot read source directory %s: %s" % (abs_dir, exc.strerror), EXIT_IO)
        if rel_dir:
            dirs.append(rel_dir)
        for entry in entries:
            rel = entry.name if not rel_dir else rel_dir + "/" + entry.name
            if rel == MANIFEST or rel == LOCK or entry.name.endswith(PART):
                ignored.append({"path": rel, "reason": "reserved name used by fleet-stage"})
                continue
            try:
                est = os.stat(entry.path)  # follows symlinks
            except FileNotFoundError:
                if not entry.is_symlink():
                    raise StageError("source file %s vanished while listing the source" % entry.path, EXIT_IO)
                ignored.append({"path": rel, "reason": "broken symlink -> %s" % os.readlink(entry.path)})
                continue
            except OSError as exc:
                raise StageError("cannot stat %s: %s" % (entry.path, exc.strerror), EXIT_IO)
            if stat.S_ISDIR(est.st_mode):
                visit(entry.path, rel, ancestors)
            elif stat.S_ISREG(est.st_mode):
                files[rel] = SrcFile(rel, entry.path, est, entry.is_symlink())
            else:
                ignored.append({"path": rel, "reason": "not a regular file or directory"})

    visit(src, "", frozenset())
    # parents of a file are listed before it; keep directories containing nothing too
    return files, dirs, ignored


def scan_dest(dst: str) -> tuple[dict[str, os.stat_result], list[str]]:
    """Everything under dst (no symlinks followed): (files {rel: lstat}, dirs [rel])."""
    files: dict[str, os.stat_result] = {}
    dirs: list[str] = []
    if not os.path.isdir(dst):
        return files, dirs
    for root, dnames, fnames in os.walk(dst):
        rel_root = os.path.relpath(root, dst)
        rel_root = "" if rel_root == "." else rel_root
        for d in dnames:
            rel = d if not rel_root else rel_root + "/" + d
            if os.path.islink(os.path.join(root, d)):
                files[rel] = os.lstat(os.path.join(root, d))  # a link is removed like a file
            else:
                dirs.append(rel)
        for f in fnames:
            rel = f if not rel_root else rel_root + "/" + f
            if rel in (MANIFEST, LOCK) or rel.startswith(MANIFEST + "."):
                continue
            files[rel] = os.lstat(os.path.join(root, f))
    return files, dirs


def load_manifest(dst: str, src: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The previous run's manifest and its entries {rel: entry}; empty when absent, unreadable
    or written for another source."""
    try:
        with open(os.path.join(dst, MANIFEST)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("src") != src:
        return {}, {}
    out: dict[str, dict[str, Any]] = {}
    for entry in data.get("files", []):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            out[entry["path"]] = entry
    return data, out


def looks_staged(f: SrcFile, prev: dict[str, dict[str, Any]], dst_st: os.stat_result | None) -> bool:
    """Cheap check: the staged copy is the one the manifest recorded for this very source state."""
    entry = prev.get(f.rel)
    return (
        entry is not None
        and dst_st is not None
        and stat.S_ISREG(dst_st.st_mode)
        and dst_st.st_size == f.size
        and entry.get("size") == f.size
        and entry.get("mtime_ns") == f.mtime_ns
        and entry.get("dst_mtime_ns") == dst_st.st_mtime_ns
    )


def free_bytes(path: str) -> int:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or "/")
    return st.f_bavail * st.f_frsize


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(8 * 2**20)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])  # releases the GIL: streams hash in parallel
    return h.hexdigest()


# -- the copy ---------------------------------------------------------------------------

class Throttle:
    """A global rate cap over all streams (spares a shared network filesystem)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.next_t = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            t = max(now, self.next_t)
            self.next_t = t + n / self.rate
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class FileCopy:
    """One file's copy across its chunks (guarded by its own lock)."""

    __slots__ = ("lock", "opened", "chunks_left")

    def __init__(self, chunks: int) -> None:
        self.lock = threading.Lock()
        self.opened = False  # the part file exists
        self.chunks_left = chunks


class Stager:
    def __init__(self, src: str, dst: str, streams: int, verify: bool, throttle: Throttle | None) -> None:
        self.src = src
        self.dst = dst
        self.streams = streams
        self.verify = verify
        self.throttle = throttle
        self.slice = SLICE if throttle is None else 2**20
        self.lock = threading.Lock()
        self.abort = threading.Event()
        self.error: StageError | None = None  # the first StageError
        self.bytes_done = 0
        self.entries: dict[str, dict[str, Any]] = {}  # rel -> manifest entry, for files in place
        self.manifest_dirty = False
        self.verified = False
        self.made_dirs: set[str] = set()

    # manifest -------------------------------------------------------------------------
    def write_manifest(self, complete: bool) -> None:
        with self.lock:
            files = [self.entries[k] for k in sorted(self.entries)]
            self.manifest_dirty = False
        data = {
            "format": FORMAT,
            "tool": "fleet-stage",
            "src": self.src,
            "dst": self.dst,
            "complete": complete,
            "verified": bool(complete and self.verified),
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        path = os.path.join(self.dst, MANIFEST)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(self.dst)

    def record(self, f: SrcFile, dst_mtime_ns: int, sha: str | None) -> None:
        entry: dict[str, Any] = {"path": f.rel, "size": f.size, "mtime_ns": f.mtime_ns, "dst_mtime_ns": dst_mtime_ns}
        if sha:
            entry["sha256"] = sha
        with self.lock:
            self.entries[f.rel] = entry
            self.manifest_dirty = True

    # failures ---------------------------------------------------------------------------
    def fail(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, StageError):
            err = exc
        elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            err = StageError("no space left on %s while %s" % (self.dst, what), EXIT_NOSPACE)
        elif isinstance(exc, OSError):
            err = StageError("I/O error while %s: %s" % (what, exc), EXIT_IO)
        else:
            err = StageError("unexpected %s while %s: %s" % (type(exc).__name__, what, exc), EXIT_BUG)
        with self.lock:
            if self.error is None:
                self.error = err
        self.abort.set()

    # one file, in chunks ---------------------------------------------------------------
    def ensure_dir(self, rel_dir: str) -> None:
        if rel_dir and rel_dir not in self.made_dirs:
            os.makedirs(os.path.join(self.dst, rel_dir), exist_ok=True)
            with self.lock:
                self.made_dirs.add(rel_dir)

    def part_path(self, f: SrcFile) -> str:
        return os.path.join(self.dst, f.rel) + PART

    def open_part(self, f: SrcFile) -> None:
        self.ensure_dir(os.path.dirname(f.rel))
        fd = os.open(self.part_path(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if f.size:
                try:
                    # reserve the space now: a full RAM disk fails here, not half-way through
                    os.posix_fallocate(fd, 0, f.size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    os.ftruncate(fd, f.size)  # filesystem without fallocate
        finally:
            os.close(fd)

    def copy_range(self, f: SrcFile, offset: int, length: int) -> None:
        sfd = os.open(f.path, os.O_RDONLY)
        try:
            dfd = os.open(self.part_path(f), os.O_WRONLY)
            try:
                os.lseek(dfd, offset, os.SEEK_SET)
                end = offset + length
                pos = offset
                use_sendfile = True
                while pos < end:
                    if self.abort.is_set():
                        return
                    n = min(self.slice, end - pos)
                    if self.throttle is not None:
                        self.throttle.take(n)
                    sent = 0
                    if use_sendfile:
                        try:
                            # in-kernel copy, no trip through Python buffers
                            sent = os.sendfile(dfd, sfd, pos, n)
                        except OSError as exc:
                            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                                raise
                            use_sendfile = False
                    if not use_sendfile:
                        data = os.pread(sfd, n, pos)
                        sent = len(data)
                        view = memoryview(data)
                        while view:
                            w = os.write(dfd, view)
                            view = view[w:]
                    if sent == 0:
                        raise StageError("source %s shrank while copying (EOF at byte %d of %d); "
                                         "re-run once the source is stable" % (f.path, pos, f.size), EXIT_IO)
                    pos += sent
                    with self.lock:
                        self.bytes_done += sent
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def copy_hashing(self, f: SrcFile) -> str:
        """One pass over the source: the hash is of exactly the bytes written (--verify)."""
        h = hashlib.sha256()
        buf = bytearray(self.slice)
        view = memoryview(buf)
        with open(f.path, "rb", buffering=0) as sfh, open(self.part_path(f), "r+b", buffering=0) as dfh:
            while True:
                if self.abort.is_set():
                    return ""
                n = sfh.readinto(buf)
                if not n:
                    break
                if self.throttle is not None:
                    self.throttle.take(n)
                h.update(view[:n])
                out = view[:n]
                while out:
                    w = dfh.write(out)
                    out = out[w:]
                with self.lock:
                    self.bytes_done += n
        return h.hexdigest()

    def finish(self, f: SrcFile, sha: str | None) -> None:
        part = self.part_path(f)
        final = os.path.join(self.dst, f.rel)
        st = os.stat(f.path)
        if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
            raise StageError("source %s changed while it was copied; re-run once the source is stable"
                             % f.path, EXIT_IO)
        if os.path.getsize(part) != f.size:
            raise StageError("copy of %s has %d bytes, expected %d" % (f.path, os.path.getsize(part), f.size), EXIT_IO)
        fd = os.open(part, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(part, f.mode | 0o400)  # servers must be able to read it whatever the source says
        os.utime(part, ns=(f.mtime_ns, f.mtime_ns))
        os.replace(part, final)
        self.record(f, os.stat(final).st_mtime_ns, sha)

    def copy_files(self, todo: list[SrcFile]) -> None:
        """Copy every file in todo with self.streams threads; raise the first error."""
        todo = sorted(todo, key=lambda f: (-f.size, f.rel))
        # per file: the first chunk to run creates the part file, the last to finish renames
        # it into place
        state: dict[str, FileCopy] = {}
        tasks: list[tuple[SrcFile, int | None, int | None]] = []
        for f in todo:
            chunks: list[tuple[int | None, int | None]]
            if self.verify:
                chunks = [(None, None)]
            else:
                chunks = [(off, min(CHUNK, f.size - off)) for off in range(0, f.size, CHUNK)] or [(0, 0)]
            state[f.rel] = FileCopy(len(chunks))
            tasks.extend((f, off, ln) for off, ln in chunks)

        def run(task: tuple[SrcFile, int | None, int | None]) -> None:
            f, off, ln = task
            if self.abort.is_set():
                return
            st = state[f.rel]
            try:
                with st.lock:
                    if not st.opened:
                        self.open_part(f)
                        st.opened = True
                if off is None:
                    sha = self.copy_hashing(f)
                    if not self.abort.is_set():
                        self.finish(f, sha)
                    return
                if ln:
                    self.copy_range(f, off, ln)
                if self.abort.is_set():
                    return
                with st.lock:
                    st.chunks_left -= 1
                    last = st.chunks_left == 0
                if last:
                    self.finish(f, None)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                self.fail(exc, "copying %s" % f.rel)

        with ThreadPoolExecutor(max_workers=self.streams) as pool:
            list(pool.map(run, tasks))
        if self.error is not None:
            raise self.error

    def hash_check(self, candidates: list[SrcFile], prev: dict[str, dict[str, Any]]) -> list[SrcFile]:
        """--verify: return the candidates whose staged copy does not hash like the source."""
        bad: list[SrcFile] = []

        def check(f: SrcFile) -> None:
            if self.abort.is_set():
                return
            try:
                entry = prev.get(f.rel) or {}
                # a hash recorded for this exact source state saves re-reading a slow source
                want = entry.get("sha256") or sha256_file(f.path)
                got = sha256_file(os.path.join(self.dst, f.rel))
                with self.lock:
                    self.bytes_done += f.size
                if got == want:
                    self.record(f, entry["dst_mtime_ns"], want)
                else:
                    log("staged copy of %s differs from the source (sha256 %s != %s): copying again"
                        % (f.rel, got[:12], want[:12]))
                    with self.lock:
                        bad.append(f)
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc, "verifying %s" % f.rel)

        with ThreadPoolExecutor(max_workers=self.streams) as pool:
            list(pool.map(check, candidates))
        if self.error is not None:
            raise self.error
        return bad


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


class Progress(threading.Thread):
    def __init__(self, stager: Stager, total: int, what: str, flush: bool = True) -> None:
        super().__init__(daemon=True)
        self.flush = flush  # refresh the incomplete manifest as files land (copy phase only)
        self.stager = stager
        self.total = total
        self.what = what
        self.stop_ev = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        last_flush = time.monotonic()
        while not self.stop_ev.wait(PROGRESS_S):
            done = self.stager.bytes_done
            dt = time.monotonic() - self.t0
            log("%s %s / %s (%.0f%%), %.0f MB/s" % (
                self.what, human(done), human(self.total), 100.0 * done / max(1, self.total), done / 1e6 / max(dt, 1e-9)))
            if self.flush and self.stager.manifest_dirty and time.monotonic() - last_flush >= MANIFEST_FLUSH_S:
                try:
                    self.stager.write_manifest(complete=False)
                except OSError:
                    pass  # the final write reports real trouble
                last_flush = time.monotonic()

    def stop(self) -> None:
        self.stop_ev.set()
        self.join(timeout=5.0)   # it wakes on stop_ev at once; never let a report hold the stage


# -- the command ------------------------------------------------------------------------

@dataclass
class Plan:
    """What a run finds before it changes anything in DST."""

    files: dict[str, SrcFile]  # every source file, by path relative to SRC
    dirs: list[str]  # every source directory (empty ones too)
    ignored: list[dict[str, str]]  # what is not copied: {"path", "reason"}
    prev: dict[str, dict[str, Any]]  # the previous manifest's entries, by path
    staged: list[SrcFile]  # in place and unchanged: kept
    todo: list[SrcFile]  # to copy
    doomed: list[str]  # in DST and removed before copying: stale files, parts, old copies
    stale_dirs: list[str]  # directories in DST the source no longer has
    reclaimable: int  # bytes the removals free
    prev_complete: bool  # the previous manifest said complete
    prev_verified: bool  # ... and verified

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def changes_dst(self) -> bool:
        return bool(self.todo or self.doomed or self.stale_dirs)


def plan(src: str, dst: str) -> Plan:
    files, dirs, ignored = walk_source(src)
    prev_manifest, prev = load_manifest(dst, src)
    dfiles, ddirs = scan_dest(dst)
    staged: list[SrcFile] = []
    todo: list[SrcFile] = []
    for f in files.values():
        (staged if looks_staged(f, prev, dfiles.get(f.rel)) else todo).append(f)
    staged_rels = set(g.rel for g in staged)
    # everything else in dst goes before copying: stale files, parts, old copies of changed files
    doomed = [rel for rel in dfiles if rel not in staged_rels]
    reclaimable = sum(dfiles[rel].st_size for rel in doomed if stat.S_ISREG(dfiles[rel].st_mode))
    want_dirs = set(dirs)
    for rel in files:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            want_dirs.add("/".join(parts[:i]))
    stale_dirs = [d for d in ddirs if d not in want_dirs]
    return Plan(files=files, dirs=dirs, ignored=ignored, prev=prev, staged=staged, todo=todo, doomed=doomed,
                stale_dirs=stale_dirs, reclaimable=reclaimable,
                prev_complete=prev_manifest.get("complete") is True,
                prev_verified=prev_manifest.get("verified") is True)


def check_source(src: str) -> None:
    if not os.path.exists(src):
        raise StageError("source directory %s does not exist" % src, EXIT_USAGE)
    if not os.path.isdir(src):
        raise StageError("source %s is not a directory" % src, EXIT_USAGE)


def source_key(rsrc: str, files: dict[str, SrcFile]) -> str:
    """12 hex digits of the source's real path and every file's path, size and mtime_ns."""
    h = hashlib.sha256(rsrc.encode())
    for rel in sorted(files):
        f = files[rel]
        h.update(("\n%s\0%d\0%d" % (rel, f.size, f.mtime_ns)).encode())
    return h.hexdigest()[:12]


def own_dir(path: str, create: bool) -> bool:
    """`path` is a directory of this user, mode 0700 (made so when `create`); False when absent.

    Another user's directory, or a symlink, is refused: it is not ours to write into."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StageError("cannot create %s: %s" % (path, exc.strerror), EXIT_IO)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise StageError("%s is not a directory of this user (uid %d; it belongs to uid %d): another user's "
                         "staging area is never written into; remove it or set nodes.ramdisk elsewhere"
                         % (path, os.getuid(), st.st_uid), EXIT_USAGE)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)   # ours: others may not plant files in it
    return True


def destination(args: argparse.Namespace, create: bool) -> str:
    """--dst as given, or RAMDISK/fleet-<uid>/FLEET/<source name>-<key> (see the module docstring)."""
    if args.dst:
        return str(args.dst)
    check_source(args.src)
    rsrc = os.path.realpath(args.src)
    rram = os.path.realpath(args.ramdisk)
    if (rsrc + os.sep).startswith(rram + os.sep):
        raise StageError("source %s is already in the RAM disk %s: the model is already in place; serve it "
                         "from there without staging" % (rsrc, rram), EXIT_USAGE)
    files, _dirs, _ignored = walk_source(rsrc)
    name = os.path.basename(rsrc.rstrip(os.sep)) or "model"
    root = os.path.join(args.ramdisk, "fleet-%d" % os.getuid())
    if own_dir(root, create):
        own_dir(os.path.join(root, args.fleet), create)
    return os.path.join(root, args.fleet, "%s-%s" % (name, source_key(rsrc, files)))


def check_paths(src: str, dst: str) -> tuple[str, str]:
    check_source(src)
    rsrc = os.path.realpath(src)
    rdst = os.path.realpath(dst)
    if rsrc == rdst:
        raise StageError("source and destination are the same directory (%s): the model is already "
                         "in place; serve it from there without staging" % rsrc, EXIT_USAGE)
    if (rdst + os.sep).startswith(rsrc + os.sep) or (rsrc + os.sep).startswith(rdst + os.sep):
        raise StageError("source %s and destination %s contain one another" % (rsrc, rdst), EXIT_USAGE)
    return rsrc, os.path.abspath(dst)


def allocated(size: int, block: int) -> int:
    """Bytes a file takes on the destination (tmpfs allocates whole pages)."""
    return -(-size // block) * block if block > 0 else size


def plan_report(p: Plan, shown_src: str, dst: str) -> dict[str, Any]:
    """--plan-only: sizes and what is already staged; nothing in DST changes."""
    return {
        "src": shown_src, "dst": dst,
        "files": len(p.files),
        "bytes_total": p.bytes_total,
        "already_staged_bytes": sum(f.size for f in p.staged),
        "reclaimable_bytes": p.reclaimable,
        "free_bytes": free_bytes(dst),
        "ignored": p.ignored,
    }


def lock_dst(dst: str) -> int:
    """Create DST and hold its lock until the process exits (the returned fd stays open)."""
    try:
        os.makedirs(dst, exist_ok=True)
    except OSError as exc:
        raise StageError("cannot create %s: %s" % (dst, exc.strerror), EXIT_IO)
    # Two stagers on one node (two flows, a retry racing a slow first try) take turns;
    # the second then finds the copy finished and adopts it.
    lock_fd = os.open(os.path.join(dst, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        log("another fleet-stage holds %s; waiting for it" % os.path.join(dst, LOCK))
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    return lock_fd


def _linkable(sib: str, rel: str, f: SrcFile, entry: dict[str, Any] | None) -> bool:
    """The sibling copy's file is the source's file as it is now, in place as its manifest says."""
    if entry is None or entry.get("size") != f.size or entry.get("mtime_ns") != f.mtime_ns:
        return False
    try:
        st = os.lstat(os.path.join(sib, rel))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == f.size and st.st_mtime_ns == entry.get("dst_mtime_ns")


def in_siblings(src: str, dst: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """For a new copy (no manifest yet): {rel: (file, its manifest entry)} of this fleet's other
    finished copies of the same source (dst's siblings) whose file is the source's file as it is now."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    parent = os.path.dirname(dst)
    if os.path.exists(os.path.join(dst, MANIFEST)) or not os.path.isdir(parent):
        return found
    files = walk_source(src)[0]
    for name in sorted(os.listdir(parent)):
        sib = os.path.join(parent, name)
        if sib == dst or os.path.islink(sib) or not os.path.isdir(sib):
            continue
        prev_manifest, prev = load_manifest(sib, src)
        if prev_manifest.get("complete") is not True:
            continue
        for rel, f in files.items():
            if rel not in found and _linkable(sib, rel, f, prev.get(rel)):
                found[rel] = (os.path.join(sib, rel), prev[rel])
    return found


def seed(src: str, dst: str) -> int:
    """Start a new copy from this fleet's other finished copies of the same source (`in_siblings`):
    those files are hard-linked in and entered in an incomplete manifest, so only changed files are
    copied. One inode, no RAM twice, and neither copy is written in place: every copy writes
    NAME.fleet-part and renames. Returns the files linked."""
    entries: dict[str, dict[str, Any]] = {}
    for rel, (path, entry) in in_siblings(src, dst).items():
        target = os.path.join(dst, rel)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.link(path, target)
        except OSError:
            continue
        entries[rel] = dict(entry)
    if entries:
        stager = Stager(src, dst, 1, False, None)
        stager.entries = entries
        stager.write_manifest(complete=False)
        log("linked %d unchanged files from this fleet's earlier copy" % len(entries))
    return len(entries)


def clear_stale(stager: Stager, p: Plan) -> bool:
    """Mark the copy incomplete, then remove what the source no longer has; True when marked."""
    # Before the first change to DST, mark it incomplete. A copy with nothing to change is
    # never marked, so servers reading it while a flow re-runs never see it "incomplete".
    marked = False
    if p.changes_dst:
        stager.write_manifest(complete=False)
        marked = True
    for rel in p.doomed:
        remove(os.path.join(stager.dst, rel))
    for d in p.stale_dirs:
        remove(os.path.join(stager.dst, d))
    return marked


def reverify(stager: Stager, p: Plan, marked: bool) -> list[SrcFile]:
    """--verify over the files kept: those whose copy hashes differently, removed, to copy again."""
    with stager.lock:
        for f in p.staged:
            stager.entries.pop(f.rel, None)  # re-entered once its hash matches
    prog = Progress(stager, sum(f.size for f in p.staged), "verified", flush=False)
    prog.start()
    try:
        bad = stager.hash_check(p.staged, p.prev)
    finally:
        prog.stop()
    if bad and not marked:
        stager.write_manifest(complete=False)
    for f in bad:
        remove(os.path.join(stager.dst, f.rel))
    stager.bytes_done = 0
    return bad


def check_room(dst: str, todo: list[SrcFile]) -> tuple[int, int]:
    """(bytes the copy will allocate, bytes free now); StageError when they do not fit."""
    block = os.statvfs(dst).f_frsize
    need_alloc = sum(allocated(f.size, block) for f in todo)
    free_at_start = free_bytes(dst)
    if need_alloc > free_at_start:
        raise StageError("not enough space in %s: %d bytes (%s) to copy, %d bytes (%s) free; "
                         "free the RAM disk or stage on a larger node"
                         % (dst, need_alloc, human(need_alloc), free_at_start, human(free_at_start)), EXIT_NOSPACE)
    return need_alloc, free_at_start


def copy_todo(stager: Stager, todo: list[SrcFile], room: tuple[int, int]) -> None:
    """Copy with progress; on failure drop the parts and keep the manifest incomplete."""
    need_alloc, free_at_start = room
    prog = Progress(stager, sum(f.size for f in todo), "copied")
    prog.start()
    try:
        stager.copy_files(todo)
    except StageError as exc:
        prog.stop()
        # Parts are garbage and a full RAM disk starves the node: drop them now.
        # Files already renamed into place stay entered, so a re-run resumes.
        for f in todo:
            remove(stager.part_path(f))
        try:
            stager.write_manifest(complete=False)
        except OSError:
            pass
        if exc.code == EXIT_NOSPACE:
            vfs = os.statvfs(stager.dst)
            why = ("it has no free inodes left (%d files to create)" % len(todo) if vfs.f_favail == 0
                   else "something else is filling it, or it cannot hold the model")
            exc.args = ("%s: %d bytes (%s) were to be copied and %d bytes (%s) were free at the start; "
                        "%s; free the RAM disk or stage on a larger node"
                        % (exc.args[0], need_alloc, human(need_alloc), free_at_start, human(free_at_start), why),)
        raise
    finally:
        prog.stop()


def finish_copy(stager: Stager, p: Plan, todo: list[SrcFile], verify: bool) -> None:
    """Make the copied files durable, then say complete (unless nothing changed)."""
    for d in set(os.path.dirname(f.rel) for f in todo):
        fsync_dir(os.path.join(stager.dst, d))
    # An adopted copy keeps its manifest untouched (a no-op stays a no-op); a fresh --verify
    # pass is recorded
    unchanged = not (todo or p.doomed or p.stale_dirs) and p.prev_complete
    if not unchanged or (verify and not p.prev_verified):
        stager.verified = verify
        stager.write_manifest(complete=True)


def stage(args: argparse.Namespace) -> dict[str, Any]:
    # the manifest names the source by its real path: a re-pointed symlink is a new source
    src, dst = check_paths(args.src, destination(args, create=not args.plan_only))
    shown_src = os.path.abspath(args.src)
    t0 = time.monotonic()
    if args.plan_only:
        report = plan_report(plan(src, dst), shown_src, dst)
        if args.ramdisk:   # what `seed` will link costs no room
            report["already_staged_bytes"] += sum(int(e["size"]) for _, e in in_siblings(src, dst).values())
        return report

    lock_dst(dst)
    if args.ramdisk:
        seed(src, dst)
    p = plan(src, dst)
    files = p.files
    for item in p.ignored:
        log("not staged: %s (%s)" % (item["path"], item["reason"]))
    stager = Stager(src, dst, args.streams, args.verify, Throttle(args.max_mb_s * 1e6) if args.max_mb_s else None)
    for f in p.staged:
        stager.entries[f.rel] = p.prev[f.rel]
    marked = clear_stale(stager, p)
    todo = list(p.todo)
    if args.verify and p.staged:
        todo.extend(reverify(stager, p, marked))
    need = sum(f.size for f in todo)
    room = check_room(dst, todo)

    for d in p.dirs:
        stager.ensure_dir(d)
    t_copy = time.monotonic()
    if todo:
        log("copying %d of %d files, %s of %s, %d streams%s" % (
            len(todo), len(files), human(need), human(p.bytes_total), args.streams,
            ", hashing" if args.verify else ""))
        copy_todo(stager, todo, room)
    copy_s = time.monotonic() - t_copy
    finish_copy(stager, p, todo, args.verify)
    seconds = time.monotonic() - t0
    return {
        "src": shown_src,
        "dst": dst,
        "files": len(files),
        "copied_files": len(todo),
        "skipped_files": len(files) - len(todo),
        "removed_files": sum(1 for rel in p.doomed if rel not in files),  # stale files and leftovers
        "bytes_total": p.bytes_total,
        "bytes_copied": need,
        "seconds": round(seconds, 3),
        "mb_per_s": round(need / 1e6 / copy_s, 1) if need and copy_s > 0 else 0.0,
        "streams": args.streams,
        "symlinks": sum(1 for f in files.values() if f.via_symlink),
        "ignored": p.ignored,
        "complete": True,
        "verified": bool(args.verify),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fleet-stage", description="Stage a model directory into a RAM disk.")
    ap.add_argument("--src", required=True, help="model directory to copy (symlinks are followed)")
    ap.add_argument("--dst", help="directory in the RAM disk to copy it to")
    ap.add_argument("--ramdisk", help="the RAM disk: copy to RAMDISK/fleet-<uid>/FLEET/<name>-<key> (with --fleet)")
    ap.add_argument("--fleet", help="the fleet the copy belongs to (a-z, 0-9, -), with --ramdisk")
    ap.add_argument("--streams", type=int, default=8, help="parallel copy streams (threads)")
    ap.add_argument("--verify", action="store_true", help="compare content hashes, not only size and mtime")
    ap.add_argument("--plan-only", action="store_true", help="print sizes and what is already staged; copy nothing")
    ap.add_argument("--max-mb-s", type=float, default=0.0, help="cap on the copy rate in MB/s (0: none)")
    args = ap.parse_args(argv)
    if bool(args.dst) == bool(args.ramdisk) or bool(args.ramdisk) != bool(args.fleet):
        ap.error("give --dst, or --ramdisk with --fleet")
    if args.fleet and not re.match(r"^[a-z0-9][a-z0-9-]*$", args.fleet):
        ap.error("--fleet must be a-z, 0-9 and -, starting with a letter or digit")
    if not 1 <= args.streams <= 256:
        ap.error("--streams must be between 1 and 256")
    if args.max_mb_s < 0:
        ap.error("--max-mb-s must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = stage(args)
    except StageError as exc:
        log(ERROR_MARK + str(exc))
        return exc.code
    except OSError as exc:
        # outside the copy proper: the manifest, the lock, removing stale files
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            log(ERROR_MARK + "no space left on %s (%s); the staged copy stays marked incomplete; free the RAM "
                "disk or stage on a larger node" % (args.dst, exc))
            return EXIT_NOSPACE
        log(ERROR_MARK + str(exc))
        return EXIT_IO
    except KeyboardInterrupt:
        log("interrupted; the staged copy stays marked incomplete")
        return EXIT_INTERRUPTED
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
