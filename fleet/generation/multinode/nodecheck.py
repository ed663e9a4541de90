"""Each node proves, before a job on object storage and before it rejoins one, that it can do what the
job needs: its runner venv has the store's packages, and with the environment its runner will have it
reads the input and writes, reads back and removes a small probe object under the output.

Why: with AWS_PROFILE set only where the controller ran, the SSH nodes' runners died inside botocore
(ProfileNotFound), every chunk's tries landed on those nodes and the job failed while a healthy node sat
idle (issue 35). Checked first, such a node is left out with one line naming it and the cause.

Two halves: `check_node` here, on the controller (through the node seam, the runner's own python and
code: `runner_command`), and `generation/job/storecheck.py` on the node, which the runner's entry point
runs for `--check-store` (so an SSH node runs it from the same venv and the same zipapp as its chunks). The answer is one JSON
line on stdout. Nothing of a credential is in an argument; a value of the runner's secret variables is
masked in any message that would repeat it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.config import FleetConfig, NodeConfig

MESSAGE_LINES = 3      # an error's message is passed on whole, up to this many lines (never cut mid-word)
_SECRET_WORDS = ("SECRET", "TOKEN", "CREDENTIALS", "KEY_ID", "PASSWORD")


def whole_lines(text: str, lines: int = MESSAGE_LINES) -> str:
    """`text`'s first `lines` non-empty lines, whole, joined by " / ": bounded by lines, not characters
    (a message cut at 300 characters read "ProfileNotFound(profi")."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    more = len(kept) > lines
    return " / ".join(kept[:lines]) + (" / …" if more else "")


def last_words(tail: str, lines: int = MESSAGE_LINES) -> str:
    """The last `lines` non-empty lines of a log's tail, each whole (the tail's first line may be cut:
    dropped), joined by " / ". Cut at 300 characters, the cause read "ProfileNotFound(profi"."""
    kept = [ln for ln in tail.splitlines()[1:] if ln.strip()] if "\n" in tail else [tail]
    return whole_lines("\n".join(kept[-lines:]), lines) or "(empty)"


def mask(text: str, env: Mapping[str, str]) -> str:
    """`text` with the value of each secret variable of `env` replaced by its name."""
    for name, value in env.items():
        if value and len(value) >= 6 and any(w in name.upper() for w in _SECRET_WORDS):
            text = text.replace(value, f"<{name}>")
    return text


def check_node(cfg: FleetConfig, node_cfg: NodeConfig, input_url: str, output_url: str,
               timeout_s: float | None = None) -> str | None:
    """None when node `node_cfg` can do the job's store access; else the cause, one line, no secret."""
    from fleet.errors import FleetError
    from fleet.generation.data.objstore import is_url, store_env
    from fleet.generation.job.remote import runner_command
    from fleet.generation.job.storecheck import CHECK_FLAG
    from fleet.node import connect

    urls = [u for u in (input_url, output_url) if is_url(u)]
    env = store_env(urls)   # what start_job gives the runner: the same names, the same values
    timeout = timeout_s if timeout_s is not None else max(60.0, cfg.generation.runner_start_s)
    try:
        node = connect(node_cfg)
    except Exception as exc:   # whatever form unreachable takes, it is this node's cause
        return mask(f"cannot connect: {_said(exc)}", env)
    try:
        try:
            prefix = runner_command(node, cfg, node_cfg, urls=urls)
        except Exception as exc:   # its runner venv cannot be built, or lacks the store's packages
            return mask(f"its runner venv: {_said(exc)}", env)
        probe = f"{node_cfg.name}-{secrets.token_hex(4)}"
        try:
            res = node.run([*prefix, CHECK_FLAG, input_url, output_url, probe], env=env, timeout=timeout,
                           check=False)
        except FleetError as exc:
            return mask(f"its store check did not answer: {exc.one_line()}", env)
        answer = _answer(res.stdout)
        if answer is None:
            return mask(f"its store check exited {res.exit_code} without an answer: "
                        f"{whole_lines(res.stderr.splitlines()[-1] if res.stderr.strip() else '(no output)')}", env)
        if answer.get("ok"):
            return None
        return mask(f"cannot {answer.get('step')}: {whole_lines(str(answer.get('error')))}", env)
    finally:
        node.close()


def _said(exc: BaseException) -> str:
    from fleet.errors import FleetError

    return exc.one_line() if isinstance(exc, FleetError) else whole_lines(f"{type(exc).__name__}: {exc}")


def _answer(stdout: str) -> dict[str, Any] | None:
    """The check's JSON line (its last line of stdout), or None."""
    for line in reversed(stdout.splitlines()):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        return got if isinstance(got, dict) else None
    return None
