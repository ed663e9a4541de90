"""Reading an output directory (its layout: `store`'s docstring): committed results, errors,
rejects, quality rejects. For export, checks, the multi-node merge, the CLI and tests;
`ResultStore` is the one writer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from fleet.generation.data.jsonl import read_jsonl
from fleet.generation.data.schema import COLUMN_SET, NESTED_COLUMNS, RESULT_COLUMNS, RESULT_SCHEMA, upgrade_column

__all__ = ["ERRORS_FILE", "QUALITY_REJECTS", "REJECTS_FILE", "SHARDS_DIR", "SHARD_RE", "iter_results", "read_errors",
           "read_quality_rejects", "read_rejects", "read_results", "shard_paths", "shard_seq"]

# The names of an output directory, as store.py's docstring draws them.
SHARDS_DIR = "shards"
ERRORS_FILE = "errors.jsonl"
REJECTS_FILE = "rejects.jsonl"
QUALITY_REJECTS = "quality_rejects.jsonl"
SHARD_RE = re.compile(r"^part-(\d{6,})\.parquet$")


def shard_paths(out_dir: str | Path) -> list[Path]:
    """Committed shards, in commit order (temp files are never listed)."""
    d = Path(out_dir) / SHARDS_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := SHARD_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def read_errors(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of errors.jsonl: id, error, attempts, line, server, status, at."""
    return read_jsonl(Path(out_dir) / ERRORS_FILE)


def read_quality_rejects(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of quality_rejects.jsonl: id, line, reasons, attempts, at, row (the result row)."""
    return read_jsonl(Path(out_dir) / QUALITY_REJECTS)


def read_rejects(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of rejects.jsonl: line, id, reason, duplicate, raw, at."""
    return read_jsonl(Path(out_dir) / REJECTS_FILE)


def shard_seq(path: Path) -> int:
    """The commit number of a shard that `shard_paths` listed (part-000012.parquet: 12)."""
    m = SHARD_RE.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not a result shard (part-NNNNNN.parquet)")
    return int(m.group(1))


def _shard_batches(path: Path | IO[bytes], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    pf = pq.ParquetFile(path, pre_buffer=not isinstance(path, Path))   # a remote file: coalesced range reads
    file_schema = pf.schema_arrow
    have = set(file_schema.names)
    present = [c for c in columns if c in have]
    schema = pa.schema([RESULT_SCHEMA.field(c) for c in columns])
    stale = {c for c in present if c in NESTED_COLUMNS and file_schema.field(c).type != RESULT_SCHEMA.field(c).type}
    for batch in pf.iter_batches(batch_size=batch_rows, columns=present):
        if len(present) == len(columns) and not stale:
            yield batch
            continue
        # A shard from before a column existed: the column reads as nulls; one from
        # before nested types: its JSON strings are decoded.
        arrays = [(upgrade_column(batch.column(c), c) if c in stale else batch.column(c)) if c in have
                  else pa.nulls(batch.num_rows, RESULT_SCHEMA.field(c).type) for c in columns]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def iter_results(out_dir: str | Path, columns: list[str] | None = None,
                 batch_rows: int = 8192) -> Iterator[pa.RecordBatch]:
    """Stream committed results as record batches (one shard in memory at most per batch). `out_dir` may
    be an object-storage URL: its shards are read from there, only the columns asked for."""
    cols = list(columns) if columns is not None else list(RESULT_COLUMNS)
    unknown = [c for c in cols if c not in COLUMN_SET]
    if unknown:
        raise ValueError(f"unknown result column(s) {unknown}; columns: {', '.join(RESULT_COLUMNS)}")
    from fleet.generation.data.objstore import Store, is_url

    if is_url(str(out_dir)):
        store = Store(str(out_dir))
        for _, name in sorted((int(m.group(1)), n) for n in store.names(SHARDS_DIR) if (m := SHARD_RE.match(n))):
            with store.fs.open(store._p(f"{SHARDS_DIR}/{name}"), "rb", cache_type="none") as f:
                yield from _shard_batches(f, cols, batch_rows)
        return
    for path in shard_paths(out_dir):
        yield from _shard_batches(path, cols, batch_rows)


def read_results(out_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Every committed result as one table (small jobs and tests; stream with iter_results)."""
    cols = list(columns) if columns is not None else list(RESULT_COLUMNS)
    schema = pa.schema([RESULT_SCHEMA.field(c) for c in cols])
    return pa.Table.from_batches(list(iter_results(out_dir, cols)), schema=schema)
