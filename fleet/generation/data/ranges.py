"""Chunks of an input on object storage, read in place: byte ranges of JSONL, row ranges of Parquet.

An uncompressed JSONL input at a URL is never copied by the controller, and without a --limit never
read either (`size_cut`): the plan is cut at byte offsets from the object's size (its pin), sized by
the bytes per line of its first SAMPLE bytes, and each runner aligns its range to whole lines by the
standard split rule (`read_span`: a range owns the lines that start in it), so the offsets may fall
anywhere; a claim-time cut is a byte too (`cut_bytes`). Ids do not depend on a line's place (an id-less
row's is its content's hash). With a --limit, which counts rows, the controller streams the input once,
keeping counters and a sparse index of line starts (`scan`): the line count and the non-blank rows
(the plan's sizes need the total, `--limit` counts rows), and the byte offset of every `step`-th
line. `step` is 1 (every line) up to `INDEX_ENTRIES` lines and doubles whenever the index fills, so
memory stays bounded whatever the input's size (8 MB of offsets). The plan's chunk boundaries are
then taken at indexed lines (`cut`): exactly the plan's sizes up to a million lines, sizes rounded
to a multiple of `step` lines beyond (chunks are cut again by the nodes' measured rates at claim
time anyway). A chunk is then `span` = [start, end) of the input; the runner on a node reads exactly
that range (`read_span`). A chunk cut at claim time (`split_span`) reads only its own range to find
the cut. (It used to stream the input twice: once to count, once to find each chunk's offset.)

A Parquet input at a URL is read in place too, by rows: a chunk is rows [first, first + lines) of
the input; the plan needs only the file's footer (`parquet_rows`), and the runner reads only the row
groups that hold its rows (`read_rows`: pyarrow over an fsspec file, the footer and those row
groups' column chunks fetched by range). Rows cut inside a row group cost the reader the part of
that group before them: inputs written with row groups of at most a chunk's size read least.

A gzip stream cannot be entered at an offset: a gzip input is read once by the controller and cut
into chunk objects (`fleet.generation.job.publish.stage_input` and the chunk files of
`chunks.split_input`, put under `<output>/_inputs/`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.generation.data.objstore import Store

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["INDEX_ENTRIES", "LineIndex", "cut", "in_place", "is_parquet", "parquet_rows", "read_rows", "read_span",
           "scan", "size_cut", "cut_bytes", "split_span", "url_id"]

INDEX_ENTRIES = 1 << 20   # line starts kept at most (8 bytes each); past it, every other one is dropped
BLOCK = 1 << 24           # bytes read per request while scanning (fewer, larger GETs)


def _parent(url: str) -> tuple[Store, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return Store(parent), name


def _head(url: str) -> bytes:
    store, name = _parent(url)
    data: bytes = store.fs.cat_file(store._p(name), start=0, end=4)
    return data


def in_place(url: str) -> bool:
    """Whether the input at `url` can be read in place (JSONL by byte ranges, Parquet by rows): not gzip."""
    return _head(url)[:2] != b"\x1f\x8b"


def is_parquet(url: str) -> bool:
    return _head(url) == b"PAR1"


def url_id(url: str) -> dict[str, Any]:
    """What identifies the input's version: its pin (fleet.generation.data.pin: size, and the ETag / VersionId,
    generation, or Hub commit and blob id)."""
    from fleet.generation.data.pin import pin_of

    return pin_of(url)


@dataclass
class LineIndex:
    """What one pass over a JSONL input found (see the module docstring)."""

    first_line: int            # the 1-based line the pass started at
    start: int                 # its byte offset
    lines: int = 0             # lines taken from `first_line` on, blank ones included
    rows: int = 0              # non-blank rows up to the last line taken, those before `first_line` included
    end: int = 0               # the byte offset just after the last line taken
    step: int = 1              # `starts[k]` is the offset of line `first_line + k * step`
    starts: array[int] = field(default_factory=lambda: array("q"))


def scan(url: str, limit: int | None, *, first_line: int = 1, start: int = 0, rows: int = 0,
         entries: int = INDEX_ENTRIES, pin: dict[str, Any] | None = None) -> LineIndex:
    """One pass over the input from byte `start` (line `first_line`, `rows` non-blank rows before it):
    the lines up to `limit` non-blank rows in all, and the index of their starts (as chunks._count
    counts: the lines taken under a larger limit start with those taken under a smaller).

    The fsspec file is read through io.BufferedReader in BLOCK-sized requests: iterating its own lines
    goes through fsspec's `readuntil`, which reads (and copies) a whole block, 50 MB on s3fs, per line."""
    import io

    from fleet.generation.data.pin import check, source

    fs, path, kw = source(url, pin)
    ix = LineIndex(first_line=first_line, start=start, rows=rows, end=start)
    starts, step, pos = ix.starts, 1, start
    with fs.open(path, "rb", cache_type="none", **kw) as raw:   # big sequential reads: no read-ahead
        if start:
            raw.seek(start)
        for n, line in enumerate(io.BufferedReader(raw, BLOCK)):
            if limit is not None and ix.rows >= limit:
                break
            if n % step == 0:
                starts.append(pos)
                if len(starts) > entries:
                    starts, step = starts[::2], step * 2
            pos += len(line)
            ix.lines = n + 1
            if not line.isspace():
                ix.rows += 1
    ix.starts, ix.step, ix.end = starts, step, pos
    check(url, pin)   # the offsets are the pinned version's
    return ix


def cut(ix: LineIndex, sizes: list[int]) -> list[tuple[int, int, list[int]]]:
    """(first line, lines, [start, end) bytes) of consecutive chunks of about `sizes` lines from the
    index's first line: each boundary taken at the nearest indexed line (exact while `step` is 1)."""
    if not sizes or ix.lines <= 0:
        return []
    bounds = [0]
    at = 0
    for size in sizes[:-1]:
        at += size
        k = min(round(at / ix.step), (ix.lines - 1) // ix.step)
        if k * ix.step > bounds[-1]:
            bounds.append(k * ix.step)
    out = []
    for i, b in enumerate(bounds):
        n = (bounds[i + 1] if i + 1 < len(bounds) else ix.lines) - b
        end = ix.starts[bounds[i + 1] // ix.step] if i + 1 < len(bounds) else ix.end
        out.append((ix.first_line + b, n, [ix.starts[b // ix.step], end]))
    return out


AHEAD = 1 << 13   # bytes read past a range's end with it, to finish its last line in the same request


def _align(fs: Any, path: str, kw: dict[str, Any], span: list[int], size: int | None) -> bytes:
    """The bytes of the whole lines that start in [span[0], span[1]): the standard split rule (Hadoop's
    input splits). A line starts at `start` exactly when the byte before it is a newline, so the range is
    read with that byte and AHEAD bytes past its end, skipped to its first newline (unless `start` is 0),
    and cut after the first newline at or past its last byte; a last line longer than that is finished by
    reads past it, each twice as long, until it has ended (or the input has)."""
    start, end = span
    if size is None:   # no pin to say it: a read past the object's end is refused (416), not short
        size = int(fs.size(path))
    lo = start - 1 if start > 0 else 0
    hi = min(size, end + AHEAD)
    data: bytes = fs.cat_file(path, start=lo, end=hi, **kw)
    begin = 0
    if start > 0:
        nl = data.find(b"\n")
        if nl < 0 or lo + nl + 1 >= end:   # no line starts in the range (one long line crosses it)
            return b""
        begin = nl + 1
    if end <= lo:
        return b""
    k = data.find(b"\n", end - 1 - lo)
    if k >= 0:
        return data[begin:k + 1]
    out, at, more = data[begin:], hi, AHEAD * 2
    while at < size:
        tail: bytes = fs.cat_file(path, start=at, end=min(size, at + more), **kw)
        if not tail:
            break
        nl = tail.find(b"\n")
        if nl >= 0:
            return out + tail[:nl + 1]
        out += tail
        at += len(tail)
        more *= 2
    return out


def read_span(url: str, span: list[int], pin: dict[str, Any] | None = None) -> bytes:
    """The whole lines a chunk's byte range owns (the standard split rule: `_align`), ending with a
    newline, of the pinned version (InputChanged when it is not there). A range cut at line starts (a
    plan that scanned the input) reads exactly its bytes; one cut at any byte (`size_cut`) finds its
    lines here, on the runner: the controller never reads the input to cut it."""
    from fleet.generation.data.pin import check, source

    fs, path, kw = source(url, pin)
    size = (pin or {}).get("size")
    data = _align(fs, path, kw, span, int(size) if size else None)
    check(url, pin)
    return data if data.endswith(b"\n") or not data else data + b"\n"


def split_span(url: str, span: list[int], rows: int, pin: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """A chunk's range cut after its first `rows` lines: (head, rest). Reads the range: for a plan cut at
    line starts (a --limit counts rows); a size-cut chunk is cut at a byte instead (`cut_bytes`)."""
    data = read_span(url, span, pin)
    at = 0
    for _ in range(rows):
        at = data.index(b"\n", at) + 1
    return [span[0], span[0] + at], [span[0] + at, span[1]]


def cut_bytes(span: list[int], rows: int, lines: int) -> tuple[list[int], list[int]]:
    """A size-cut chunk's range cut at the byte `rows / lines` of the way through it, with no read: by
    the split rule the two halves own between them exactly the lines the whole owned."""
    start, end = span
    at = start + max(1, min(end - start - 1, round((end - start) * rows / max(1, lines))))
    return [start, at], [at, end]


SAMPLE = 1 << 16   # bytes of the input's head read to estimate its bytes per line


def size_cut(url: str, pin: dict[str, Any], sizes_for: Any) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """A JSONL input on a store cut from its size (the pin's), not its content: (estimated lines,
    [(estimated first line, estimated lines, [start, end) bytes)]). One read of its first SAMPLE bytes
    estimates the bytes per line; `sizes_for(lines)` gives the chunks' sizes in lines (`plan_sizes`),
    turned into byte offsets. The estimates steer sizing and progress only: which lines a chunk holds
    is the split rule's (`read_span`), exact whatever the estimate."""
    from fleet.generation.data.pin import source

    size = int(pin.get("size") or 0)
    if size <= 0:
        return 0, []
    fs, path, kw = source(url, pin)
    head: bytes = fs.cat_file(path, start=0, end=min(size, SAMPLE), **kw)
    whole = len(head) >= size   # a small input: its line count is exact
    lines = head.count(b"\n") + (1 if whole and not head.endswith(b"\n") else 0)
    per_line = len(head) / lines if lines else float(size)
    total = max(1, round(size / per_line))
    out: list[tuple[int, int, list[int]]] = []
    at, first = 0, 1
    sizes = sizes_for(total)
    for i, n in enumerate(sizes):
        end = size if i == len(sizes) - 1 else min(size, at + max(1, round(n * per_line)))
        if end <= at:
            continue
        out.append((first, n, [at, end]))
        at, first = end, first + n
    if out and out[-1][2][1] < size:
        out[-1][2][1] = size
    return total, out


# ---------------------------------------------------------------------------- Parquet


def _parquet(url: str, pin: dict[str, Any] | None) -> Any:
    """The file at `url` (its pinned version) as a pyarrow ParquetFile over fsspec, fetching only what is
    read: no read-ahead cache (s3fs would fetch 50 MB blocks), pyarrow's own coalesced range reads."""
    import pyarrow.parquet as pq

    from fleet.generation.data.pin import source

    fs, path, kw = source(url, pin)
    f = fs.open(path, "rb", cache_type="none", **kw)
    return pq.ParquetFile(f, pre_buffer=True)


def parquet_rows(url: str, pin: dict[str, Any] | None = None) -> int:
    """The input's row count, from its footer."""
    from fleet.generation.data.pin import check

    pf = _parquet(url, pin)
    try:
        n = int(pf.metadata.num_rows)
    finally:
        pf.close()
    check(url, pin)
    return n


def read_rows(url: str, first: int, count: int, pin: dict[str, Any] | None = None) -> pa.Table:
    """Rows [first, first + count) (0-based) of the Parquet input, reading only the row groups that hold
    them, of the pinned version (InputChanged when it is not there)."""
    from fleet.generation.data.pin import check

    table = _read_rows(url, first, count, pin)
    check(url, pin)
    return table


def _read_rows(url: str, first: int, count: int, pin: dict[str, Any] | None) -> pa.Table:
    import pyarrow as pa  # noqa: F401  (the annotation's)

    pf = _parquet(url, pin)
    try:
        md = pf.metadata
        groups: list[int] = []
        skip = 0
        at = 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if at + n > first and at < first + count:
                if not groups:
                    skip = first - at
                groups.append(g)
            at += n
        if not groups:
            return pf.schema_arrow.empty_table()
        table: pa.Table = pf.read_row_groups(groups)
        return table.slice(skip, count)
    finally:
        pf.close()
