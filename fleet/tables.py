"""Plain-text tables for the command line, drawn by rich.

rich fits a table to its console, and a console that is not a terminal (a pipe, a test's
captured stdout, a CI log) is 80 columns wide: it would wrap or cut every row of a wide
table (a summary row has twelve columns). So the table is rendered at its natural width —
every cell on one line, never cut, never wrapped — without colour or box characters, and
with no trailing padding: `fleet status | grep dead` and `awk '{print $2}'` keep working.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

MAX_CELL = 60  # a cell longer than this (a log path, an error) ends in "…"


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, indent: int = 0,
          right: Sequence[str] = (), max_cell: int | None = MAX_CELL) -> str:
    """The table as text: a header line, then one line per row; columns two spaces apart.

    `right` names the columns aligned right (numbers); `max_cell` caps a cell's width (None: no cap).
    """
    t = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0), header_style="",
              collapse_padding=True)
    for c in columns:
        t.add_column(c, no_wrap=True, overflow="ellipsis", max_width=max_cell,
                     justify="right" if c in right else "left")
    for r in rows:
        t.add_row(*r)
    width = Console(width=100_000).measure(t).maximum
    console = Console(width=max(width, 1), no_color=True, highlight=False, force_terminal=False,
                      color_system=None, emoji=False, markup=False)
    with console.capture() as cap:
        console.print(t, soft_wrap=False)
    pad = " " * indent
    return "\n".join(pad + line.rstrip() for line in cap.get().rstrip("\n").split("\n"))
