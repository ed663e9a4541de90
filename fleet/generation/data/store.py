"""The result store: exactly-once, crash-safe results of a generation job, keyed by id.

Layout of an output directory::

    DIR/.lock                    fcntl lock held by the one runner writing here (JSON: pid, host, since)
    DIR/job.json                 the input's SHA-256: a different input into the same DIR is refused
    DIR/shards/part-000001.parquet   committed results, RESULT_SCHEMA, one row per id
    DIR/errors.jsonl             rows that failed for good (last error, attempts, line, server, status)
    DIR/errors-<ts>.retried.jsonl    errors files set aside by `--retry-errors` (audit trail)
    DIR/rejects.jsonl            input rows that cannot be generated (line, id, reason, raw)
    DIR/quality_rejects.jsonl    generated rows a quality gate turned away (id, reasons, the row)
    DIR/manifest.json            written by the runner (`write_manifest`)

Invariants, whatever is killed and when:

- A shard is written to `part-N.parquet.tmp`, fsync'd, renamed, and the directory fsync'd:
  a kill leaves the whole shard or none of it (leftover `.tmp` files are deleted on open).
- An id is recorded once: `add_result` / `add_error` refuse an id that is already done
  (completed, errored or rejected), so no id is in two shards, or both completed and in errors.
- A crash loses at most the uncommitted buffer (results since the last `flush`); those ids
  are simply not done and are generated again on resume.
- Errors are appended and fsync'd one by one (they are rare); a torn last line from a kill is
  cut off on open. Rejects are appended (fsync'd on `flush`) and recorded once per input line,
  so a resume, which reads every reject again, never writes one twice.

`done_ids()` is an `IdSet`: 8-byte digests in a sorted `array('Q')` plus a small set of
recent additions, ~8-10 bytes per id, loaded from the shards' id column alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fleet.errors import FatalError
from fleet.generation.data import jobrecord
from fleet.generation.data.dirlock import lock_dir, unlock_dir
from fleet.generation.data.durable import fsync
from fleet.generation.data.idset import IdSet
from fleet.generation.data.rows import DUPLICATE_REASON, Reject, digest
from fleet.generation.data.jsonl import dumps, repair_jsonl
from fleet.generation.data.results import (
    ERRORS_FILE,
    QUALITY_REJECTS,
    REJECTS_FILE,
    SHARDS_DIR,
    read_errors,
    read_quality_rejects,
    read_rejects,
    shard_paths,
    shard_seq,
)
from fleet.generation.data.schema import (
    COLUMN_SET,
    CONVERTERS,
    DICT_COLUMNS,
    RESULT_COLUMNS,
    RESULT_SCHEMA,
    STATS_COLUMNS,
)

__all__ = ["ResultStore"]

log = logging.getLogger("fleet.generation.data.store")

# A shard is committed early once the buffered answers hold this much text: rows of tens of MB
# each (long reasoning) otherwise sat in the buffer until the timed flush, every one of them held
# twice at the commit (the Python strings and their Arrow copy). Rows of a few KB never reach it.
BUFFER_CHARS = 64 << 20
# A row whose answer alone holds this much text (about a million tokens: no real answer, a runaway
# or hostile server) is committed at once, with what waits: its text is in memory twice (its strings
# and their Arrow bytes) for that one commit, never beside other such rows waiting in the buffer.
LARGE_ROW_CHARS = 4 << 20
# A text value this long goes into Arrow on its own: its UTF-8 bytes wrapped as they are (a column
# built from many values grows its buffer by doubling and copying: 1.5x the text, kept while the
# shard is written), and its own Parquet page (a page of several such values is encoded whole).
BIG_TEXT = 1 << 20


def _column(values: tuple[Any, ...], typ: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """One column of a shard; a text column with BIG_TEXT values holds each of them as a chunk of its own."""
    if typ != pa.string() or not any(isinstance(v, str) and len(v) >= BIG_TEXT for v in values):
        return pa.array(values, type=typ)
    chunks: list[pa.Array] = []
    run: list[Any] = []
    for v in values:
        if isinstance(v, str) and len(v) >= BIG_TEXT:
            if run:
                chunks.append(pa.array(run, type=typ))
                run = []
            data = v.encode()   # one copy, the exact size; an answer with a lone surrogate was judged invalid (client._utf8)
            offsets = pa.array([0, len(data)], type=pa.int32()).buffers()[1]
            chunks.append(pa.StringArray.from_buffers(1, offsets, pa.py_buffer(data)))
        else:
            run.append(v)
    if run:
        chunks.append(pa.array(run, type=typ))
    return pa.chunked_array(chunks, type=typ)


class ResultStore:
    """Results, errors and rejects of one job in one output directory; see the module docstring.

    Thread-safe: the runner may call `flush` from a worker thread while the event loop adds
    results. Use as a context manager or call `close()`.
    """

    def __init__(self, out_dir: str | Path, *, shard_rows: int = 10000,
                 input_fingerprint: str | None = None, job_params: dict[str, Any] | None = None) -> None:
        if shard_rows < 1:
            raise ValueError("shard_rows must be >= 1")
        self.dir = Path(out_dir)
        self.shard_rows = shard_rows
        self.shards_dir = self.dir / SHARDS_DIR
        self.errors_path = self.dir / ERRORS_FILE
        self.rejects_path = self.dir / REJECTS_FILE
        self.quality_path = self.dir / QUALITY_REJECTS
        try:
            self.shards_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FatalError(f"cannot create output directory {self.dir}: {exc.strerror}",
                             remedy="pass an --output directory you can write to") from exc
        self._lock = threading.RLock()  # buffer, counters, files, the id set
        # One shard write at a time. Reentrant: `flush` holds it while it takes the buffer and
        # commits, so a flush returns only after a commit under way in another thread (the
        # runner's timed flush, whose task may be cancelled while its thread writes) is done.
        self._commit_lock = threading.RLock()
        self._lock_fd: int | None = lock_dir(self.dir)
        try:
            self._open(input_fingerprint, job_params)
        except BaseException:
            self._release_lock()
            raise

    # -- opening

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            unlock_dir(fd)

    def _open(self, fingerprint: str | None, params: dict[str, Any] | None = None) -> None:
        # Under the lock, any temp file is a dead writer's: a shard never renamed, a
        # manifest half written. Deleting them makes "whole shard or nothing" visible.
        for d in (self.dir, self.shards_dir):
            for tmp in d.glob("*.tmp"):
                log.warning("removing %s left by a killed writer", tmp)
                tmp.unlink(missing_ok=True)
        jobrecord.check_job(self.dir, fingerprint, params)
        repair_jsonl(self.errors_path)
        repair_jsonl(self.rejects_path)
        repair_jsonl(self.quality_path)

        shards = shard_paths(self.dir)
        self._next_seq = (shard_seq(shards[-1]) + 1) if shards else 1
        self._shards = len(shards)
        self._committed = 0
        for p in shards:
            try:
                self._committed += pq.ParquetFile(p).metadata.num_rows
            except (OSError, pa.ArrowException) as exc:
                raise FatalError(f"result shard {p} is unreadable: {exc}",
                                 remedy="move that file aside and resume: its rows are generated again") from exc
        self._error_ids: list[str] = [r["id"] for r in read_errors(self.dir) if isinstance(r.get("id"), str)]
        self._reject_lines: set[int] = set()
        self._reject_done: list[str] = []  # ids of non-duplicate rejects: they count as done
        for r in read_rejects(self.dir):
            if isinstance(r.get("line"), int):
                self._reject_lines.add(r["line"])
            rid = r.get("id")
            if isinstance(rid, str) and not r.get("duplicate"):
                self._reject_done.append(rid)
        self._rejects = len(self._reject_lines)
        self._errors = len(self._error_ids)
        self._quality_ids: list[str] = [r["id"] for r in read_quality_rejects(self.dir) if isinstance(r.get("id"), str)]
        self._buffer: list[tuple[Any, ...]] = []
        self._buffer_chars = 0   # answer text buffered since the last commit (BUFFER_CHARS)
        self._done: IdSet | None = None
        self._dropped = 0
        self._errors_f = open(self.errors_path, "ab")
        self._rejects_f = open(self.rejects_path, "ab")
        self._quality_f = open(self.quality_path, "ab")
        self._closed = False

    def note_input_broken(self, cause: str) -> None:
        """Record in DIR/job.json that this job's input broke mid-file: a repaired copy may continue it."""
        with self._lock:
            jobrecord.note_input_broken(self.dir, cause)

    # -- ids

    def _done_set(self) -> IdSet:
        if self._done is None:
            t0 = time.perf_counter()
            digests = array("Q")
            for p in shard_paths(self.dir):
                # ParquetFile, not read_table: read_table goes through pyarrow.dataset (+40 MB RSS).
                col = pq.ParquetFile(p).read(columns=["id"], use_threads=False).column("id")
                for chunk in col.chunks:
                    digests.extend(map(digest, chunk.to_pylist()))
            shard_ids = len(digests)
            digests.extend(map(digest, self._error_ids))
            digests.extend(map(digest, self._reject_done))
            digests.extend(map(digest, self._quality_ids))
            self._done = IdSet(digests)
            repeated = len(digests) - len(self._done)
            if repeated:
                log.warning("%s: %d ids recorded more than once (shards %d ids, errors %d, rejects %d): "
                            "the store was written by something other than ResultStore",
                            self.dir, repeated, shard_ids, len(self._error_ids), len(self._reject_done))
            log.info("%s: %d done ids loaded in %.2f s", self.dir, len(self._done), time.perf_counter() - t0)
        return self._done

    def done_ids(self) -> IdSet:
        """Ids already completed, errored (final) or rejected, for `iter_input(skip_ids=...)`.

        The live set: it grows as results come in. Duplicate-id rejects are not in it (their
        id belongs to the first row, which still has to be generated).
        """
        with self._lock:
            return self._done_set()

    # -- writing

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ResultStore({self.dir}) is closed")

    def add_result(self, row: dict[str, Any]) -> bool:
        """Buffer one completed row (keys: RESULT_COLUMNS; missing ones are null).

        Returns False, and records nothing, when the id is already done. Commits a shard when
        `shard_rows` rows are buffered.
        """
        rid = row.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"a result row needs a non-empty string 'id', got {rid!r}")
        if not COLUMN_SET.issuperset(row):
            unknown = sorted(set(row) - COLUMN_SET)
            raise ValueError(f"unknown result field(s) {unknown}; allowed: {', '.join(RESULT_COLUMNS)}")
        values = tuple(conv(row.get(c)) for c, conv in zip(RESULT_COLUMNS, CONVERTERS))
        with self._lock:
            self._check_open()
            if not self._done_set().add(rid):
                self._dropped += 1
                log.warning("result for %r dropped: the id is already done", rid)
                return False
            self._buffer.append(values)
            chars = sum(len(v) for k in ("completion", "reasoning_content") if isinstance(v := row.get(k), str))
            self._buffer_chars += chars
            if (len(self._buffer) < self.shard_rows and self._buffer_chars < BUFFER_CHARS
                    and chars < LARGE_ROW_CHARS):
                return True
            rows, self._buffer, self._buffer_chars = self._buffer, [], 0
        self._commit(rows)
        return True

    def add_error(self, id: str, *, error: str, attempts: int, line: int | None = None,
                  server: str | None = None, status: int | None = None) -> bool:
        """Record a row that failed for good (appended, flushed and fsync'd at once).

        Returns False, and records nothing, when the id is already done.
        """
        rec = {"id": id, "error": error, "attempts": attempts, "line": line, "server": server,
               "status": status, "at": time.time()}
        data = dumps(rec) + b"\n"
        with self._lock:
            self._check_open()
            done = self._done_set()
            if not done.add(id):
                self._dropped += 1
                log.warning("error for %r dropped: the id is already done", id)
                return False
            try:
                self._errors_f.write(data)
                self._errors_f.flush()
                os.fsync(self._errors_f.fileno())
            except OSError as exc:
                done.discard(id)
                err = FatalError(f"cannot append to {self.errors_path}: {exc.strerror}",
                                 remedy="free space in the output directory, then resume",
                                 path=str(self.errors_path))
                raise err from exc
            self._error_ids.append(id)
            self._errors += 1
        return True

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None = None) -> bool:
        """Record a generated row that a quality gate turned away (appended, fsync'd at once).

        It counts as done (resume does not generate it again). Returns False, and records
        nothing, when the id is already done.
        """
        rid = row.get("id")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"a rejected row needs a non-empty string 'id', got {rid!r}")
        rec = {"id": rid, "line": line, "reasons": list(reasons), "attempts": row.get("attempts"),
               "at": time.time(), "row": row}
        data = dumps(rec) + b"\n"
        with self._lock:
            self._check_open()
            done = self._done_set()
            if not done.add(rid):
                self._dropped += 1
                log.warning("quality reject for %r dropped: the id is already done", rid)
                return False
            try:
                self._quality_f.write(data)
                self._quality_f.flush()
                os.fsync(self._quality_f.fileno())
            except OSError as exc:
                done.discard(rid)
                raise FatalError(f"cannot append to {self.quality_path}: {exc.strerror}",
                                 remedy="free space in the output directory, then resume") from exc
            self._quality_ids.append(rid)
        return True

    def add_reject(self, reject: Reject) -> bool:
        """Record an input row that cannot be generated; False when its line is already recorded."""
        dup = reject.reason.startswith(DUPLICATE_REASON)
        rec = {"line": reject.line, "id": reject.id, "reason": reject.reason, "duplicate": dup,
               "raw": reject.raw[:2000], "at": time.time()}
        data = dumps(rec) + b"\n"
        with self._lock:
            self._check_open()
            if reject.line in self._reject_lines:
                return False
            try:
                self._rejects_f.write(data)
                self._rejects_f.flush()
            except OSError as exc:
                raise FatalError(f"cannot append to {self.rejects_path}: {exc.strerror}",
                                 remedy="free space in the output directory, then resume",
                                 path=str(self.rejects_path)) from exc
            self._reject_lines.add(reject.line)
            self._rejects += 1
            if reject.id and not dup:
                self._reject_done.append(reject.id)
                if self._done is not None:
                    self._done.add(reject.id)
        return True

    def _commit(self, rows: list[tuple[Any, ...]]) -> None:
        with self._commit_lock:
            seq = self._next_seq
            final = self.shards_dir / f"part-{seq:06d}.parquet"
            tmp = final.with_name(final.name + ".tmp")
            renamed = False
            try:
                table = pa.Table.from_arrays(
                    [_column(col, f.type) for col, f in zip(zip(*rows), RESULT_SCHEMA)], schema=RESULT_SCHEMA)
                pq.write_table(table, tmp, compression="zstd", use_dictionary=DICT_COLUMNS,
                               write_statistics=STATS_COLUMNS)
                fsync(tmp)
                os.rename(tmp, final)
                renamed = True
                self._next_seq = seq + 1
                fsync(self.shards_dir)
            except BaseException as exc:
                if not renamed:
                    tmp.unlink(missing_ok=True)
                    with self._lock:  # not written: keep the rows for the next commit
                        self._buffer[:0] = rows
                if isinstance(exc, OSError):
                    err = FatalError(f"cannot commit result shard {final}: {exc.strerror or exc}",
                                     remedy="free space in the output directory, then resume: "
                                            "rows not committed are generated again",
                                     path=str(final))  # the runner names it (disk full at which file)
                    raise err from exc
                raise
            finally:
                if renamed:
                    with self._lock:
                        self._committed += len(rows)
                        self._shards += 1

    def flush(self) -> None:
        """Commit the buffered results as one shard now, and fsync the rejects file.

        Returns once every row buffered before the call is committed, including rows another
        thread's flush took and is still writing (the counts and the shards then agree)."""
        with self._commit_lock:
            with self._lock:
                self._check_open()
                rows, self._buffer, self._buffer_chars = self._buffer, [], 0
            if rows:
                self._commit(rows)
        with self._lock:
            self._rejects_f.flush()
            os.fsync(self._rejects_f.fileno())

    def retry_errors(self) -> set[str]:
        """Set errors.jsonl aside (errors-<ts>.retried.jsonl) and return its ids, no longer done."""
        with self._lock:
            self._check_open()
            ids = set(self._error_ids)
            if not ids:
                return ids
            self._errors_f.close()
            stamp = time.strftime("%Y%m%dT%H%M%S")
            dest = self.dir / f"errors-{stamp}.retried.jsonl"
            n = 1
            while dest.exists():
                n += 1
                dest = self.dir / f"errors-{stamp}-{n}.retried.jsonl"
            os.rename(self.errors_path, dest)
            fsync(self.dir)
            self._errors_f = open(self.errors_path, "ab")
            if self._done is not None:
                for i in ids:
                    self._done.discard(i)
            self._error_ids = []
            self._errors = 0
            log.info("%s: %d errors set aside in %s for retry", self.dir, len(ids), dest.name)
            return ids

    def counts(self) -> dict[str, int]:
        """completed (committed + buffered), committed, buffered, shards, errors, rejects, dropped."""
        with self._lock:
            return {
                "completed": self._committed + len(self._buffer),
                "committed": self._committed,
                "buffered": len(self._buffer),
                "shards": self._shards,
                "errors": self._errors,
                "rejects": self._rejects,
                "quality_rejects": len(self._quality_ids),
                "dropped": self._dropped,  # add_result/add_error calls refused: id already done
            }

    def discard_buffer(self) -> int:
        """Drop the buffered (uncommitted) rows; how many. After a full disk or a removed directory the
        job's last word is already counted: a commit at close, once space was freed (the reserve), would
        keep rows the manifest and the message do not count. They are generated again on resume."""
        with self._lock:
            n, self._buffer, self._buffer_chars = len(self._buffer), [], 0
        return n

    def close(self) -> None:
        """Commit what is buffered, close the files, release the directory lock. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                for f in (self._errors_f, self._rejects_f, self._quality_f):
                    try:
                        f.close()
                    except OSError:
                        pass
                self._release_lock()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ResultStore({str(self.dir)!r}, {self.counts()})"
