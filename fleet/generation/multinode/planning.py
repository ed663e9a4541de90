"""A multi-node job's chunk plan (Prefect-free): its sizes, the plan file, the input cut into chunks.

`plan_sizes` (factoring), `Chunk` / `Plan` (plan.json), `split_input` (chunk files, or an object-storage
input read in place: byte or row ranges), `split_chunk` (a claim's cut), `grow_plan` (a larger --limit),
`load_plan` (plan.json with the cuts logged since). The whole story: chunks.py's docstring.
"""

from __future__ import annotations

import gzip
import io
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleet.generation.data.durable import write_json_atomic
from fleet.generation.data.objstore import is_url

PLAN_FILE = "plan.json"
STATE_FILE = "state.json"
PLAN_VERSION = 1


# ---------------------------------------------------------------------------- the plan


def plan_sizes(total: int, nodes: int, chunk_rows: int | None = None) -> list[int]:
    """Chunk sizes for `total` rows over `nodes` nodes (factoring, see chunks.py's docstring).

    `chunk_rows` is the ceiling (default: total / (8 × nodes), between 100 and 20,000); the
    floor is a quarter of it: the last chunks are smaller, but each still pays for its runner's
    start. Shorter ones, sized in seconds of work, are cut at claim time once the nodes' rates
    are known (`chunk_rows_for`); a sixteenth here made tails of chunks mostly runner start."""
    if total <= 0:
        return []
    nodes = max(1, nodes)
    ceiling = chunk_rows or min(20_000, max(100, math.ceil(total / (8 * nodes))))
    floor = max(1, ceiling // 4)
    sizes: list[int] = []
    left = total
    while left > 0:
        size = min(ceiling, max(floor, math.ceil(left / (2 * nodes))))
        for _ in range(nodes):
            take = min(size, left)
            if take <= 0:
                break
            sizes.append(take)
            left -= take
    return sizes


@dataclass(frozen=True)
class Chunk:
    index: int
    first_line: int     # 1-based line (JSONL) / row (Parquet) of the input where the chunk starts
    lines: int          # input lines (or rows) in the chunk, blank lines included
    file: str           # the chunk's input file, relative to the plan directory ("" when read in place)
    span: list[int] | None = None   # [start, end) bytes of the plan's JSONL input URL, read in place (ranges.py)
    # a size-cut chunk (ranges.size_cut): `first_line` and `lines` are estimates from the input's bytes per
    # line, its span is cut at any byte, and the lines it holds are the split rule's (those starting in it)
    approx: bool = False
    # ("" file and no span in a Parquet plan: rows first_line … of its input URL, read in place)

    @property
    def name(self) -> str:
        return f"chunk-{self.index:05d}"


@dataclass
class Plan:
    input: str
    input_id: dict[str, Any]          # the input's version when it was cut: its pin (fleet.generation.data.pin)
    total_lines: int
    chunk_rows: int | None
    nodes: list[str]
    chunks: list[Chunk]
    fmt: str                          # "jsonl" or "parquet"
    created_at: float = field(default_factory=time.time)
    version: int = PLAN_VERSION
    # the --limit the chunks were cut to (None: the whole input) and the non-blank rows they hold;
    # both None in a plan from before they were recorded (`grow_plan` then counts the input)
    limit: int | None = None
    rows: int | None = None

    @property
    def whole_input(self) -> bool:
        """Its chunks hold every row of the input (cut without a limit, or the input ended before it)."""
        return self.rows is not None and (self.limit is None or self.rows < self.limit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["chunks"] = [Chunk(**c) for c in d["chunks"]]
        return cls(**d)


def plan_dir_for(root: str | Path, fleet_name: str, output: str) -> Path:
    """The controller's directory of one multi-node job: plan, state, chunk files, gathered outputs."""
    key = hashlib.sha256(output.encode()).hexdigest()[:10]
    return Path(root) / f"{fleet_name}-{key}"


def input_id(path: str | Path) -> dict[str, Any]:
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _open_lines(path: Path) -> gzip.GzipFile | io.BufferedReader:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _count(path: Path, limit: int | None) -> tuple[str, int, int]:
    """(format, lines to take, non-blank rows among them): every line (JSONL) / row (Parquet), up to
    `limit` non-blank rows. The lines taken under a larger limit start with those taken under a smaller."""
    if _is_parquet(path):
        import pyarrow.parquet as pq

        n = pq.ParquetFile(path).metadata.num_rows
        n = n if limit is None else min(n, limit)
        return "parquet", n, n
    lines = rows = 0
    with _open_lines(path) as f:
        for line in f:
            if limit is not None and rows >= limit:
                break
            lines += 1
            if not line.isspace():
                rows += 1
    return "jsonl", lines, rows


def load_plan(plan_dir: str | Path) -> Plan | None:
    """plan.json with the cuts made since it was written (lines of the state log, `Assignments.claim`)."""
    from fleet.generation.multinode.journal import StateLog

    try:
        plan = Plan.from_dict(json.loads((Path(plan_dir) / PLAN_FILE).read_text()))
    except FileNotFoundError:
        return None
    for rec in StateLog(plan_dir).read_log():
        if rec.get("cut"):
            apply_cut(plan, rec["cut"])
    return plan


def apply_cut(plan: Plan, cut: dict[str, Any]) -> None:
    """One cut (`{"head": chunk, "rest": chunk}`, as logged) onto `plan`: the head replaces its chunk,
    the rest is the chunk of its index (appended when it is the next one). Applying a cut the plan
    already holds changes nothing: plan.json written at a compaction holds the cuts still in the log."""
    from fleet.errors import FatalError

    head, rest = Chunk(**cut["head"]), Chunk(**cut["rest"])
    if rest.index > len(plan.chunks):
        raise FatalError(f"a cut names chunk {rest.index} but the plan has {len(plan.chunks)} chunks",
                         remedy="restore the job directory from a backup, or move it aside to start the job afresh")
    plan.chunks[head.index] = head
    if rest.index == len(plan.chunks):
        plan.chunks.append(rest)
    else:
        plan.chunks[rest.index] = rest


def split_input(input_path: str | Path, plan_dir: str | Path, nodes: list[str], *, chunk_rows: int | None = None,
                limit: int | None = None) -> Plan:
    """Cut the input into chunk files under `plan_dir/inputs/` and write `plan.json` (last, atomically).

    An existing plan for the same input (same size and mtime) is kept whatever the nodes now are:
    the chunks of a job never change once cut. When this call asks for more rows than it holds (a
    larger `limit`, or none, after a job cut to a limit), the lines after its last chunk are cut into
    new chunks (`grow_plan`). A plan for another input raises ConfigError (one output, one job)."""
    from fleet.errors import ConfigError

    if is_url(str(input_path)):
        return _split_in_place(str(input_path), Path(plan_dir), nodes, chunk_rows=chunk_rows, limit=limit)
    src = Path(input_path)
    pdir = Path(plan_dir)
    old = load_plan(pdir)
    ident = input_id(src)
    if old is not None:
        if old.input_id.get("path") != ident["path"]:
            raise ConfigError(f"this output already belongs to a multi-node job over {old.input} "
                              f"({old.input_id.get('size')} bytes); the input now is {ident['path']} "
                              f"({ident['size']} bytes)",
                              remedy="give another --output for another input, or run the same input again to resume")
        from fleet.generation.data.pin import check_local

        check_local(str(src), old.input_id)   # the same file, rewritten since the plan: InputChanged
        return grow_plan(old, src, pdir, limit)
    fmt, total, rows = _count(src, limit)
    chunks = _cut(src, pdir, fmt, first_line=1, index=0, lines=total, nodes=len(nodes), chunk_rows=chunk_rows)
    plan = Plan(input=str(src.resolve()), input_id=ident, total_lines=total, chunk_rows=chunk_rows, nodes=list(nodes),
                chunks=chunks, fmt=fmt, limit=limit, rows=rows)
    write_json_atomic(pdir / PLAN_FILE, plan.to_dict())
    return plan


def _split_in_place(url: str, pdir: Path, nodes: list[str], *, chunk_rows: int | None,
                    limit: int | None) -> Plan:
    """`split_input` for an input on object storage read in place: chunks are byte ranges of a JSONL
    input or row ranges of a Parquet one (ranges.py); no file is written but plan.json. The same rules:
    a plan is kept, grown, or refused for another input."""
    from fleet.errors import ConfigError
    from fleet.generation.data.pin import check
    from fleet.generation.data.ranges import is_parquet, url_id

    old = load_plan(pdir)
    if old is not None:
        if old.input.rstrip("/") != url.rstrip("/"):
            raise ConfigError(f"this output already belongs to a multi-node job over {old.input}; the input now "
                              f"is {url}",
                              remedy="give another --output for another input, or run the same input again to resume")
        check(url, old.input_id)   # its pinned version still there (InputChanged else): the chunks are its ranges
        if old.whole_input or (limit is not None and old.limit is not None and limit <= old.limit):
            return old
    ident = old.input_id if old is not None else url_id(url)
    fmt = old.fmt if old is not None else ("parquet" if is_parquet(url) else "jsonl")
    plan = old or Plan(input=url, input_id=ident, total_lines=0, chunk_rows=chunk_rows, nodes=list(nodes), chunks=[],
                       fmt=fmt, limit=limit, rows=0)
    (_grow_parquet_in_place if fmt == "parquet" else _grow_jsonl_in_place)(url, plan, limit)
    plan.limit = limit
    pdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(pdir / PLAN_FILE, plan.to_dict())
    return plan


def _grow_jsonl_in_place(url: str, plan: Plan, limit: int | None) -> None:
    """The JSONL input's lines after the plan's last chunk, up to `limit` rows in all, as new byte-range
    chunks: one pass over those lines only (it starts where the plan's lines end)."""
    from fleet.generation.data.ranges import cut, scan, size_cut

    if limit is None and not plan.chunks:   # the whole input: cut from its size, nothing of it read here
        total, spans = size_cut(url, plan.input_id, lambda n: plan_sizes(n, len(plan.nodes), plan.chunk_rows))
        for first, lines, span in spans:
            plan.chunks.append(Chunk(index=len(plan.chunks), first_line=first, lines=lines, file="", span=span,
                                     approx=True))
        plan.total_lines = plan.rows = total
        return
    # a --limit counts rows: the lines up to it are scanned (and a plan cut to a limit grows from its end)
    start = max((c.span[1] for c in plan.chunks if c.span is not None), default=0)
    ix = scan(url, limit, first_line=plan.total_lines + 1, start=start, rows=plan.rows or 0, pin=plan.input_id)
    if ix.lines and ix.rows > (plan.rows or 0):   # not only blank lines after the plan's
        for first, lines, span in cut(ix, plan_sizes(ix.lines, len(plan.nodes), plan.chunk_rows)):
            plan.chunks.append(Chunk(index=len(plan.chunks), first_line=first, lines=lines, file="", span=span))
        plan.total_lines += ix.lines
    plan.rows = ix.rows


def _grow_parquet_in_place(url: str, plan: Plan, limit: int | None) -> None:
    """The Parquet input's rows after the plan's last chunk, up to `limit`, as new row-range chunks
    (`file` "" and no `span`: rows first_line … of the input, read by the runner with ranges.read_rows)."""
    from fleet.generation.data.ranges import parquet_rows

    total = parquet_rows(url, plan.input_id)
    total = total if limit is None else min(total, limit)
    first = plan.total_lines + 1
    for n in plan_sizes(total - plan.total_lines, len(plan.nodes), plan.chunk_rows):
        plan.chunks.append(Chunk(index=len(plan.chunks), first_line=first, lines=n, file=""))
        first += n
    plan.total_lines = max(plan.total_lines, total)
    plan.rows = plan.total_lines


def grow_plan(plan: Plan, src: Path, pdir: Path, limit: int | None) -> Plan:
    """`plan`, with the input's lines after its last chunk cut into new chunks when a call with `limit`
    asks for more rows than it holds (each input line is in exactly one chunk: no row twice).

    The new chunk files are written first, plan.json last (atomically): a controller killed between
    leaves the old plan, and the next call cuts the same lines again."""
    if plan.whole_input or (limit is not None and plan.limit is not None and limit <= plan.limit):
        return plan
    fmt, total, rows = _count(src, limit)
    if total < plan.total_lines:    # a plan from before `limit` was recorded, asked for fewer rows
        return plan
    if total > plan.total_lines and (plan.rows is None or rows > plan.rows):   # not only blank lines after
        plan.chunks += _cut(src, pdir, fmt, first_line=plan.total_lines + 1, index=len(plan.chunks),
                            lines=total - plan.total_lines, nodes=len(plan.nodes), chunk_rows=plan.chunk_rows)
        plan.total_lines = total
    plan.limit, plan.rows = limit, rows   # what the chunks now hold: the next call need not count
    write_json_atomic(pdir / PLAN_FILE, plan.to_dict())
    return plan


def _cut(src: Path, pdir: Path, fmt: str, *, first_line: int, index: int, lines: int, nodes: int,
         chunk_rows: int | None) -> list[Chunk]:
    """Write the chunk files of the input's `lines` lines from `first_line` on (chunk numbers from `index`)."""
    (pdir / "inputs").mkdir(parents=True, exist_ok=True)
    chunks: list[Chunk] = []
    first = first_line
    for i, n in enumerate(plan_sizes(lines, nodes, chunk_rows), index):
        chunks.append(Chunk(index=i, first_line=first, lines=n,
                            file=f"inputs/chunk-{i:05d}.{'parquet' if fmt == 'parquet' else 'jsonl'}"))
        first += n
    if chunks:
        (_split_parquet if fmt == "parquet" else _split_jsonl)(src, pdir, chunks)
    return chunks


def split_chunk(plan_dir: str | Path, plan: Plan, index: int, rows: int,
                commit: Callable[[Chunk, Chunk], None] | None = None) -> Chunk:
    """Cut chunk `index` (pending, never attempted) after its first `rows` lines: the rest becomes a
    new chunk at the end of `plan.chunks`. Returns the new chunk.

    `commit(head, rest)` records the cut durably; the cut happens there (`Assignments.claim`: a line of
    the state log, O(1) bytes; by default plan.json rewritten whole). Order of writes, for a controller
    killed at any point: the rest's file, then the head's file aside, then the commit, then the head's
    file in place. Killed (or the commit failed) before the commit: nothing changed (the rest's file is
    an orphan, written again by the next cut; a commit that failed leaves the head's file whole). Killed after it, before the head's file is replaced: the
    head's runner reads the rest's lines too; the merge drops their second copies (first wins)."""
    pdir = Path(plan_dir)
    c = plan.chunks[index]
    if not 0 < rows < c.lines:
        raise ValueError(f"cannot cut chunk {index} of {c.lines} lines after {rows}")

    def record(head: Chunk, rest: Chunk) -> None:
        # in memory first, as the log line will say (a line whose PUT failed is put with the next one);
        # a failed commit raises before the head's file is replaced: that file still holds every line
        plan.chunks[index] = head
        plan.chunks.append(rest)
        (commit or (lambda h, r: write_json_atomic(pdir / PLAN_FILE, plan.to_dict())))(head, rest)

    if not c.file:   # read in place: the cut is two byte (JSONL) or row (Parquet) ranges, the commit the only write
        from fleet.generation.data.ranges import cut_bytes, split_span

        if c.span is None:
            head_span, rest_span = None, None
        elif c.approx:   # cut at a byte, nothing read: the halves own the whole's lines between them
            head_span, rest_span = cut_bytes(c.span, rows, c.lines)
        else:
            head_span, rest_span = split_span(plan.input, c.span, rows, plan.input_id)
        new = Chunk(index=len(plan.chunks), first_line=c.first_line + rows, lines=c.lines - rows, file="",
                    span=rest_span, approx=c.approx)
        record(Chunk(index=c.index, first_line=c.first_line, lines=rows, file="", span=head_span,
                     approx=c.approx), new)
        return new
    new = Chunk(index=len(plan.chunks), first_line=c.first_line + rows, lines=c.lines - rows,
                file=f"inputs/chunk-{len(plan.chunks):05d}.{'parquet' if plan.fmt == 'parquet' else 'jsonl'}")
    head = Chunk(index=c.index, first_line=c.first_line, lines=rows, file=c.file)
    head_tmp = pdir / (c.file + ".head.tmp")
    if plan.fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(pdir / c.file)
        pq.write_table(table.slice(rows), pdir / (new.file + ".tmp"))
        pq.write_table(table.slice(0, rows), head_tmp)
    else:
        with open(pdir / c.file, "rb") as f, open(head_tmp, "wb") as h, open(pdir / (new.file + ".tmp"), "wb") as r:
            for i, line in enumerate(f):
                (h if i < rows else r).write(line)
            for out in (h, r):
                out.flush()
                os.fsync(out.fileno())
    os.replace(pdir / (new.file + ".tmp"), pdir / new.file)
    record(head, new)
    os.replace(head_tmp, pdir / c.file)
    return new


def _split_jsonl(src: Path, pdir: Path, chunks: list[Chunk]) -> None:
    """The chunks' files; they are consecutive, from `chunks[0].first_line` on."""
    with _open_lines(src) as f:
        for _ in range(chunks[0].first_line - 1):
            f.readline()
        for c in chunks:
            tmp = pdir / (c.file + ".tmp")
            with open(tmp, "wb") as out:
                for _ in range(c.lines):
                    line = f.readline()
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, pdir / c.file)


def _split_parquet(src: Path, pdir: Path, chunks: list[Chunk]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src)
    batches = pf.iter_batches(batch_size=8192)
    pending: list[pa.RecordBatch] = []
    have = 0
    skip = chunks[0].first_line - 1   # the chunks are consecutive, from chunks[0].first_line on
    while skip > 0:
        b = next(batches)
        if b.num_rows > skip:
            pending, have = [b.slice(skip)], b.num_rows - skip
        skip -= min(skip, b.num_rows)
    for c in chunks:
        while have < c.lines:
            b = next(batches)
            pending.append(b)
            have += b.num_rows
        table = pa.Table.from_batches(pending, schema=pf.schema_arrow)
        tmp = pdir / (c.file + ".tmp")
        pq.write_table(table.slice(0, c.lines), tmp)
        os.replace(tmp, pdir / c.file)
        rest = table.slice(c.lines)
        pending = rest.to_batches()
        have = rest.num_rows
