"""`--lockstep-rows N`: how soon a client refills a slot, counted rather than timed (issue 27).

Chat generations are held and answered one at a time, the oldest first, and only while
`--max-running-requests` of them are held: after each answer nothing more is answered until
the client has sent that slot's next row. So a client that refills a slot only after some
other event (another answer, a poll, a flush) never gets one: its job stops there. Once N
generations have arrived (the client has no more rows), the rest are answered at once.

Per connection it also counts what came first on a connection that just carried an answer:
the row's refill, or something else (a probe that took the connection the answer freed, so
the refill had to wait behind it): `interlopers`; and the connections that carried both rows
and other requests: `shared` (a client whose probes share the rows' connections).

`GET /sim/lockstep` answers the counts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

__all__ = ["Lockstep"]


class Lockstep:
    """Answer one held generation at a time, only while every slot is held; count the refills."""

    def __init__(self, slots: int, rows: int) -> None:
        self.slots = slots
        self.rows = rows
        self.arrived = 0        # generations received
        self.answered = 0       # generations answered
        self.full = 0           # answered while every slot was held (all but the tail)
        self.interlopers = 0    # a connection that just carried an answer sent something else first
        self._held: deque[tuple[asyncio.Future[None], object]] = deque()
        self._answered_on: set[object] = set()   # connections whose answer has not been followed yet
        self._rows_on: set[object] = set()       # connections that carried a generation
        self._other_on: set[object] = set()      # connections that carried anything else

    def request(self, conn: object, generation: bool) -> None:
        """Every request, as it arrives (before its route runs)."""
        (self._rows_on if generation else self._other_on).add(conn)
        if conn in self._answered_on:
            self._answered_on.discard(conn)
            if not generation:
                self.interlopers += 1

    async def hold(self, conn: object) -> None:
        """A generation on `conn`: return when it is its turn to be answered."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.arrived += 1
        self._held.append((fut, conn))
        self._next()
        try:
            await fut
        except asyncio.CancelledError:   # its client went away: the slot is free again
            self._held = deque(h for h in self._held if h[0] is not fut)
            raise

    def _next(self) -> None:
        if self.arrived >= self.rows:    # every row is in: no refill will come, answer the rest
            while self._held:
                self._answer()
        elif len(self._held) >= self.slots:
            self.full += 1
            self._answer()

    def _answer(self) -> None:
        fut, conn = self._held.popleft()
        self.answered += 1
        self._answered_on.add(conn)
        fut.set_result(None)

    def counts(self) -> dict[str, Any]:
        return {"slots": self.slots, "rows": self.rows, "arrived": self.arrived, "answered": self.answered,
                "full": self.full, "interlopers": self.interlopers,
                "shared": len(self._rows_on & self._other_on), "held": len(self._held)}
