"""Cost of reading input lines through `sources.input_lines` (corrupt-gzip detection with line/byte offsets)
against plain file iteration.

    .venv/bin/python bench/bench_input_lines.py [ROWS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.generation.data.inputs import iter_input  # noqa: E402
from fleet.generation.data.sources import input_lines, open_text  # noqa: E402


def best(fn, n: int = 3) -> float:
    out = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "in.jsonl"
        with p.open("w") as f:
            for i in range(rows):
                f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")

        def plain() -> int:
            with open_text(p) as f:
                return sum(1 for _ in f)

        a, b = best(plain), best(lambda: sum(1 for _ in input_lines(p)))
        c = best(lambda: sum(1 for _ in iter_input(p, None)), 1)
        print(f"{rows:,} lines: plain iteration {a:.3f} s, input_lines {b:.3f} s (+{b - a:.3f} s), "
              f"whole iter_input {c:.2f} s: the wrapper is {100 * (b - a) / c:.1f} % of reading the input")


if __name__ == "__main__":
    main()
