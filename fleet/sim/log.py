"""SGLang's log shape, written line by line to stdout (which the launcher sends to a file)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Log:
    """SGLang's log shape: ``[YYYY-mm-dd HH:MM:SS] msg``, ``[... TP0] msg`` from the scheduler.

    Every line is flushed: the launcher redirects stdout into a log file that fleet tails.
    """

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self._sec = -1
        self._stamp = ""

    def _ts(self) -> str:
        now = int(time.time())
        if now != self._sec:
            self._sec = now
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        return self._stamp

    def info(self, msg: str, tp: bool = False) -> None:
        self.write(f"[{self._ts()}{' TP0' if tp else ''}] {msg}\n")

    def write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            pass  # a closed or broken log must not take the server down
