"""Each node proves, before a job on object storage and before it rejoins one, that it can do what the
job needs: its runner venv has the store's packages, and with the environment its runner will have it
reads the input and writes, reads back and removes a small probe object under the output.

Why: with AWS_PROFILE set only where the controller ran, the SSH nodes' runners died inside botocore
(ProfileNotFound), every chunk's tries landed on those nodes and the job failed while a healthy node sat
idle (issue 35). Checked first, such a node is left out with one line naming it and the cause.

Two halves: `check_node` on the controller (through the node seam, the runner's own python and code:
`runner_command`), and `check_main` on the node, which the runner's entry point runs for `--check-store`
(so an SSH node runs it from the same venv and the same zipapp as its chunks). The answer is one JSON
line on stdout. Nothing of a credential is in an argument; a value of the runner's secret variables is
masked in any message that would repeat it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.config import FleetConfig, NodeConfig

CHECK_FLAG = "--check-store"
PROBE_DIR = "_probe"   # under the job's --output: the probe objects, each removed once read back
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


# -- on the node


def run_checks(input_url: str, output_url: str, probe: str) -> dict[str, Any]:
    """What the node can do with the store, as the runner would: {"ok": True}, or {"ok": False, "step": what
    failed, "error": its exception, whole}. The probe object is removed (also when reading it back failed)."""
    from fleet.generation.data.objstore import Store, is_url

    step = f"load the store's packages for {output_url}"
    out = None
    rel = f"{PROBE_DIR}/{probe}"
    try:
        out = Store(output_url)
        if is_url(input_url):
            step = f"read the input {input_url}"
            _read_head(input_url)
        step = f"write a probe object under {output_url}"
        body = f"fleet node check {probe}\n".encode()
        out.write_bytes(rel, body)
        step = f"read the probe object back from {output_url}"
        if out.read_bytes(rel) != body:
            raise OSError("the probe object read back differs from what was written")
        step = f"remove the probe object under {output_url}"
        out.fs.rm(out._p(rel))
        return {"ok": True}
    except Exception as exc:   # any failure is the answer: said whole, with its type
        if out is not None and not step.startswith("remove"):
            try:
                out.fs.rm(out._p(rel))
            except Exception:   # it was never written, or this node cannot remove it: the answer stands
                pass
        return {"ok": False, "step": step, "error": f"{type(exc).__name__}: {exc}"}


def _read_head(url: str) -> None:
    """The first bytes of the input (a ranged read, not the object), or the listing of a directory."""
    from fleet.generation.data.objstore import Store

    parent, _, name = url.rstrip("/").rpartition("/")
    st = Store(parent)
    path = st._p(name)
    if st.fs.isdir(path):
        st.fs.ls(path, detail=False)
    else:
        st.fs.cat_file(path, start=0, end=64)


def check_main(argv: list[str]) -> int:
    """`runner --check-store INPUT OUTPUT PROBE`: one JSON line on stdout; exit 0 when every check passed."""
    if len(argv) != 3:
        print(json.dumps({"ok": False, "step": "parse its arguments", "error": f"usage: {CHECK_FLAG} INPUT OUTPUT PROBE"}))
        return 2
    result = run_checks(*argv)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 3


# -- on the controller


def check_node(cfg: FleetConfig, node_cfg: NodeConfig, input_url: str, output_url: str,
               timeout_s: float | None = None) -> str | None:
    """None when node `node_cfg` can do the job's store access; else the cause, one line, no secret."""
    from fleet.errors import FleetError
    from fleet.generation.data.objstore import is_url, store_env
    from fleet.generation.job.remote import runner_command
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


def set_aside_line(name: str, cause: str) -> str:
    return f"node {name} set aside: {cause}"


def causes_line(causes: Iterable[tuple[str, str]]) -> str:
    return " | ".join(f"{n}: {c}" for n, c in causes)

