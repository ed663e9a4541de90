"""The docs match the code: the README's schema table is the generated one, every command has --help."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.schema_doc import schema_markdown

ROOT = Path(__file__).parent.parent


def test_readme_schema_is_current() -> None:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- schema:begin[^>]*-->\n(.*?)\n<!-- schema:end -->", text, re.S)
    assert m, "README lost its schema markers"
    assert m.group(1) == schema_markdown(), "README schema is stale: python -m fleet.schema_doc"


def test_readme_opens_with_the_two_commands() -> None:
    first_block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    cmds = [ln.split("#")[0].strip() for ln in first_block.splitlines() if ln.strip()]
    assert cmds == ["./dev.sh demo", "./dev.sh test"]
    assert "./dev.sh test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("cmd", ["", "demo", "preflight", "up", "status", "down", "generate", "fetch", "export",
                                 "plan", "inspect-log", "tiny-model", "report"])
def test_every_command_has_help(cmd: str) -> None:
    r = subprocess.run([sys.executable, "-m", "flows.cli", *([cmd] if cmd else []), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: fleet" in r.stdout and len(r.stdout) > 150


def test_sim_help_reaches_the_simulator() -> None:
    r = subprocess.run([sys.executable, "-m", "flows.cli", "sim", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--crash-after" in r.stdout


def test_readme_lists_every_command() -> None:
    """Fault: `tiny-model` (and `deploy`) were missing from README's command list; a new command must be
    listed there too (`fleet demo` is in the README's first lines)."""
    from fleet.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = (ROOT / "README.md").read_text()
    listed = text.split("## Using it", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    missing = [cmd for cmd in sub.choices if cmd != "demo" and f".venv/bin/fleet {cmd} " not in listed]
    assert len(sub.choices) == len(COMMANDS) and not missing, f"not in README's command list: {missing}"
