"""One job over several nodes: the chunk plan, the assignment state and the merge (Prefect-free).

A multi-node job is many ordinary single-node jobs. The input is cut once, at the job's start,
into chunks of whole input lines (JSONL) or rows (Parquet); each chunk is a file of its own,
run by the usual detached runner on one node into its own output directory, so exactly-once
within a chunk, resume, crash recovery and server relaunch are the single-node machinery's.
What is new lives here:

- `plan_sizes`: chunk sizes by *factoring* (guided self-scheduling): each round of one chunk
  per node takes half of what is left, between a floor and a ceiling. Early chunks are big (few
  runner starts), the last ones smaller. These are the sizes before any node's rate is known;
  they depend only on the row count, the node count and `chunk_rows`, and are written to
  `plan.json`: a re-run reads them back, never re-derives different ones.
- `chunk_rows_for` / `finishes_first`: once nodes' rates are measured, a node's next chunk is a
  few minutes of its work but at most its share of half of what is left (so the last chunks end
  together), and a slow node leaves a chunk to a faster one that would end it sooner.
  `Assignments.claim` cuts a longer first-time chunk to that size (`split_chunk`: the rest is a
  new chunk at the end of the plan, recorded as a line of the state log before the head's file
  changes; plan.json is rewritten at the log's compaction, and `load_plan` replays the cuts since).
- `split_input`: writes the chunk files (JSONL lines copied byte for byte, Parquet row slices
  with the input's schema) and the plan, atomically. A JSONL or Parquet input on object storage is
  read in place instead: its chunks are byte ranges (JSONL) or row ranges (Parquet) of it
  (`ranges.py`), and only plan.json is written. Without a --limit a JSONL input's ranges are cut
  from its size (`approx` chunks: estimated lines, each runner aligning its range by the split rule).
- `Assignments`: which chunk is pending, running where, done; which node is lost. Pull: a node
  asks for work when it has none (`claim`), so a faster node takes more chunks. Every change is a
  line appended (fsync'd) to `state.jsonl` before it is acted on, compacted now and then into the
  snapshot `state.json` (journal.py: O(1) bytes per change), so a killed controller loses
  nothing: the next one reads them and re-attaches to the runners they name. A job on object
  storage keeps a copy of the plan and the state under `<output>/_control/`: a controller on
  another machine resumes from there.
- `merge`: every chunk's output into one directory `fleet export` reads unchanged.

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

import bisect
import contextlib
import fcntl
import gzip
import io
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleet.generation.data.durable import write_json_atomic
from fleet.generation.data.objstore import Store, is_url

__all__ = ["Chunk", "Plan", "Assignments", "attempt_spans", "plan_sizes", "split_input", "load_plan", "merge",
           "plan_dir_for", "PLAN_FILE", "STATE_FILE", "ControllerLock", "busy_seconds", "chunk_rows_for", "chunks_before", "finishes_first",
           "split_chunk", "apply_cut", "grow_plan", "CHUNK_TARGET_S", "MIN_CHUNK_S", "write_manifest_to", "read_state"]

PLAN_FILE = "plan.json"
STATE_FILE = "state.json"
PLAN_VERSION = 1


# ---------------------------------------------------------------------------- the plan


def plan_sizes(total: int, nodes: int, chunk_rows: int | None = None) -> list[int]:
    """Chunk sizes for `total` rows over `nodes` nodes (factoring, see the module docstring).

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


CHUNK_TARGET_S = 180.0   # a chunk is a few minutes of work at the node's measured rate
MIN_CHUNK_S = 15.0       # and never less than this: below it a runner's start (~8 s here) is most of the chunk


def chunk_rows_for(rate: float | None, rates: dict[str, float], rows_left: int, *,
                   target_s: float = CHUNK_TARGET_S, min_s: float = MIN_CHUNK_S,
                   total: float | None = None) -> int | None:
    """Rows of a node's next chunk from its measured rate (rows/s), or None before it is known.

    `rates`: the measured rate of every live node (this one included); `rows_left`: rows not yet
    handed out. The chunk is `target_s` of the node's work, but never more than its share (its
    rate over all rates) of half of what is left: factoring by capacity, so chunks shrink towards
    the end and the nodes' last chunks end together. At least `min_s` of work (a runner start must
    pay), at most what is left. Before any rate is known, the plan's cut stands (`plan_sizes`).
    `total`: the rates' sum when the caller keeps it (the controller's `RateView`), else summed here
    exactly (`math.fsum`: the same value however it was summed)."""
    if rate is None or rate <= 0 or rows_left <= 0:
        return None
    if total is None:
        total = math.fsum(r for r in rates.values() if r > 0)
    total = total or rate
    guided = rows_left * (rate / max(total, rate)) / 2
    want = min(rate * target_s, guided)
    return max(1, min(rows_left, math.ceil(max(want, rate * min_s))))


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: the time a node had at least one chunk running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def chunks_before(mine: float, busy: float, rate: float, rows: int) -> int:
    """How many chunks of `rows` a node of `rate` rows/s, free in `busy` s, ends strictly before `mine` s."""
    x = (mine - busy) * rate / rows
    return max(0, math.ceil(x) - 1) if x > 0 else 0


def finishes_first(rows: int, rate: float | None, others: list[tuple[float, float]], free_s: float = 0.0,
                   pending_rows: int | None = None) -> bool:
    """Should a node of `rate` rows/s, free in `free_s` (the rest of the chunk it drains, when it asks
    early), take a chunk of `rows`? Not when the faster nodes (`others`: (free_s, rate) of the other live
    nodes) would end all the pending work (`pending_rows`, this chunk included; default: this chunk
    alone) sooner than it would end this chunk: a slow node that takes the last chunk is what makes a
    job's tail long. While there is more pending than the faster nodes can end first, it takes it: at
    1,000 nodes a faster node ending this one chunk sooner is nearly always true, and leaving every
    chunk to one kept half the nodes idle while chunks waited (the scale bench's fifth limit). Unknown
    rates: take it. (The controller asks `RateView.sooner`: the same rule, naming the node.)"""
    if not rate or rate <= 0:
        return True
    mine = free_s + rows / rate
    need = math.ceil((pending_rows or rows) / rows)
    return sum(chunks_before(mine, busy, r, rows) for busy, r in others if r > rate) < need


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


# ---------------------------------------------------------------------------- assignment state


def _boot_id() -> str | None:
    """This machine's boot (Linux): monotonic readings of one boot compare, across processes too."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


BOOT_ID = _boot_id()


@dataclass
class Attempt:
    node: str
    output: str                      # the chunk's output directory on that node
    started_at: float                # wall clock: timestamps for people
    ended_at: float | None = None
    outcome: str | None = None       # done / lost / failed / None while it runs
    detail: str | None = None
    fetched: bool = False            # its output (or its committed shards so far) are gathered locally
    mono: list[float] | None = None  # [start, end] on the controller's monotonic clock: durations
    boot: str | None = None          # the boot those readings belong to (None: not comparable)


def attempt_spans(attempts: list[Attempt]) -> list[tuple[float, float]]:
    """(start, end) of each ended attempt, all on one clock: the monotonic one when this boot measured
    every one of them (a wall-clock step — NTP, `date -s` — cannot move it), else the wall clock
    (attempts recorded by an older controller, or before a reboot)."""
    ended = [a for a in attempts if a.ended_at is not None]
    if BOOT_ID is not None and all(a.boot == BOOT_ID and a.mono and len(a.mono) == 2 for a in ended):
        return [(a.mono[0], a.mono[1]) for a in ended if a.mono]
    return [(a.started_at, a.ended_at) for a in ended if a.ended_at is not None]


@dataclass
class ChunkState:
    state: str = "pending"           # pending / running / done
    node: str | None = None
    attempts: list[Attempt] = field(default_factory=list)


class Assignments:
    """Pull-based assignment of chunks to nodes, every change persisted (a line of `state.jsonl`, the
    snapshot `state.json` rewritten now and then: journal.py) before the method that made it returns.

    Thread-safe (one controller, one thread per node). A chunk is claimed by one node at a time;
    a lost node's chunks go back to pending (their attempts stay, for the merge and the audit)."""

    def __init__(self, plan_dir: str | Path, plan: Plan, mirror: Store | None = None) -> None:
        from fleet.generation.multinode.journal import StateLog

        self.path = Path(plan_dir) / STATE_FILE
        self.plan = plan
        self._lock = threading.RLock()
        self.chunks: dict[int, ChunkState] = {c.index: ChunkState() for c in plan.chunks}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.started_at = time.time()
        # What is derived from the whole state (each node's running chunks and finished rows, the pending
        # chunks in input order) is kept up to date by each change (every one ends in `_save`) for the
        # chunks it touched (`_index`). Scanned per node per question, it cost O(nodes × chunks) per
        # decision (seconds at 1,000 nodes); rebuilt from every chunk once per change, O(chunks) per
        # decision once most decisions follow a change (after the tail rule's fix: 2.1 ms at 300 nodes,
        # ≈ 90 % of it the node rates' pass over every attempt — the scale bench's sixth limit).
        self._on_node: dict[str, set[int]] = {}             # node -> the chunks it runs or ran (any attempt)
        self._pending_keys: list[tuple[int, int]] = []      # (first_line, index) of the pending chunks: input order
        self._pending_at: dict[int, tuple[tuple[int, int], int]] = {}   # index -> (its key, its lines counted)
        self._pending_rows = 0
        self._finished: dict[str, tuple[int, float]] = {}   # node -> `finished_on`, until a change touches it
        # the nodes each change touched (a chunk's node, its attempts' nodes, a node's own record), since
        # the controller last took them (`take_touched`): it evaluates only those nodes' rates again
        self.touched: set[str] = set()
        self._plan_dirty = False   # a cut is in the log, not yet in plan.json (written at compaction)
        # idle nodes waiting for a change that concerns them (`watch`): node -> (its event, the nodes it
        # waits on; None: any change)
        self._watchers: dict[str, tuple[threading.Event, frozenset[str] | None]] = {}
        # state.json (a snapshot) + state.jsonl (a line per change since): journal.py. `mirror`: the
        # job's `_control/` on object storage, where every change is put too.
        self.log = StateLog(plan_dir, mirror)
        d = self.log.load()
        for k, v in d["chunks"].items():
            self.chunks[int(k)] = ChunkState(state=v["state"], node=v.get("node"),
                                             attempts=[Attempt(**a) for a in v.get("attempts", [])])
        self.nodes = d["nodes"]
        self.events = d["events"]
        self.started_at = d.get("started_at") or self.started_at
        self._left = sum(1 for c in self.chunks.values() if c.state != "done")   # chunks not done
        for i in self.chunks:
            self._index(i)

    def _index(self, i: int) -> None:
        """Bring the indexes (`_on_node`, the pending chunks in input order and their lines) up to date
        with chunk `i` as it is now: every change calls it for each chunk it touched (`_save`)."""
        c = self.chunks[i]
        for node in {a.node for a in c.attempts} | ({c.node} if c.node is not None else set()):
            self._on_node.setdefault(node, set()).add(i)
        was = self._pending_at.pop(i, None)
        if was is not None:
            del self._pending_keys[bisect.bisect_left(self._pending_keys, was[0])]
            self._pending_rows -= was[1]
        if c.state == "pending":
            chunk = self.plan.chunks[i]
            key = (chunk.first_line, i)
            bisect.insort(self._pending_keys, key)
            self._pending_at[i] = (key, chunk.lines)
            self._pending_rows += chunk.lines

    def snapshot(self) -> dict[str, Any]:
        """The whole state as one JSON object (state.json's content; `read_state`)."""
        with self._lock:
            return {"started_at": self.started_at, "updated_at": time.time(),
                    "chunks": {str(i): asdict(c) for i, c in self.chunks.items()},
                    "nodes": self.nodes, "events": self.events[-500:]}

    def _save(self, chunks: tuple[int, ...] = (), nodes: tuple[str, ...] = (),
              event: dict[str, Any] | None = None, cut: dict[str, Any] | None = None, freed: bool = False) -> None:
        """Record one change: the chunks and nodes it touched, as they are now, and its event (one line
        of the log, O(1) bytes; the snapshot is rewritten when the log has grown to its size), then wake
        the idle nodes it concerns (`freed`: a chunk went back to the queue)."""
        touched = set(nodes)
        for i in chunks:
            c = self.chunks[i]
            touched.update(a.node for a in c.attempts)
            if c.node is not None:
                touched.add(c.node)
            self._index(i)
        self.touched |= touched
        for node in touched:
            self._finished.pop(node, None)
        rec: dict[str, Any] = {} if self.log.seq else {"started_at": self.started_at}   # the job's first change
        if chunks:
            rec["chunks"] = {str(i): asdict(self.chunks[i]) for i in chunks}
        if nodes:
            rec["nodes"] = {n: self.nodes[n] for n in nodes}
        if event is not None:
            rec["event"] = event
        if cut is not None:
            rec["cut"] = cut
        self.log.append(rec)
        if self.log.due():
            del self.events[:-500]
            self.compact()
        self._wake(touched, freed or self._left == 0)

    def watch(self, node: str, event: threading.Event, deps: frozenset[str] | None = None) -> None:
        """Set `event` at the next change that may change node `node`'s answer when it asks for work: one
        that touches the node itself or one of `deps` (the faster node it leaves the next chunk to takes a
        chunk, finishes one, is lost), a chunk handed back to the queue (lost, failed), the job's end.
        `deps` None: any change (from before the question until its answer names what it waits on)."""
        with self._lock:
            self._watchers[node] = (event, deps)

    def unwatch(self, node: str) -> None:
        with self._lock:
            self._watchers.pop(node, None)

    def wake_all(self) -> None:
        with self._lock:
            for ev, _ in self._watchers.values():
                ev.set()

    def _wake(self, touched: set[str], freed: bool) -> None:
        """The watchers this change concerns (`watch`). Every idle node asking at every poll whether or not
        anything changed was the 1,000-node bench's count of decisions: 572,860 in 500 s."""
        for node, (ev, deps) in self._watchers.items():
            if freed or deps is None or node in touched or not deps.isdisjoint(touched):
                ev.set()

    def compact(self) -> None:
        """Write the snapshot now (also when the log is due, and at the end of a job: state.json then
        holds it all), plan.json first when a cut changed it: the log's cut lines go with the compaction."""
        with self._lock:
            if self._plan_dirty:
                write_json_atomic(self.path.parent / PLAN_FILE, self.plan.to_dict())
                self._plan_dirty = False
            self.log.compact(self.snapshot())

    def close(self) -> None:
        self.log.close()

    def _event(self, what: str, **kw: Any) -> dict[str, Any]:
        ev = {"at": time.time(), "event": what, **kw}
        self.events.append(ev)
        return ev

    def take_touched(self) -> set[str]:
        """The nodes touched by the changes since the last call (and forget them)."""
        with self._lock:
            out, self.touched = self.touched, set()
            return out

    def running_on(self, node: str) -> list[int]:
        """The chunks running on `node`, in index order: from the chunks it ever had (`_on_node`), not all."""
        with self._lock:
            return sorted(i for i in self._on_node.get(node, ())
                          if self.chunks[i].state == "running" and self.chunks[i].node == node)

    def finished_on(self, node: str) -> tuple[int, float]:
        """(lines of the chunks `node` finished, its busy seconds over them: the union of those attempts'
        spans), from that node's chunks only, kept until a change touches the node. The controller's
        measured rate of the node (`Controller.node_rate`)."""
        with self._lock:
            got = self._finished.get(node)
            if got is None:
                rows, done = 0, []
                for i in self._on_node.get(node, ()):
                    for a in self.chunks[i].attempts:
                        if a.node == node and a.outcome == "done" and a.ended_at:
                            rows += self.plan.chunks[i].lines
                            done.append(a)
                got = self._finished[node] = (rows, busy_seconds(attempt_spans(done)) if done else 0.0)
            return got

    def pending(self) -> list[int]:
        """Pending chunks in input order (a chunk cut in two has its rest at the end of the list)."""
        with self._lock:
            return [i for _, i in self._pending_keys]

    def rows_pending(self) -> int:
        return self._pending_rows

    def first_pending(self) -> int | None:
        """The first pending chunk in input order (kept in order change by change: `_index`)."""
        with self._lock:
            return self._pending_keys[0][1] if self._pending_keys else None

    def claim(self, node: str, output_for: Callable[[int], str] | None = None, *, another: bool = False,
              rows: int | None = None, min_rest: int = 0) -> int | None:
        """The chunk `node` works on next: one it already runs (re-attach), else the first pending,
        which is marked running on `node` at once (with `output_for`), so two nodes never take one chunk.
        `another`: a pending chunk even though the node runs one (started while that one drains).
        `rows`: the size this node's chunks should have now (`chunk_rows_for`): a first-time chunk
        longer than that is cut (`split_chunk`) and the rest stays pending — unless the rest would be
        shorter than a quarter of `rows` or than `min_rest` (a chunk that is mostly runner start)."""
        with self._lock:
            if self.nodes.get(node, {}).get("state") == "lost":
                return None
            mine = self.running_on(node)
            if mine and not another:
                return mine[0]
            i = self._first_pending_for(node)
            if i is None:
                return None
            if rows is not None and not self.chunks[i].attempts and \
                    self.plan.chunks[i].lines - rows > max(1, rows // 4, min_rest):
                split_chunk(self.path.parent, self.plan, i, rows, commit=self._cut)
            if output_for is not None:
                self.start(i, node, output_for(i))
            return i

    def _first_pending_for(self, node: str) -> int | None:
        """The first pending chunk in input order that did not fail on `node`, else the first pending: a
        chunk's retry prefers another node (a node whose runners fail took the same chunk three times and
        failed the job while a healthy node sat idle: issue 35)."""
        for _, i in self._pending_keys:
            if not any(a.node == node and a.outcome == "failed" for a in self.chunks[i].attempts):
                return i
        return self.first_pending()

    def _cut(self, head: Chunk, rest: Chunk) -> None:
        """Record a cut (`split_chunk`'s commit): one line of the log with the head and the rest, O(1)
        bytes. plan.json, rewritten whole per cut before (1.3 MB at 1,000 nodes, thousands of cuts a
        job), is written at the next compaction (`_save`); `load_plan` replays the cuts logged since."""
        self.chunks[rest.index] = ChunkState()
        self._left += 1
        self._plan_dirty = True
        self._save((head.index, rest.index), cut={"head": asdict(head), "rest": asdict(rest)},
                   event=self._event("cut", chunk=head.index, rows=head.lines, rest=rest.index))

    def start(self, index: int, node: str, output: str) -> tuple[Attempt, bool]:
        """Record `node` running chunk `index` into `output`: (the attempt, True when it is new).
        A running attempt of the same node is kept (a new controller re-attaching)."""
        with self._lock:
            c = self.chunks[index]
            if c.state == "running" and c.node == node and c.attempts and c.attempts[-1].outcome is None:
                return c.attempts[-1], False
            if c.state == "done":
                raise ValueError(f"chunk {index} is already done")
            c.state, c.node = "running", node
            a = Attempt(node=node, output=output, started_at=time.time(), mono=[time.monotonic()], boot=BOOT_ID)
            c.attempts.append(a)
            self._save((index,), event=self._event("start", chunk=index, node=node))
            return a, True

    def finish(self, index: int, node: str, outcome: str, detail: str | None = None, fetched: bool = False) -> None:
        """End the running attempt of `node` on chunk `index`: done, or failed/lost (back to pending)."""
        with self._lock:
            c = self.chunks[index]
            for a in reversed(c.attempts):
                if a.node == node and a.outcome is None:
                    a.outcome, a.detail, a.ended_at = outcome, detail, time.time()
                    if a.mono:
                        a.mono = [a.mono[0], time.monotonic()]
                    a.fetched = a.fetched or fetched
                    break
            freed = False
            if c.state == "running" and c.node == node:
                if outcome == "done":
                    c.state = "done"
                    self._left -= 1
                else:
                    c.state, c.node = "pending", None
                    freed = True
            self._save((index,), event=self._event(outcome, chunk=index, node=node, detail=detail), freed=freed)

    def mark_fetched(self, index: int, output: str) -> None:
        with self._lock:
            changed = False
            for a in self.chunks[index].attempts:
                if a.output == output and not a.fetched:
                    a.fetched = changed = True
            if changed:   # asked at every gather: a line only when it says something new
                self._save((index,))

    def node_lost(self, node: str, reason: str) -> list[int]:
        """Mark `node` lost: its running chunks go back to pending. Returns them."""
        with self._lock:
            released = self.running_on(node)
            for i in released:
                self.finish(i, node, "lost", reason)
            self.nodes[node] = {"state": "lost", "since": time.time(), "reason": reason,
                                "losses": self.nodes.get(node, {}).get("losses", 0) + 1}
            self._save(nodes=(node,), event=self._event("node-lost", node=node, detail=reason, released=released))
            return released

    def node_ok(self, node: str) -> None:
        with self._lock:
            prev = self.nodes.get(node, {})
            if prev.get("state") == "ok":
                return
            self.nodes[node] = {**prev, "state": "ok", "since": time.time()}
            ev = self._event("node-rejoined", node=node) if prev.get("state") == "lost" else None
            self._save(nodes=(node,), event=ev)

    def attempts_failed(self, index: int) -> int:
        with self._lock:
            return sum(1 for a in self.chunks[index].attempts if a.outcome == "failed")

    def all_done(self) -> bool:
        with self._lock:
            return all(c.state == "done" for c in self.chunks.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = {"pending": 0, "running": 0, "done": 0}
            for c in self.chunks.values():
                out[c.state] = out.get(c.state, 0) + 1
            return out

    def sources(self) -> list[tuple[Chunk, list[Attempt]]]:
        """Each chunk with its attempts in merge order: the one that finished it first, then the others
        by when they ended (see the merge rule in the module docstring)."""
        with self._lock:
            out = []
            for c in sorted(self.plan.chunks, key=lambda c: c.first_line):   # input order: first wins
                atts = list(self.chunks[c.index].attempts)
                atts.sort(key=lambda a: (a.outcome != "done", a.ended_at or float("inf")))
                out.append((c, atts))
            return out


def read_state(plan_dir: str | Path) -> dict[str, Any] | None:
    """A job's assignment state as one object (what state.json held whole before the log): every chunk
    of the plan, its attempts, the nodes, the last events. None before a plan. Reads only."""
    plan = load_plan(plan_dir)
    if plan is None:
        return None
    return Assignments(plan_dir, plan).snapshot()


class ControllerLock:
    """One controller per multi-node job: an fcntl lock on `plan_dir/.controller.lock`."""

    def __init__(self, plan_dir: str | Path) -> None:
        self.path = Path(plan_dir) / ".controller.lock"
        self._f: Any = None

    def __enter__(self) -> ControllerLock:
        from fleet.errors import JobConflict

        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            # a second job into one job's directory: the CLI's exit 2, as for one node
            raise JobConflict(f"another controller (pid {holder}) is running this multi-node job",
                              remedy="wait for it, or stop it (its runners keep going) and run the command again; "
                                     "to run a second job, give it its own --output")
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._f = f
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()
            self._f = None


# ---------------------------------------------------------------------------- the merge


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
