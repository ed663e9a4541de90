"""Planned resume of a JSONL input: decide from the ids alone which lines are still to run
(`plan_resume`), then read and validate only those (`iter_planned`). The rules are those of
`fleet.generation.data.inputs.iter_input`; see its module docstring ("Planned resume").
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from fleet.errors import InputError
from fleet.generation.data.jsonl import loads
from fleet.generation.data.rows import (
    DIGEST_MASK, DUPLICATE_REASON, Bad, InputStats, Reject, Request, content_id, digest, raw_text, type_name,
)
from fleet.generation.data.rowshapes import apply_defaults, param_defaults, row_id, shape
from fleet.generation.data.sources import bad_json_reason, input_lines

if TYPE_CHECKING:
    from fleet.config import GenerationConfig

__all__ = ["DigestSet", "ResumePlan", "digest_set", "iter_planned", "plan_resume"]


class DigestSet(Protocol):
    """A set of done ids that answers for many digests at once (`idset.IdSet`)."""

    def __len__(self) -> int: ...

    def __contains__(self, id: object) -> bool: ...

    def has_digests(self, digests: Any, memory_pool: Any = None) -> Any:
        """A pyarrow UInt64Array of digests -> a BooleanArray: which are in the set."""


def digest_set(skip_ids: Callable[[str], bool] | None) -> DigestSet | None:
    """The done set behind `skip_ids` when it is exactly a DigestSet's `__contains__`, else None."""
    owner = getattr(skip_ids, "__self__", None)
    if owner is None or not hasattr(owner, "has_digests"):
        return None
    if getattr(skip_ids, "__func__", None) is not getattr(type(owner), "__contains__", None):
        return None
    return cast(DigestSet, owner)


@dataclass(slots=True)
class ResumePlan:
    """What a resume still has to read, decided from the ids alone (`plan_resume`)."""

    rows: int                       # non-blank rows planned (after generation.limit)
    blank: int
    skipped: int                    # rows whose id is done: never read again
    duplicates: int                 # later rows with an id seen before
    visit: array[int]               # lines to read again, ascending: rows to run and rows to reject
    rejects: dict[int, str]         # line -> reason, decided without validation (bad JSON, bad id, ...)
    first_at: dict[int, int]        # line of a duplicate -> the line its id was first seen at
    error: InputError | None = None  # the input breaks after the planned lines: raised after them

    @property
    def remaining(self) -> int:
        """Lines still to read: requests to run plus rejects to record."""
        return len(self.visit)



def plan_resume(path: str | Path, defaults: GenerationConfig | None, done: DigestSet) -> ResumePlan:
    """Plan a resume of a JSONL input: which lines are still to run, from each row's id only.

    One pass that parses each line but reads only its id (`custom_id`/`id`; a row without one
    gets its content id, which needs the row validated): the ids' 64-bit digests and lines go
    into two flat arrays (12 bytes per row), then duplicates (first line wins) and the done ids
    are found in bulk, in C (pyarrow compute: hash lookups; a stable sort by digest only when an
    id repeats). Every rule of `iter_input` holds: a duplicate of a
    done id is still a reject, a done row is never validated, a bad line is a reject on every
    pass. A corrupt or truncated input plans the rows before the break and keeps the error.
    """
    import pyarrow as pa

    scan = _scan_ids(Path(path), defaults)
    pool = pa.system_memory_pool()   # freed at once (the default pool keeps its scratch for the process)
    d = pa.Array.from_buffers(pa.uint64(), len(scan.digests), [None, pa.py_buffer(scan.digests)])
    w = pa.Array.from_buffers(pa.uint32(), len(scan.lines), [None, pa.py_buffer(scan.lines)])
    first_at = _duplicates(d, w, pool)
    skipped, todo = _not_done(d, w, done, first_at, pool)
    return ResumePlan(rows=scan.rows, blank=scan.blank, skipped=skipped, duplicates=len(first_at),
                      visit=_visit(todo, scan.rejects), rejects=scan.rejects, first_at=first_at, error=scan.error)


@dataclass(slots=True)
class _IdScan:
    """The first step of a plan: every row's id digest and line, the lines rejected on the way."""

    digests: array[int]             # 64-bit digests of the ids, in input order
    lines: array[int]               # the line of each
    rejects: dict[int, str]         # line -> reason (bad JSON, bad id, a row without id that fails validation)
    rows: int                       # non-blank rows read (after generation.limit)
    blank: int
    error: InputError | None        # the input breaks here: the rows before it are planned


def _scan_ids(path: Path, defaults: GenerationConfig | None) -> _IdScan:
    """One pass over the lines reading only each row's id; a row with a string id is the hot
    path (parse, look up, append: nothing else), any other row is validated as `iter_input` does."""
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    rules = defaults.input_rules if defaults is not None else "openai"
    limit = defaults.limit if defaults is not None else None
    digests, where = array("Q"), array("I")
    rejects: dict[int, str] = {}
    parse, add_digest, add_line = loads, digests.append, where.append   # locals: the hot loop
    n = blank = 0
    error: InputError | None = None
    try:
        for n, line in enumerate(input_lines(path), 1):
            try:
                obj = parse(line)
            except ValueError:
                obj = None
            if type(obj) is dict:   # the hot path: a row with a string id
                rid = obj.get("custom_id")
                if rid is None:
                    rid = obj.get("id")
                if type(rid) is str and rid:
                    if limit is not None and n - blank > limit:
                        n -= 1
                        break
                    add_digest(hash(rid) & DIGEST_MASK)   # = digest(rid), inlined
                    add_line(n)
                    continue
            if n == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            try:
                obj = parse(line)
            except ValueError as exc:
                if not line.strip():
                    blank += 1
                    continue
                obj = Bad(bad_json_reason(exc))
            if limit is not None and n - blank > limit:
                n -= 1
                break
            try:
                rid = _slow_row_id(obj, all_turns, rules)
            except Bad as bad:
                rejects[n] = str(bad.args[0])
                continue
            except RecursionError:
                rejects[n] = "row nested too deeply"
                continue
            add_digest(digest(rid))
            add_line(n)
    except InputError as exc:
        error = exc
    return _IdScan(digests=digests, lines=where, rejects=rejects, rows=n - blank, blank=blank, error=error)


def _slow_row_id(obj: Any, all_turns: bool, rules: str) -> str:
    """The id of a row off the hot path (an integer id; no id: its content id, which needs the
    row validated). Raises Bad for a row to reject."""
    if isinstance(obj, Bad):
        raise obj
    if not isinstance(obj, dict):
        raise Bad(f"row is not a JSON object (got {type_name(obj)})")
    rid = row_id(obj, ("custom_id", "id"))
    if rid is None:
        rid = content_id(*shape(obj, all_turns, rules)[:2])
    return rid


def _duplicates(d: Any, w: Any, pool: Any) -> dict[int, int]:
    """Line of each duplicate -> the line its id was first seen at: neighbours after a sort by digest
    (a sort, not count_distinct: its hash table peaks at ~120 MB per million ids)."""
    import pyarrow.compute as pc

    first_at: dict[int, int] = {}
    if len(d) <= 1:
        return first_at
    order = pc.sort_indices(d, memory_pool=pool)   # a stable sort: within one id, lines stay ascending
    sd = pc.take(d, order, memory_pool=pool)
    same = pc.equal(sd.slice(1), sd.slice(0, len(sd) - 1), memory_pool=pool)
    if pc.any(same).as_py():
        sw = pc.take(w, order, memory_pool=pool)
        for pos in pc.indices_nonzero(same).to_pylist():   # few: walked in Python
            first = pos
            while first > 0 and same[first - 1].as_py():
                first -= 1
            first_at[sw[pos + 1].as_py()] = sw[first].as_py()
    return first_at


def _not_done(d: Any, w: Any, done: DigestSet, first_at: dict[int, int], pool: Any) -> tuple[int, Any]:
    """(rows skipped as done, the lines of the others in input order): a duplicate of a done id
    is still a reject, so it is never skipped."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (len(done) and len(d)):
        return 0, w
    skip = done.has_digests(d, pool)
    if first_at:
        skip = pc.and_(skip, pc.invert(pc.is_in(w, value_set=pa.array(list(first_at), pa.uint32()), memory_pool=pool),
                                       memory_pool=pool), memory_pool=pool)
    skipped = int(pc.sum(skip).as_py() or 0)
    return skipped, pc.filter(w, pc.invert(skip, memory_pool=pool), memory_pool=pool)   # still in input order


def _visit(todo: Any, rejects: dict[int, str]) -> array[int]:
    """The lines the second pass reads, ascending: the rows to run and the rows to reject."""
    visit = array("I")
    if len(todo):
        visit.frombytes(memoryview(todo.buffers()[1])[4 * todo.offset: 4 * (todo.offset + len(todo))])
    if rejects:
        visit = array("I", heapq.merge(visit, sorted(rejects)))
    return visit


def iter_planned(path: Path, defaults: GenerationConfig | None, plan: ResumePlan,
                  st: InputStats) -> Iterator[Request | Reject]:
    """The second pass of a planned resume: read only the planned lines, in order."""
    dflt = param_defaults(defaults)
    all_turns = defaults is not None and defaults.regenerate == "all-turns"
    rules = defaults.input_rules if defaults is not None else "openai"
    st.rows += plan.rows
    st.blank += plan.blank
    st.skipped += plan.skipped
    st.duplicates += plan.duplicates
    todo = iter(plan.visit.tolist())
    want = next(todo, 0)
    if want:
        for n, line in enumerate(input_lines(path), 1):
            if n != want:
                continue
            want = next(todo, 0)
            if n == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            reason = plan.rejects.get(n)
            if reason is not None:
                st.rejects += 1
                yield Reject(line=n, id=None, reason=reason, raw=raw_text(line))
            else:
                item = _planned_row(n, line, plan.first_at.get(n), dflt, all_turns, rules)
                if isinstance(item, Reject):
                    st.rejects += 1
                else:
                    st.requests += 1
                yield item
            if not want:
                break
    if plan.error is not None:
        raise plan.error


def _planned_row(n: int, line: bytes, first: int | None, dflt: dict[str, Any], all_turns: bool,
                 rules: str) -> Request | Reject:
    """One planned line: a request, a reject from validation, or a duplicate (`first`: its first line)."""
    rid: str | None = None
    try:
        obj = loads(line)
        rid = row_id(obj, ("custom_id", "id"))
        if rid is not None and first is not None:
            raise Bad(f"{DUPLICATE_REASON} (first at line {first})")
        msgs, own, extra = shape(obj, all_turns, rules)
        if rid is None:
            rid = content_id(msgs, own)
            if first is not None:
                raise Bad(f"{DUPLICATE_REASON} (first at line {first})")
    except Bad as bad:
        return Reject(line=n, id=rid, reason=str(bad.args[0]), raw=raw_text(line))
    except RecursionError:
        return Reject(line=n, id=rid, reason="row nested too deeply", raw=raw_text(line))
    return Request(id=rid, line=n, messages=msgs, params=apply_defaults(dflt, own), extra=extra)

