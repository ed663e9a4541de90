"""`IdSet`: the ids done in an output directory, ~8-10 bytes per id.

8-byte digests (`rows.digest`) in a sorted `array('Q')` plus a small set of recent
additions; `ResultStore.done_ids()` loads it from the shards' id column alone.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from fleet.generation.data.rows import digest

__all__ = ["IdSet"]


def _sorted_unique_u64(values: array[int]) -> array[int]:
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

    Stores 64-bit digests (`rows.digest`), not strings: a sorted array('Q') searched by
    bisection, plus a set of recent additions merged into the array when it grows past a
    quarter of it. Safe to read from one thread (the input reader's `skip_ids`) while
    another adds: readers look at the additions first and merges publish the new array
    before they clear the additions.
    """

    __slots__ = ("_base", "_extra", "_removed")

    def __init__(self, digests: array[int] | Iterable[int] = ()) -> None:
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

    def has_digests(self, digests: Any, memory_pool: Any = None) -> Any:
        """`has_digest` for many digests at once, in C: a pyarrow UInt64Array -> a BooleanArray
        (`resume.plan_resume` over a million rows)."""
        pool = memory_pool
        base = self._base   # one snapshot: a merge publishes a new array, never resizes this one
        extra, removed = tuple(self._extra), tuple(self._removed)   # copied under the GIL
        hit = pc.is_in(digests, value_set=pa.Array.from_buffers(pa.uint64(), len(base), [None, pa.py_buffer(base)]),
                       memory_pool=pool)
        if removed:
            hit = pc.and_(hit, pc.invert(pc.is_in(digests, value_set=pa.array(removed, pa.uint64()), memory_pool=pool),
                                         memory_pool=pool), memory_pool=pool)
        if extra:
            hit = pc.or_(hit, pc.is_in(digests, value_set=pa.array(extra, pa.uint64()), memory_pool=pool),
                         memory_pool=pool)
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
