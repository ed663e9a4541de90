"""Determinism: every decision and every word is a hash of ``--seed``, the request and a salt.

The same seed and the same request give the same answer and the same fault decisions, run
after run, with no state shared between requests.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_ints(*parts: int) -> int:
    h = 0
    for part in parts:
        h = _mix64(h ^ (part & _M64))
    return h


def unit(*parts: int) -> float:
    return hash_ints(*parts) / 2.0**64


def digest(obj: Any) -> int:
    """A stable 64-bit key of a JSON-able value (the messages or the prompt)."""
    if isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
    else:
        data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


SALT_LEN, SALT_ERR, SALT_TEXT, SALT_ID, SALT_SPEC = 11, 13, 17, 19, 23
SALT_EMPTY, SALT_LEAK, SALT_LOOP = 29, 31, 37

_COMMON = ("the", "of", "and", "to", "in", "is", "it", "on", "as", "by", "we", "so", "a", "or")
_POOL_SIZE = 1 << 16
_pool: list[str] = []


def _word_pool() -> list[str]:
    """65,536 pseudo-words (about four characters per word with its space, like a token)."""
    if not _pool:
        rnd = random.Random(20261129)
        cons, vows = "bcdfghjklmnprstvwz", "aeiou"
        vocab = list(_COMMON)
        while len(vocab) < 600:
            w = "".join(rnd.choice(cons) + rnd.choice(vows) for _ in range(rnd.choice((1, 1, 2))))
            if rnd.random() < 0.3:
                w += rnd.choice(cons)
            vocab.append(w)
        _pool.extend(rnd.choices(vocab, k=_POOL_SIZE))
    return _pool


def words_for(key: int, n: int) -> list[str]:
    pool = _word_pool()
    start = key % _POOL_SIZE
    if start + n <= _POOL_SIZE:
        return pool[start : start + n]
    out = pool[start:]
    while len(out) < n:
        out.extend(pool[: n - len(out)])
    return out
