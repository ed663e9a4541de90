"""The type checker's gate: mypy, strict on `fleet/`, passes.

The configuration is `[tool.mypy]` in pyproject.toml (strict, the pydantic plugin, stubs for
paramiko; pyarrow, which ships no types, is the one untyped import). No fleet module is exempt:
the temporary list of not-yet-clean modules of the issue-15 refactoring is gone, and stays gone.

mypy alone (`.venv/bin/mypy`) keeps its cache in `.mypy_cache/` at the repository root (gitignored).
The suite gives it one cache per user in the temp dir instead (`MYPY_CACHE`), shared by every checkout
and run on the machine under an flock: CI runs on a fresh clone, where `.mypy_cache/` is always empty,
and a cold run took 77 s of CPU (388 s of wall at load 10) on the 2-core CI machine, a warm one 2.5 s.
mypy's cache is keyed by each file's contents and the options, so a warm run finds what a cold one
does (it rechecks whatever changed: another checkout's sources or venv included).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MYPY_CACHE = Path(tempfile.gettempdir()) / f"fleet-test-mypy-{os.getuid()}"


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args],
        cwd=cwd, capture_output=True, text=True, timeout=1200,
    )


def _overrides() -> list[dict[str, object]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(cfg["tool"]["mypy"].get("overrides", []))


def _names(override: dict[str, object]) -> list[str]:
    mods = override["module"]
    return [str(m) for m in mods] if isinstance(mods, list) else [str(mods)]


@pytest.mark.timeout(1300)
def test_fleet_is_strict_clean() -> None:
    MYPY_CACHE.mkdir(mode=0o700, exist_ok=True)
    with open(MYPY_CACHE / ".lock", "w") as lock:   # another run's mypy writes the same cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = _mypy("--cache-dir", str(MYPY_CACHE / "cache"))  # files and strictness come from pyproject.toml
    assert r.returncode == 0, f"mypy (strict on fleet/) failed:\n{r.stdout}{r.stderr}"


def test_config_is_strict() -> None:
    """The gate is not toothless: the config in force is strict on fleet/."""
    mypy_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy_cfg.get("strict") is True
    assert mypy_cfg.get("files") == ["fleet"]
    for o in _overrides():
        # overrides are for third-party modules only: no fleet module is exempt or checked less
        fleet_mods = [m for m in _names(o) if m == "fleet" or m.startswith("fleet.")]
        assert not fleet_mods, f"fleet modules must pass strict mypy, not be overridden: {o}"


@pytest.mark.timeout(300)
def test_strict_config_catches_an_untyped_function(tmp_path: Path) -> None:
    """The same config flags what strict mode is for: an unannotated function and a bare ignore."""
    pkg = tmp_path / "probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "def f(x):\n    return x\n\n"
        "y: int = 'text'  # type: ignore\n"
    )
    r = _mypy("--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
              str(pkg), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[no-untyped-def]" in r.stdout, r.stdout
    assert "[ignore-without-code]" in r.stdout, r.stdout

