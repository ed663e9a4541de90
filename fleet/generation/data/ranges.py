"""Chunks of a JSONL input on object storage, read in place: byte ranges instead of chunk files.

An uncompressed JSONL input at a URL is never copied by the controller. It reads the input as a
stream, twice, keeping nothing but counters: once to count its lines (the plan's sizes need the
total), once to note the byte offset where each chunk starts. A chunk is then `span` = [start,
end) of the input; the runner on a node reads exactly that range (`read_span`). A chunk cut at
claim time (`split_span`) reads only its own range to find the cut.

What needs a sequential read is not cut this way: a gzip stream cannot be entered at a byte
offset, and a Parquet file's unit is its row groups, not the plan's row counts; those inputs are
read once by the controller and cut into chunk objects (`fleet.generation.job.publish.stage_input`
and the chunk files of `chunks.split_input`).
"""

from __future__ import annotations

from collections.abc import Iterator

from fleet.generation.data.objstore import Store

__all__ = ["in_place", "read_span", "span_offsets", "split_span", "url_id", "count_lines"]


def _parent(url: str) -> tuple[Store, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return Store(parent), name


def in_place(url: str) -> bool:
    """Whether the input at `url` can be read in byte ranges: not gzip, not Parquet."""
    store, name = _parent(url)
    with store.open_read(name) as f:
        head = f.read(4)
    return not (head[:2] == b"\x1f\x8b" or head == b"PAR1")


def url_id(url: str) -> dict[str, object]:
    """What identifies the input's version: its size and its ETag (or modification time)."""
    store, name = _parent(url)
    store.fs.invalidate_cache(store._p(name))
    info = store.fs.info(store._p(name))
    stamp = info.get("ETag") or info.get("LastModified") or info.get("mtime")
    return {"path": url, "size": int(info.get("size") or 0), "mtime_ns": str(stamp)}


def _lines(url: str) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of every line of the input, streamed."""
    store, name = _parent(url)
    offset = 0
    with store.open_read(name) as f:
        for line in f:
            yield offset, line
            offset += len(line)


def count_lines(url: str, limit: int | None) -> tuple[int, int]:
    """(lines to take, non-blank rows among them), up to `limit` non-blank rows (as chunks._count)."""
    lines = rows = 0
    for _, line in _lines(url):
        if limit is not None and rows >= limit:
            break
        lines += 1
        if not line.isspace():
            rows += 1
    return lines, rows


def span_offsets(url: str, first_line: int, sizes: list[int]) -> list[list[int]]:
    """The [start, end) byte range of each of consecutive chunks of `sizes` lines from `first_line` on."""
    from itertools import accumulate

    want = list(accumulate(sizes, initial=first_line))   # the 1-based lines whose start offsets bound them
    bounds: list[int] = []
    end = 0
    for n, (offset, line) in enumerate(_lines(url), 1):
        if n == want[len(bounds)]:
            bounds.append(offset)
            if len(bounds) == len(want):
                break
        end = offset + len(line)
    while len(bounds) < len(want):   # the last chunk ends at the end of the input
        bounds.append(end)
    return [[bounds[i], bounds[i + 1]] for i in range(len(sizes))]


def read_span(url: str, span: list[int]) -> bytes:
    """The bytes of one chunk, ending with a newline."""
    store, name = _parent(url)
    data: bytes = store.fs.cat_file(store._p(name), start=span[0], end=span[1])
    return data if data.endswith(b"\n") or not data else data + b"\n"


def split_span(url: str, span: list[int], rows: int) -> tuple[list[int], list[int]]:
    """A chunk's range cut after its first `rows` lines: (head, rest)."""
    data = read_span(url, span)
    cut = 0
    for _ in range(rows):
        cut = data.index(b"\n", cut) + 1
    return [span[0], span[0] + cut], [span[0] + cut, span[1]]
