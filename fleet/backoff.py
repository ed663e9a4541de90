"""The one backoff rule of the core: exponential, capped, with multiplicative jitter.

Used by the smoke client between attempts, the SSH connect retries and the generation
dispatcher (request retries and server recovery). Each caller owns its loop and its stop
conditions (a deadline, a watched process); this only says how long to wait.
"""

from __future__ import annotations

import math
import random


def backoff_delay(attempt: int, base_s: float, *, max_s: float = math.inf, factor: float = 2.0,
                  jitter: float = 0.0, rng: random.Random | None = None) -> float:
    """Delay before retry number `attempt` (1-based): base_s * factor^(attempt-1), capped at max_s,
    then stretched by up to `jitter` of itself (0.5: between 1x and 1.5x), so retries spread."""
    delay = min(max_s, base_s * factor ** (attempt - 1))
    if jitter:
        delay *= 1 + jitter * (rng or random).random()
    return delay
