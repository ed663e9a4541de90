"""Where input rows come from: JSONL (plain or gzip) and Parquet readers, and the clear
`InputError`s of a missing, unreadable, corrupt or truncated input (line and byte of the break).

Only the standard library and pyarrow: a node's runner venv has no numpy.
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from fleet.errors import InputError
from fleet.generation.data.jsonl import loads_utf8
from fleet.generation.data.rows import Bad, InputStats, strip_none

__all__ = ["bad_json_reason", "count_rows", "input_fingerprint", "input_lines", "is_parquet", "jsonl_rows",
           "open_text", "parquet_rows"]

_INPUT_REMEDY = "pass an existing --input file (JSONL, JSONL.gz or Parquet)"


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except FileNotFoundError:
        raise InputError(f"input file {path} not found", remedy=_INPUT_REMEDY) from None
    except IsADirectoryError:
        raise InputError(f"input {path} is a directory",
                         remedy="pass one file (JSONL, JSONL.gz or Parquet); concatenate several first") from None
    except PermissionError:
        raise InputError(f"input {path} is not readable (permission denied)",
                         remedy="make it readable by the user fleet runs as, or copy it somewhere readable") from None
    except OSError as exc:
        raise InputError(f"input {path} cannot be opened: {exc.strerror or exc}", remedy=_INPUT_REMEDY) from None


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq") or _magic(path) == b"PAR1"


def open_text(path: Path) -> gzip.GzipFile | BinaryIO:
    if _magic(path)[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


# A truncated or corrupt .gz fails mid-stream with these; a disk/NFS read error with OSError.
_READ_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, OSError)


def _corrupt(path: Path, exc: BaseException, line: int, offset: int, raw_pos: int | None) -> InputError:
    gz = raw_pos is not None
    at = (f"after line {line:,} (reading stopped at byte {offset:,} of the decompressed text, about byte "
          f"{raw_pos:,} of the file)" if gz else f"after line {line:,} (reading stopped at byte {offset:,})")
    what = "is corrupt or truncated" if isinstance(exc, (EOFError, zlib.error, gzip.BadGzipFile)) else "could not be read"
    return InputError(f"input {path} {what} {at}: {type(exc).__name__}: {exc}",
                      remedy="the rows before that point are kept; replace the file with a complete copy "
                             "(`gzip -t` checks one), then run the same command: the rows done are skipped")


def input_lines(path: Path) -> Iterator[bytes]:
    """The file's lines (gzip transparently); a corrupt/truncated stream raises InputError with its offset."""
    f = open_text(path)
    raw = getattr(f, "fileobj", None)   # GzipFile: the compressed file, for the byte position
    n = 0
    with f:
        try:
            for line in f:   # one try around the loop: no per-line cost on the hot path
                n += 1
                yield line
        except _READ_ERRORS as exc:
            pos = None
            if raw is not None:
                try:
                    pos = raw.tell()
                except (OSError, ValueError):
                    pos = 0
            try:
                offset = f.tell()   # the logical (decompressed) position reached
            except (OSError, ValueError):
                offset = 0
            raise _corrupt(path, exc, n, offset, pos) from exc



def bad_json_reason(exc: ValueError) -> str:
    return "not UTF-8" if isinstance(exc, UnicodeDecodeError) or "utf-8" in str(exc).lower() else f"bad JSON: {exc}"



def jsonl_rows(path: Path, stats: InputStats) -> Iterator[tuple[int, Any, bytes | None]]:
    """(line, parsed object or Bad, raw bytes); blank lines counted, not yielded."""
    for n, line in enumerate(input_lines(path), 1):
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        try:
            obj = loads_utf8(line)
        except ValueError as exc:
            if not line.strip():
                stats.blank += 1
                continue
            yield n, Bad(bad_json_reason(exc)), line
            continue
        yield n, obj, line


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    _magic(path)   # missing / directory / unreadable: the same clear errors as JSONL
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a corrupt or truncated footer
        raise InputError(f"input {path} is not a readable Parquet file (corrupt or truncated footer): "
                         f"{type(exc).__name__}: {exc}",
                         remedy="replace it with a complete copy (pyarrow.parquet.ParquetFile must open it), "
                                "or give JSONL") from exc


def parquet_rows(path: Path, stats: InputStats, batch_rows: int = 2048) -> Iterator[tuple[int, Any, None]]:
    pf = _parquet_file(path)
    n = 0
    batches = pf.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
            rows = batch.to_pylist() if batch is not None else None
        except Exception as exc:  # a corrupt page: ArrowInvalid / OSError from pyarrow
            raise InputError(f"input {path} is corrupt after row {n:,} (of {pf.metadata.num_rows:,} in its footer): "
                             f"{type(exc).__name__}: {exc}",
                             remedy="the rows before it are kept; replace the file with a complete copy, then "
                                    "run the same command: the rows done are skipped") from exc
        if rows is None:
            return
        for row in rows:
            n += 1
            yield n, strip_none(row), None



def input_fingerprint(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes, streamed: the identity of an input in job.json and the manifest."""
    h = hashlib.sha256()
    _magic(Path(path))  # a clear error for a missing file
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def count_rows(path: str | Path) -> int:
    """Rows in the input: non-blank lines (JSONL) or the row count in the Parquet footer.

    A corrupt or truncated file raises InputError naming the line and byte where it breaks."""
    path = Path(path)
    if is_parquet(path):
        return int(_parquet_file(path).metadata.num_rows)
    n = 0
    for line in input_lines(path):
        if not line.isspace():
            n += 1
    return n
