"""Planning a JSONL input on object storage: one pass (`ranges.scan` + `ranges.cut`, now) against the
two passes it replaced (count the lines, then find each chunk's start offset, both by iterating the
fsspec file's lines), side by side on one input in moto's S3 server on loopback.

    .venv/bin/python bench/bench_store_scan.py [ROWS] [OLD_ROWS]

OLD_ROWS (default ROWS) sizes the input of the old way on S3 separately (in memory it runs at ROWS too): its line iteration goes through
fsspec's `readuntil`, which reads a whole block (s3fs: 50 MB) for each line, so it is slow at scale.
Reports wall seconds, and the bytes fetched from the server (s3fs's ranged GETs, counted); the same
input in fsspec's in-memory filesystem too (`memory://`: the scan's own cost, no server). moto's
server copies the whole object for every ranged GET, so its times grow with requests × object size,
which a real S3 does not do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.generation.data import ranges  # noqa: E402
from fleet.generation.data.objstore import Store  # noqa: E402
from fleet.generation.multinode.chunks import plan_sizes  # noqa: E402

FETCHED = [0]


def _count_fetches() -> None:
    import s3fs.core

    fetch, cat = s3fs.core._fetch_range, s3fs.core.S3FileSystem._cat_file

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        data = fetch(*a, **kw)
        FETCHED[0] += len(data)
        return data

    async def counted_cat(fs, *a, **kw):  # type: ignore[no-untyped-def]
        data = await cat(fs, *a, **kw)
        FETCHED[0] += len(data)
        return data

    s3fs.core._fetch_range = counted
    s3fs.core.S3FileSystem._cat_file = counted_cat


def _old_lines(url: str) -> Iterator[tuple[int, bytes]]:
    parent, _, name = url.rpartition("/")
    offset = 0
    with Store(parent).open_read(name) as f:
        for line in f:
            yield offset, line
            offset += len(line)


def old_plan(url: str, nodes: int) -> list[list[int]]:
    """The two passes, as ranges.count_lines + ranges.span_offsets did them."""
    lines = 0
    for _ in _old_lines(url):
        lines += 1
    sizes = plan_sizes(lines, nodes)
    want = list(accumulate(sizes, initial=1))
    bounds: list[int] = []
    end = 0
    for n, (offset, line) in enumerate(_old_lines(url), 1):
        if n == want[len(bounds)]:
            bounds.append(offset)
            if len(bounds) == len(want):
                break
        end = offset + len(line)
    while len(bounds) < len(want):
        bounds.append(end)
    return [[bounds[i], bounds[i + 1]] for i in range(len(sizes))]


def new_plan(url: str, nodes: int) -> list[list[int]]:
    ix = ranges.scan(url, None)
    return [span for _, _, span in ranges.cut(ix, plan_sizes(ix.lines, nodes))]


def write_input(store: Store, name: str, rows: int) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i} " * 8}]}) + "\n")
    store.put_file(f.name, name)
    size = os.path.getsize(f.name)
    os.unlink(f.name)
    return size


def timed(fn, url: str) -> tuple[float, int, list[list[int]]]:  # type: ignore[no-untyped-def]
    FETCHED[0] = 0
    t = time.perf_counter()
    out = fn(url, 8)
    return time.perf_counter() - t, FETCHED[0], out


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    old_rows = int(sys.argv[2]) if len(sys.argv) > 2 else rows
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
        deadline = time.monotonic() + 60
        while True:
            try:
                Store("s3://bench").fs.mkdir("bench")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        _count_fetches()
        for n in sorted({old_rows, rows}):
            for root in ("s3://bench", "memory://bench"):
                compare(root, n, old_rows)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def compare(root: str, n: int, old_rows: int) -> None:
    """One input of `n` lines under `root`: the one pass, and the two passes when n == old_rows."""
    store = Store(root)
    size = write_input(store, f"in-{n}.jsonl", n)
    url = f"{root}/in-{n}.jsonl"
    row = [f"{root.split(':')[0]}: {n:,} lines ({size / 1e6:.1f} MB):"]
    spans = {}
    for label, fn in (("one pass", new_plan), ("two passes", old_plan)):
        if fn is old_plan and n != old_rows and not root.startswith("memory"):   # in memory it is quick
            continue
        secs, got, spans[label] = timed(fn, url)
        row.append(f"{label} {secs:.2f} s, {got / 1e6:.1f} MB fetched")
    if len(spans) == 2:
        assert spans["one pass"] == spans["two passes"], "the two ways cut different ranges"
        row.append("same ranges")
    print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
