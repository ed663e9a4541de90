"""The runner process never loads pandas: pyarrow would import it for nothing.

The first time pyarrow converts a Python list (`pa.array(values, type=...)`, a shard's columns at
the first commit), it imports pandas to learn pandas' null values and types — ≈ 0.3 s of CPU and
≈ 25 MB of RSS, once per runner process, that is, once per job and per chunk attempt of a
multi-node job. The runner converts only Python values with explicit Arrow types, so none of it is
used. `refuse_pandas()` makes `import pandas` fail in this process, which pyarrow takes as "pandas
is not installed" (its conversions are the same without it; only pandas-specific calls such as
`Table.to_pandas` raise, with the message below). Only `python -m fleet.generation.job.runner`
calls it: code that imports the runner's modules (tests, `run_local`) keeps pandas.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

WHY = ("the generation runner does not load pandas (pyarrow would import it on its first list conversion, "
       "for nothing): fleet/generation/job/nopandas.py")


class _NoPandas:
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(WHY, name=name)
        return None


def refuse_pandas() -> bool:
    """From now on `import pandas` fails in this process; False when pandas is loaded already (nothing to save)."""
    if "pandas" in sys.modules:
        return False
    if not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())
    return True
