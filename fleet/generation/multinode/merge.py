"""A multi-node job's merge (Prefect-free): every chunk's output into one directory `fleet export` reads unchanged.

The merge rule (first wins, keyed by id). Chunk outputs are read in input order (by each chunk's
first line: a chunk cut in two keeps its place), and within a
chunk attempt by attempt in the order the attempts ended (the attempt that finished the chunk
first, then any attempt abandoned on a lost node). Then:

1. a completed id is kept from the first shard that holds it; any later copy is dropped
   (a chunk re-run after a node loss, a lost node's runner that finished anyway, or the same
   id on two input lines in different chunks) and counted in `manifest.merge.duplicates_dropped`;
2. an error is kept only for an id completed nowhere, once (the first);
3. rejects and quality rejects are kept once per id/original line, their `line` turned from
   the chunk file's line into the input's (a size-cut chunk's: `line` null, `chunk_line` its own).

So every id of the input appears exactly once, in exactly one of results / errors / rejects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.generation.data.objstore import Store
from fleet.generation.multinode.planning import Chunk


@dataclass
class Source:
    """One chunk attempt's output directory: gathered locally (a path), or on object storage (a URL)."""

    chunk: Chunk
    node: str
    dir: Path | str


def _jsonl(store: Store, name: str) -> Iterator[dict[str, Any]]:
    from fleet.generation.data.jsonl import read_jsonl as _read_jsonl

    if store.local:
        yield from _read_jsonl(Path(store.path) / name)
        return
    data = store.read_bytes(name)
    for line in (data or b"").splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def write_manifest_to(dest: Store, manifest: dict[str, Any]) -> None:
    """manifest.json under `dest`, whole or not at all (a local directory: `write_manifest`'s fsync'd rename)."""
    from fleet.generation.data.manifest import MANIFEST_FILE, write_manifest

    if dest.local:
        write_manifest(dest.path, manifest)
    else:
        dest.write_bytes(MANIFEST_FILE, (json.dumps(manifest, indent=2, ensure_ascii=False, default=str) + "\n").encode())


def merge(sources: list[Source], dest: str | Path, *, extra_manifest: dict[str, Any] | None = None,
          kept: list[int] | None = None) -> dict[str, Any]:
    """Merge chunk outputs (in merge order, see the module docstring) into `dest`; return its manifest.

    `dest` gets shards/part-NNNNNN.parquet (a shard with no duplicate is copied as it is — on one
    object store, a server-side copy — one with duplicates is rewritten without them), errors.jsonl,
    rejects.jsonl, quality_rejects.jsonl and manifest.json (last) — the layout of a single-node
    output. Sources and `dest` may be local directories or object-storage URLs. `kept`, when given, gets
    the completed rows kept from each source, in the sources' order (the job's summed checks are exact
    only when every row of the counting attempts is kept and no other)."""
    from fleet.generation.data.results import QUALITY_REJECTS

    out = Store(str(dest))
    _clear_shards(out)
    seen: set[int] = set()   # digests of the ids written: first wins
    stores = [(src, Store(str(src.dir))) for src in sources]
    n_shard, completed, dropped = _merge_shards(stores, out, seen, kept)
    n_err = _write_lines(out, "errors.jsonl", _merged_errors(stores, seen))
    n_rej = _write_lines(out, "rejects.jsonl", _merged_by_line(stores, "rejects.jsonl"))
    n_qrej = _write_lines(out, QUALITY_REJECTS, _merged_by_line(stores, QUALITY_REJECTS))
    manifest = {
        "state": "done", "complete": True,
        "counts": {"completed": completed, "errors": n_err, "rejects": n_rej, "quality_rejects": n_qrej,
                   "shards": n_shard},
        "accounted": completed + n_err + n_rej + n_qrej,
        "merge": {"rule": "first wins by id: chunk order, then the attempt that finished the chunk, then "
                          "abandoned attempts by end time; an error only for an id completed nowhere",
                  "sources": len(sources), "duplicates_dropped": dropped},
        **(extra_manifest or {}),
    }
    write_manifest_to(out, manifest)
    return manifest


def _clear_shards(out: Store) -> None:
    """An empty shards/ under `out` (a merge before this one, cut short, may have left some)."""
    import shutil

    from fleet.generation.data.results import SHARDS_DIR

    if out.local:
        shards = Path(out.path) / SHARDS_DIR
        if shards.exists():
            shutil.rmtree(shards)
        shards.mkdir(parents=True)
        return
    for name in out.names(SHARDS_DIR):
        out.fs.rm(f"{out.path}/{SHARDS_DIR}/{name}")


def _merge_shards(stores: list[tuple[Source, Store]], out: Store, seen: set[int],
                  kept: list[int] | None = None) -> tuple[int, int, int]:
    """Every source's shards into `out`'s shards/, each id once (`seen`); (shards, rows, duplicates dropped).
    `kept`: filled with the rows kept from each source."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleet.generation.job.publish import store_shards
    from fleet.generation.data.rows import digest

    dropped = 0
    n_shard = 0
    completed = 0
    for _, store in stores:
        if kept is not None:
            kept.append(0)
        for name in store_shards(store):
            # only the footer and the id column's pages: through s3fs's default read-ahead cache a
            # shard was fetched whole (in 50 MB blocks) to read its ids (issue 35's request log)
            with store.fs.open(store._p(f"shards/{name}"), "rb", cache_type="none") as f:
                ids = pq.ParquetFile(f, pre_buffer=True).read(columns=["id"]).column(0).to_pylist()
            keep = []
            for i, rid in enumerate(ids):
                d = digest(rid)
                if d in seen:
                    dropped += 1
                else:
                    seen.add(d)
                    keep.append(i)
            if not keep:
                continue
            n_shard += 1
            target = f"shards/part-{n_shard:06d}.parquet"
            if len(keep) == len(ids):
                out.copy_from(store, f"shards/{name}", target)
            else:
                with store.open_read(f"shards/{name}") as f:
                    table = pq.read_table(f)
                with out.open_write(target) as g:
                    pq.write_table(table.take(pa.array(keep, type=pa.int64())), g)
            completed += len(keep)
            if kept is not None:
                kept[-1] += len(keep)
    return n_shard, completed, dropped


def _write_lines(out: Store, name: str, records: Iterator[dict[str, Any]]) -> int:
    n = 0
    with out.open_write(name) as f:
        for rec in records:
            f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
            n += 1
    return n


def _merged_errors(stores: list[tuple[Source, Store]], seen: set[int]) -> Iterator[dict[str, Any]]:
    """The errors of ids written nowhere yet (not completed, not already an error), lines made the job's."""
    from fleet.generation.data.rows import digest

    for src, store in stores:
        for rec in _jsonl(store, "errors.jsonl"):
            d = digest(str(rec.get("id")))
            if d in seen:
                continue
            seen.add(d)
            rec = _job_line(dict(rec), src.chunk)
            rec["chunk"] = src.chunk.index
            yield rec


def _job_line(rec: dict[str, Any], chunk: Chunk) -> dict[str, Any]:
    """`rec`'s `line` (of the chunk's input) made the job input's. A size-cut chunk does not know its
    first line (nothing counted the lines before it): `line` is None and `chunk_line` the chunk's line."""
    if isinstance(rec.get("line"), int):
        if chunk.approx:
            rec["chunk_line"], rec["line"] = rec["line"], None
        else:
            rec["line"] = rec["line"] + chunk.first_line - 1
    return rec


def _merged_by_line(stores: list[tuple[Source, Store]], name: str) -> Iterator[dict[str, Any]]:
    """The records of file `name` (rejects, quality rejects), one per job line, lines made the job's."""
    lines: set[tuple[int, int]] = set()   # (the chunk's first byte in a size-cut plan, else 0; the line)
    for src, store in stores:
        for rec in _jsonl(store, name):
            rec = _job_line(dict(rec), src.chunk)
            line = rec.get("chunk_line") if src.chunk.approx else rec.get("line")
            if isinstance(line, int):
                key = ((src.chunk.span or [0])[0] if src.chunk.approx else 0, line)
                if key in lines:
                    continue
                lines.add(key)
            rec["chunk"] = src.chunk.index
            yield rec
