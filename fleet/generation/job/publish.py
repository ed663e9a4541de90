"""A runner whose job lives on object storage: its chunk read from the store, its commits put there.

The runner still writes its output directory on the node's disk first (the store's lock, the
atomic shard rename, resume: the single-node machinery unchanged); what is new is the copy to
the store, by the runner itself, so no controller is in the data path:

- `stage_input`: the job's input URL downloaded once next to the output (a temporary name, then
  a rename; a re-run of the same job finds it and reads it again): only its chunk's byte range of
  a JSONL input, only its rows of a Parquet one (the row groups that hold them).
- `seed`: a fresh attempt of a chunk first copies the shards that earlier attempts (on other
  nodes, maybe lost ones) put in the store, so its resume skips their ids. Their names are kept in
  `.seeded.json`; they are published with the attempt's own shards, so an attempt's part holds
  every row of its chunk: the job counts one attempt per chunk and reads no other prefix, and what
  a lost node puts in its own prefix later adds nothing (multinode/fence.py).
- `Publisher.sync_shards`: after every commit, each committed shard not yet in the store is put
  there whole (an object is visible only once complete: a shard in the store is a complete shard).
- `Publisher.finish`: at the end of a finished run, errors, rejects and quality rejects, then
  `manifest.json` last: a manifest in the store means the attempt's whole output is there.
- The fence (multinode/fence.py): a chunk attempt's publisher (its URL under `<output>/_parts/`)
  reads `<output>/_control/ended.json` after it has put something (at most every FENCE_EVERY_S,
  and at the finish); once the job ended without its part, it removes that part and raises
  `Fenced`: the runner stops. Before, a node back after the job's end put its late parts there
  for good (removed only by the next run of the command).
"""

from __future__ import annotations

import json
import logging
import posixpath
from pathlib import Path
from typing import Any

from fleet.generation.data.manifest import MANIFEST_FILE
from fleet.generation.data.objstore import Store, is_url
from fleet.generation.data.results import ERRORS_FILE, QUALITY_REJECTS, REJECTS_FILE, SHARD_RE, SHARDS_DIR, shard_paths

__all__ = ["Publisher", "SEEDED_FILE", "seed", "stage_input", "store_shards"]

log = logging.getLogger("fleet.generation.job.publish")

SEEDED_FILE = ".seeded.json"
FENCE_EVERY_S = 10.0   # a chunk attempt's look at the job's end marker, after a put (and at its finish)
PARTS_DIR = "_parts"   # under a multi-node job's --output: each chunk attempt's part (multinode/fence.py)
ENDED_FILE = "_control/ended.json"   # under it too: the counted parts, once the job ended (`remove_leftovers`)


def stage_input(url: str, out: Path, span: list[int] | None = None, rows: list[int] | None = None,
                pin: dict[str, Any] | None = None) -> str:
    """The local copy of input `url` (downloaded once, beside the output directory; `span`: only those
    bytes of it, `rows`: only those rows of a Parquet input, see ranges.py); a path is itself. `pin`: the
    version the job was planned on (fleet.generation.data.pin): a range is read from it, and InputChanged
    is raised, with nothing staged, when it is not there any more."""
    if not is_url(url):
        return url[len("file://"):] if url.startswith("file://") else url
    from fleet.generation.data.storeerrors import translated

    with translated(url, "reading"):   # the store's refusal in one line (InputChanged passes as it is)
        return _stage(url, out, span, rows, pin)


def _stage(url: str, out: Path, span: list[int] | None, rows: list[int] | None, pin: dict[str, Any] | None) -> str:
    name = posixpath.basename(url.rstrip("/"))
    part = span or rows
    local = out.parent / f".{out.name}.input" / (f"{part[0]}-{part[1]}-{name}" if part else name)
    if part is not None and not local.exists():
        from fleet.generation.data.ranges import read_rows, read_span

        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".tmp")
        if span is not None:
            tmp.write_bytes(read_span(url, span, pin))
        else:
            import pyarrow.parquet as pq

            pq.write_table(read_rows(url, part[0], part[1] - part[0], pin), tmp)
        tmp.replace(local)
    if not local.exists():
        parent, name = url.rstrip("/").rsplit("/", 1)
        Store(parent).get_file(name, str(local))
    return str(local)


def store_shards(store: Store) -> list[str]:
    """The shard names committed under `store`'s shards/, in commit order."""
    found = [(int(m.group(1)), n) for n in store.names(SHARDS_DIR) if (m := SHARD_RE.match(n))]
    return [n for _, n in sorted(found)]


def seed(out: Path, urls: list[str]) -> int:
    """Copy the shards of earlier attempts (`urls`: their store directories) into a fresh output's
    shards/ (none there yet); return how many. Their names go to `.seeded.json` (never published)."""
    shards = out / SHARDS_DIR
    if not urls or shard_paths(out):
        return 0
    shards.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for url in urls:
        src = Store(url)
        for name in store_shards(src):
            target = f"part-{len(names) + 1:06d}.parquet"
            src.get_file(f"{SHARDS_DIR}/{name}", str(shards / target))
            names.append(target)
    (out / SEEDED_FILE).write_text(json.dumps(names))
    return len(names)


class Publisher:
    """The committed part of one runner's output directory `out`, mirrored to the store at `url`."""

    def __init__(self, out: Path, url: str) -> None:
        self.out = out
        self.store = Store(url)
        self._there: set[str] | None = None
        # a chunk attempt's part, `<output>/_parts/<node>/<attempt>`: the job's root and the part's name there
        root, sep, rest = url.rstrip("/").partition(f"/{PARTS_DIR}/")
        self._job: tuple[str, str] | None = (root, f"{PARTS_DIR}/{rest}") if sep and rest else None
        self._fence_at = 0.0
        self._fenced: Exception | None = None

    def sync_shards(self) -> int:
        """Put every committed shard that is not in the store yet; return how many were put (StoreError
        with its cause and remedy when the store refuses)."""
        from fleet.generation.data.storeerrors import translated

        if self._fenced is not None:   # its part removed: nothing more goes there
            raise self._fenced
        with translated(self.store.root, "writing"):
            n = self._sync_shards()
        if n:
            self.check_fence()
        return n

    def check_fence(self, *, now: bool = False) -> None:
        """Fenced (this attempt's part removed from the store) once its job ended without it; a look at
        most every FENCE_EVERY_S unless `now`."""
        import time

        from fleet.errors import Fenced

        if self._job is None or (not now and time.monotonic() - self._fence_at < FENCE_EVERY_S):
            return
        self._fence_at = time.monotonic()
        root, name = self._job
        raw = Store(root).read_bytes(ENDED_FILE)
        if raw is None:
            return
        try:
            counted = set(json.loads(raw).get("counted") or [])
        except (ValueError, AttributeError):
            return   # not one we wrote: no decision from it
        if name in counted:
            return
        removed = self.store.remove_tree()
        self._fenced = Fenced(f"the job ended without this attempt ({name}): its {removed} object(s) in the store "
                              "were removed; this runner stops",
                              remedy="nothing: the job's output is complete without it")
        raise self._fenced

    def _sync_shards(self) -> int:
        if self._there is None:   # listed once per runner: after that, this runner is the only writer here
            self._there = set(self.store.names(SHARDS_DIR))
        n = 0
        for path in shard_paths(self.out):
            if path.name in self._there:
                continue
            self.store.put_file(str(path), f"{SHARDS_DIR}/{path.name}")
            self._there.add(path.name)
            n += 1
        return n

    def finish(self) -> None:
        """Shards, then the record files, then the manifest (last: it says the rest is there)."""
        from fleet.generation.data.storeerrors import translated

        self.sync_shards()
        if self._fenced is not None:
            raise self._fenced
        with translated(self.store.root, "writing"):
            for name in (ERRORS_FILE, REJECTS_FILE, QUALITY_REJECTS, MANIFEST_FILE):
                path = self.out / name
                if path.exists():
                    self.store.put_file(str(path), name)
        self.check_fence(now=True)
