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

import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fleet.errors import FatalError, JobConflict
from fleet.generation.inputs import DUPLICATE_REASON, Reject, digest

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    _loads = json.loads

__all__ = [
    "RESULT_COLUMNS", "RESULT_SCHEMA", "IdSet", "ResultStore", "read_results", "iter_results",
    "shard_paths", "read_errors", "read_rejects", "read_quality_rejects", "write_manifest", "read_manifest",
    "MESSAGE_TYPE", "TOOL_CALL_TYPE", "PARAMS_TYPE", "message_to_arrow", "message_from_arrow", "params_to_arrow",
    "params_from_arrow", "tool_call_to_arrow", "QUALITY_REJECTS",
]

log = logging.getLogger("fleet.generation.store")

# Nested types, so pandas, Polars and `datasets` read conversations without json.loads.
# What stays a JSON string, and why: a tool call's `arguments` (the OpenAI wire format is a
# string, and arguments differ per tool), a tool's JSON-schema `parameters` (`params.tools`),
# `chat_template_kwargs`, and anything without a fixed shape (`extra` fields, content
# parts): one Parquet column has one type, and these differ from row to row.
TOOL_CALL_TYPE = pa.struct([
    pa.field("id", pa.string()), pa.field("type", pa.string()),
    pa.field("function", pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])),
])
MESSAGE_TYPE = pa.struct([
    pa.field("role", pa.string()),
    pa.field("content", pa.string()),            # null when the content is a list of parts
    pa.field("content_parts", pa.string()),      # JSON list of content parts (multimodal), else null
    pa.field("reasoning_content", pa.string()),  # regenerated earlier turns keep their reasoning
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    pa.field("tool_call_id", pa.string()),
    pa.field("name", pa.string()),
    pa.field("extra", pa.string()),              # JSON object of any other keys of the message
])
_PARAM_FIELDS = [
    ("max_tokens", pa.int64()), ("max_completion_tokens", pa.int64()), ("temperature", pa.float64()),
    ("top_p", pa.float64()), ("top_k", pa.int64()), ("min_p", pa.float64()),
    ("presence_penalty", pa.float64()), ("frequency_penalty", pa.float64()), ("repetition_penalty", pa.float64()),
    ("seed", pa.int64()), ("stop", pa.list_(pa.string())), ("reasoning_effort", pa.string()),
]
PARAMS_TYPE = pa.struct([pa.field(k, t) for k, t in _PARAM_FIELDS] + [
    pa.field("chat_template_kwargs", pa.string()),  # JSON object
    pa.field("tools", pa.string()),                 # JSON list of tool definitions
    pa.field("extra", pa.string()),                 # JSON object of every other parameter
])

RESULT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("messages", pa.list_(MESSAGE_TYPE)),  # the prompt of the last generated turn
    pa.field("completion", pa.string()),
    pa.field("reasoning_content", pa.string()),  # when the server separates reasoning
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),  # null when none
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("server", pa.string()),
    pa.field("attempts", pa.int32()),
    pa.field("latency_s", pa.float64()),
    pa.field("started_at", pa.float64()),  # epoch seconds
    pa.field("finished_at", pa.float64()),
    # Optional (callers may omit it): the request params as sent. A training set of
    # tool-calling rows needs `tools` (and chat_template_kwargs) to render the chat template.
    pa.field("params", PARAMS_TYPE),
    pa.field("flags", pa.list_(pa.string())),  # quality gates with action "flag" that fired, null when none
    pa.field("turns", pa.int32()),  # assistant turns generated for this row (all-turns mode: every one)
    pa.field("extra", pa.string()),  # the input row's other top-level fields, JSON object
])
RESULT_COLUMNS = RESULT_SCHEMA.names
_COLUMNS = frozenset(RESULT_COLUMNS)
_NESTED_COLUMNS = frozenset({"messages", "tool_calls", "params", "flags"})
_INT_COLUMNS = frozenset({"prompt_tokens", "completion_tokens", "attempts", "turns"})
_FLOAT_COLUMNS = frozenset({"latency_s", "started_at", "finished_at"})
QUALITY_REJECTS = "quality_rejects.jsonl"
_DICT_COLUMNS = ["finish_reason", "server", "params.tools", "params.chat_template_kwargs",
                 "params.reasoning_effort", "flags.list.element"]
_SHARD_RE = re.compile(r"^part-(\d{6,})\.parquet$")


# ---------------------------------------------------------------------------- id set


def _sorted_unique_u64(values: array) -> array:
    """Sort and deduplicate an array('Q') in C (pyarrow), never as a list of Python ints.

    The system allocator, not pyarrow's default pool: mimalloc keeps the freed scratch
    memory (~20 MB per million ids) for the life of the process.
    """
    if len(values) < 2:
        return array("Q", values)
    pool = pa.system_memory_pool()
    arr = pa.Array.from_buffers(pa.uint64(), len(values), [None, pa.py_buffer(values)])
    arr = pc.take(arr, pc.sort_indices(arr, memory_pool=pool), memory_pool=pool)
    same = pc.equal(arr.slice(1), arr.slice(0, len(arr) - 1), memory_pool=pool)
    if pc.any(same).as_py():  # only a store written behind ResultStore's back has repeats
        keep = pa.concat_arrays([pa.array([True]), pc.invert(same, memory_pool=pool)])
        arr = pc.filter(arr, keep, memory_pool=pool)
    out = array("Q")
    out.frombytes(memoryview(arr.buffers()[1])[8 * arr.offset: 8 * (arr.offset + len(arr))])
    return out


class IdSet:
    """A compact set of ids: `id in s`, `len(s)`, `add`, `discard`.

    Stores 64-bit digests (`inputs.digest`), not strings: a sorted array('Q') searched by
    bisection, plus a set of recent additions merged into the array when it grows past a
    quarter of it. Safe to read from one thread (the input reader's `skip_ids`) while
    another adds: readers look at the additions first and merges publish the new array
    before they clear the additions.
    """

    __slots__ = ("_base", "_extra", "_removed")

    def __init__(self, digests: array | Iterable[int] = ()) -> None:
        self._base = _sorted_unique_u64(digests if isinstance(digests, array) else array("Q", digests))
        self._extra: set[int] = set()
        self._removed: set[int] = set()  # digests in _base that were discarded

    def _in_base(self, d: int) -> bool:
        base = self._base
        i = bisect_left(base, d)
        return i < len(base) and base[i] == d

    def has_digest(self, d: int) -> bool:
        if d in self._extra:
            return True
        if d in self._removed:
            return False
        return self._in_base(d)

    def __contains__(self, id: object) -> bool:
        return isinstance(id, str) and self.has_digest(digest(id))

    def has_digests(self, digests: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """`has_digest` for many digests at once, vectorized (`inputs.plan_resume` over a million rows)."""
        import numpy as np

        base = self._base   # one snapshot: a merge publishes a new array, never resizes this one
        extra, removed = tuple(self._extra), tuple(self._removed)   # copied under the GIL
        hit = np.zeros(len(digests), dtype=bool)
        if len(base):
            b = np.frombuffer(base, dtype=np.uint64)
            i = np.minimum(np.searchsorted(b, digests), len(b) - 1)
            hit = b[i] == digests
        if removed:
            hit &= ~np.isin(digests, np.array(removed, dtype=np.uint64))
        if extra:
            hit |= np.isin(digests, np.array(extra, dtype=np.uint64))
        return hit

    def __len__(self) -> int:
        return len(self._base) - len(self._removed) + len(self._extra)

    def add(self, id: str) -> bool:
        """Add `id`; False when it was already there."""
        d = digest(id)
        if self.has_digest(d):
            return False
        if d in self._removed:
            self._removed.discard(d)
        else:
            self._extra.add(d)
            if len(self._extra) > max(1 << 16, len(self._base) >> 2):
                self._merge()
        return True

    def discard(self, id: str) -> None:
        d = digest(id)
        if d in self._extra:
            self._extra.discard(d)
        elif self._in_base(d):
            self._removed.add(d)

    def _merge(self) -> None:
        merged = array("Q", (x for x in self._base if x not in self._removed)) if self._removed else array("Q", self._base)
        merged.extend(self._extra)
        self._base = _sorted_unique_u64(merged)  # publish first: see the class docstring
        self._extra = set()
        self._removed = set()


# ---------------------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _repair_jsonl(path: Path) -> int:
    """Cut a torn last line (a kill mid-append); return the bytes removed."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = size, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            nl = f.read(step).rfind(b"\n")
            if nl >= 0:
                keep = pos + nl + 1
                break
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s: removed a torn last line (%d bytes) left by a killed writer", path, size - keep)
    return size - keep


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _loads(line)
            except ValueError:
                log.warning("%s:%d: unreadable line skipped", path, n)
                continue
            if isinstance(rec, dict):
                yield rec


def shard_paths(out_dir: str | Path) -> list[Path]:
    """Committed shards, in commit order (temp files are never listed)."""
    d = Path(out_dir) / "shards"
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _SHARD_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def read_errors(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of errors.jsonl: id, error, attempts, line, server, status, at."""
    return _read_jsonl(Path(out_dir) / "errors.jsonl")


def read_quality_rejects(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of quality_rejects.jsonl: id, line, reasons, attempts, at, row (the result row)."""
    return _read_jsonl(Path(out_dir) / QUALITY_REJECTS)


def read_rejects(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of rejects.jsonl: line, id, reason, duplicate, raw, at."""
    return _read_jsonl(Path(out_dir) / "rejects.jsonl")


def write_manifest(out_dir: str | Path, data: dict[str, Any]) -> None:
    """Write DIR/manifest.json atomically (temp file, fsync, rename, directory fsync)."""
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n"
    _atomic_write(Path(out_dir) / "manifest.json", text.encode())


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / "manifest.json").read_text())
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------- reading results


def _upgrade(arr: pa.Array, name: str) -> pa.Array:
    """A column of a shard written before nested types (JSON strings) as today's type."""
    conv = _SPECIAL[name]
    return pa.array([conv(v) for v in arr.to_pylist()], type=RESULT_SCHEMA.field(name).type)


def _shard_batches(path: Path, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    pf = pq.ParquetFile(path)
    file_schema = pf.schema_arrow
    have = set(file_schema.names)
    present = [c for c in columns if c in have]
    schema = pa.schema([RESULT_SCHEMA.field(c) for c in columns])
    stale = {c for c in present if c in _NESTED_COLUMNS and file_schema.field(c).type != RESULT_SCHEMA.field(c).type}
    for batch in pf.iter_batches(batch_size=batch_rows, columns=present):
        if len(present) == len(columns) and not stale:
            yield batch
            continue
        # A shard from before a column existed: the column reads as nulls; one from
        # before nested types: its JSON strings are decoded.
        arrays = [(_upgrade(batch.column(c), c) if c in stale else batch.column(c)) if c in have
                  else pa.nulls(batch.num_rows, RESULT_SCHEMA.field(c).type) for c in columns]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def iter_results(out_dir: str | Path, columns: list[str] | None = None,
                 batch_rows: int = 8192) -> Iterator[pa.RecordBatch]:
    """Stream committed results as record batches (one shard in memory at most per batch)."""
    cols = list(columns) if columns is not None else list(RESULT_COLUMNS)
    unknown = [c for c in cols if c not in _COLUMNS]
    if unknown:
        raise ValueError(f"unknown result column(s) {unknown}; columns: {', '.join(RESULT_COLUMNS)}")
    for path in shard_paths(out_dir):
        yield from _shard_batches(path, cols, batch_rows)


def read_results(out_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Every committed result as one table (small jobs and tests; stream with iter_results)."""
    cols = list(columns) if columns is not None else list(RESULT_COLUMNS)
    schema = pa.schema([RESULT_SCHEMA.field(c) for c in cols])
    return pa.Table.from_batches(list(iter_results(out_dir, cols)), schema=schema)


# ---------------------------------------------------------------------------- the store


def _json_str(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return _dumps(v).decode()


def tool_call_to_arrow(tc: Any) -> dict[str, Any]:
    """One OpenAI tool call as TOOL_CALL_TYPE (arguments always a JSON string)."""
    if not isinstance(tc, dict):
        raise TypeError(f"a tool call must be an object, got {type(tc).__name__}")
    fn = tc.get("function") or {}
    return {"id": tc.get("id"), "type": tc.get("type") or "function",
            "function": {"name": fn.get("name"), "arguments": _json_str(fn.get("arguments"))}}


def _tool_calls_to_arrow(tcs: Any) -> list[dict[str, Any]] | None:
    if not tcs:
        return None
    return [tool_call_to_arrow(tc) for tc in tcs]


_MESSAGE_KEYS = frozenset(MESSAGE_TYPE.names) - {"content_parts", "extra"}


def message_to_arrow(m: dict[str, Any]) -> dict[str, Any]:
    """One chat message as MESSAGE_TYPE; `message_from_arrow` undoes it."""
    content = m.get("content")
    other = {k: v for k, v in m.items() if k not in _MESSAGE_KEYS and v is not None}
    return {
        "role": m.get("role"),
        "content": content if isinstance(content, str) or content is None else None,
        "content_parts": None if isinstance(content, str) or content is None else _json_str(content),
        "reasoning_content": m.get("reasoning_content"),
        "tool_calls": _tool_calls_to_arrow(m.get("tool_calls")),
        "tool_call_id": m.get("tool_call_id"),
        "name": m.get("name"),
        "extra": _json_str(other) if other else None,
    }


def message_from_arrow(d: dict[str, Any]) -> dict[str, Any]:
    """A stored message back as an OpenAI chat message (absent fields left out)."""
    m: dict[str, Any] = {"role": d.get("role")}
    if d.get("content_parts") is not None:
        m["content"] = _loads(d["content_parts"])
    elif d.get("content") is not None:
        m["content"] = d["content"]
    for k in ("reasoning_content", "tool_call_id", "name"):
        if d.get(k) is not None:
            m[k] = d[k]
    if d.get("tool_calls"):
        m["tool_calls"] = d["tool_calls"]
    if d.get("extra"):
        m.update(_loads(d["extra"]))
    return m


_PARAM_KEYS = frozenset(k for k, _ in _PARAM_FIELDS)
_PARAM_INTS = frozenset(k for k, t in _PARAM_FIELDS if t == pa.int64())
_PARAM_FLOATS = frozenset(k for k, t in _PARAM_FIELDS if t == pa.float64())


def _typed_param(k: str, v: Any) -> bool:
    """Whether `v` fits the typed column of param `k` (else it goes to `extra`, as given)."""
    if k in _PARAM_INTS:   # outside int64 (a seed of 2**70): kept, as given, in `extra`
        return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)
    if k in _PARAM_FLOATS:
        return isinstance(v, int | float) and not isinstance(v, bool)
    if k == "stop":
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    return isinstance(v, str)


def params_to_arrow(p: dict[str, Any]) -> dict[str, Any]:
    """Request params as PARAMS_TYPE; `params_from_arrow` undoes it."""
    out: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for k, v in p.items():
        if v is None:
            continue
        if k in _PARAM_KEYS and _typed_param(k, v):
            out[k] = [v] if k == "stop" and isinstance(v, str) else v
        elif k in ("chat_template_kwargs", "tools"):
            out[k] = _json_str(v)
        else:
            other[k] = v
    out["extra"] = _json_str(other) if other else None
    return out


def params_from_arrow(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """Stored params back as a request-params dict (absent fields left out)."""
    if d is None:
        return None
    p: dict[str, Any] = {}
    for k, v in d.items():
        if v is None or k == "extra":
            continue
        p[k] = _loads(v) if k in ("chat_template_kwargs", "tools") else v
    if d.get("extra"):
        p.update(_loads(d["extra"]))
    return p


def _decode(v: Any) -> Any:
    """A value given as JSON text (older callers, older shards) as the object it encodes."""
    return _loads(v) if isinstance(v, str | bytes) else v


def _conv_messages(v: Any) -> list[dict[str, Any]] | None:
    v = _decode(v)
    return None if v is None else [message_to_arrow(m) for m in v]


def _conv_tool_calls(v: Any) -> list[dict[str, Any]] | None:
    return _tool_calls_to_arrow(_decode(v))


def _conv_params(v: Any) -> dict[str, Any] | None:
    v = _decode(v)
    return params_to_arrow(v) if v else None


def _conv_flags(v: Any) -> list[str] | None:
    return list(v) if v else None


def _conv_extra(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return _dumps(v).decode() if v else None


def _conv_str(name: str):
    def conv(v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        raise TypeError(f"result field {name!r} must be a string or None, got {type(v).__name__}")
    return conv


def _conv_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _conv_float(v: Any) -> float | None:
    return None if v is None else float(v)


_SPECIAL = {"messages": _conv_messages, "tool_calls": _conv_tool_calls, "params": _conv_params,
            "flags": _conv_flags, "extra": _conv_extra}
_CONVERTERS = [
    _SPECIAL[c] if c in _SPECIAL else _conv_int if c in _INT_COLUMNS
    else _conv_float if c in _FLOAT_COLUMNS else _conv_str(c)
    for c in RESULT_COLUMNS
]


def _lock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if "since" in info else "?"
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {since}"
    except (OSError, ValueError, TypeError):
        return "pid unknown"


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
        self.shards_dir = self.dir / "shards"
        self.errors_path = self.dir / "errors.jsonl"
        self.rejects_path = self.dir / "rejects.jsonl"
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
        self._lock_fd: int | None = self._acquire_lock()
        try:
            self._open(input_fingerprint, job_params)
        except BaseException:
            self._release_lock()
            raise

    # -- opening

    def _acquire_lock(self) -> int:
        path = self.dir / ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise FatalError(f"cannot open {path}: {exc.strerror}",
                             remedy="pass an --output directory you can write to") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise FatalError(
                f"output directory {self.dir} is in use by another generation runner ({holder})",
                remedy="wait for that runner to finish, or stop it first; two runners writing one "
                       "directory would duplicate rows. To run a second job, give it its own --output.",
            ) from None
        except OSError as exc:  # ENOLCK: a filesystem without locks (some network filesystems)
            os.close(fd)
            raise FatalError(f"cannot lock output directory {self.dir}: {exc.strerror}",
                             remedy="put --output on a local filesystem: results are fsync'd shard by "
                                    "shard and the lock is what keeps a second runner out") from exc
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _open(self, fingerprint: str | None, params: dict[str, Any] | None = None) -> None:
        # Under the lock, any temp file is a dead writer's: a shard never renamed, a
        # manifest half written. Deleting them makes "whole shard or nothing" visible.
        for d in (self.dir, self.shards_dir):
            for tmp in d.glob("*.tmp"):
                log.warning("removing %s left by a killed writer", tmp)
                tmp.unlink(missing_ok=True)
        self._check_job(fingerprint, params)
        _repair_jsonl(self.errors_path)
        _repair_jsonl(self.rejects_path)
        _repair_jsonl(self.quality_path)

        shards = shard_paths(self.dir)
        self._next_seq = (int(_SHARD_RE.match(shards[-1].name).group(1)) + 1) if shards else 1
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
        self._done: IdSet | None = None
        self._dropped = 0
        self._errors_f = open(self.errors_path, "ab")
        self._rejects_f = open(self.rejects_path, "ab")
        self._quality_f = open(self.quality_path, "ab")
        self._closed = False

    def _check_job(self, fingerprint: str | None, params: dict[str, Any] | None = None) -> None:
        """One directory, one job: the same input (SHA-256) and the same generation parameters
        (`validate.job_params`) as recorded in DIR/job.json by the first run; recorded if absent."""
        path = self.dir / "job.json"
        try:
            job = json.loads(path.read_text())
        except FileNotFoundError:
            job = {}
        except ValueError as exc:
            raise FatalError(f"{path} is not valid JSON ({exc})",
                             remedy=f"restore it, or delete it to accept the current input into {self.dir}") from exc
        recorded = job.get("input_fingerprint")
        if fingerprint is not None and recorded is not None and recorded != fingerprint and job.get("input_broken"):
            # The recorded input broke mid-file (truncated/corrupt): its repaired copy continues the job;
            # the rows done are skipped by id.
            log.warning("%s: the recorded input was broken (%s); continuing with the replacement input %s…",
                        self.dir, job["input_broken"], fingerprint[:12])
            job.pop("input_broken")
            job["replaced_inputs"] = [*job.get("replaced_inputs", []), recorded]
            job["input_fingerprint"] = recorded = fingerprint
            _atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())
        if fingerprint is not None and recorded is not None and recorded != fingerprint:
            raise JobConflict(
                f"output directory {self.dir} holds results of a different input "
                f"(recorded sha256 {recorded[:12]}…, this input {fingerprint[:12]}…)",
                remedy="pass the input this directory was started with, or give the new input its own "
                       "--output directory (mixing two inputs in one directory would corrupt resume)",
            )
        recorded_params = job.get("params")
        if params is not None and recorded_params is not None and recorded_params != params:
            from fleet.generation.validate import params_diff

            raise JobConflict(
                f"output directory {self.dir} was generated with other parameters "
                f"({'; '.join(params_diff(recorded_params, params))})",
                remedy="give this job its own --output, or set the parameters back (one directory holds one "
                       "dataset: rows made with two settings would be mixed silently)",
            )
        changed = False
        if fingerprint is not None and recorded is None:
            job.update(input_fingerprint=fingerprint)
            changed = True
        if params is not None and recorded_params is None:
            job.update(params=params)
            changed = True
        if changed:
            job.setdefault("created_at", time.time())
            _atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())

    def note_input_broken(self, cause: str) -> None:
        """Record in DIR/job.json that this job's input broke mid-file: a repaired copy may continue it."""
        path = self.dir / "job.json"
        with self._lock:
            try:
                job = json.loads(path.read_text())
            except (OSError, ValueError):
                return
            job["input_broken"] = cause
            _atomic_write(path, (json.dumps(job, indent=2) + "\n").encode())

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
        if not _COLUMNS.issuperset(row):
            unknown = sorted(set(row) - _COLUMNS)
            raise ValueError(f"unknown result field(s) {unknown}; allowed: {', '.join(RESULT_COLUMNS)}")
        values = tuple(conv(row.get(c)) for c, conv in zip(RESULT_COLUMNS, _CONVERTERS))
        with self._lock:
            self._check_open()
            if not self._done_set().add(rid):
                self._dropped += 1
                log.warning("result for %r dropped: the id is already done", rid)
                return False
            self._buffer.append(values)
            if len(self._buffer) < self.shard_rows:
                return True
            rows, self._buffer = self._buffer, []
        self._commit(rows)
        return True

    def add_error(self, id: str, *, error: str, attempts: int, line: int | None = None,
                  server: str | None = None, status: int | None = None) -> bool:
        """Record a row that failed for good (appended, flushed and fsync'd at once).

        Returns False, and records nothing, when the id is already done.
        """
        rec = {"id": id, "error": error, "attempts": attempts, "line": line, "server": server,
               "status": status, "at": time.time()}
        data = _dumps(rec) + b"\n"
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
                                 remedy="free space in the output directory, then resume")
                err.path = str(self.errors_path)   # type: ignore[attr-defined]
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
        data = _dumps(rec) + b"\n"
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
        data = _dumps(rec) + b"\n"
        with self._lock:
            self._check_open()
            if reject.line in self._reject_lines:
                return False
            try:
                self._rejects_f.write(data)
                self._rejects_f.flush()
            except OSError as exc:
                err = FatalError(f"cannot append to {self.rejects_path}: {exc.strerror}",
                                 remedy="free space in the output directory, then resume")
                err.path = str(self.rejects_path)   # type: ignore[attr-defined]
                raise err from exc
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
                cols = list(zip(*rows))
                table = pa.Table.from_arrays(
                    [pa.array(col, type=f.type) for col, f in zip(cols, RESULT_SCHEMA)], schema=RESULT_SCHEMA)
                pq.write_table(table, tmp, compression="zstd", use_dictionary=_DICT_COLUMNS)
                _fsync_file(tmp)
                os.rename(tmp, final)
                renamed = True
                self._next_seq = seq + 1
                _fsync_dir(self.shards_dir)
            except BaseException as exc:
                if not renamed:
                    tmp.unlink(missing_ok=True)
                    with self._lock:  # not written: keep the rows for the next commit
                        self._buffer[:0] = rows
                if isinstance(exc, OSError):
                    err = FatalError(f"cannot commit result shard {final}: {exc.strerror or exc}",
                                     remedy="free space in the output directory, then resume: "
                                            "rows not committed are generated again")
                    err.path = str(final)   # type: ignore[attr-defined]  # the runner names it (disk full at which file)
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
                rows, self._buffer = self._buffer, []
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
            _fsync_dir(self.dir)
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
