"""Counts the suite's Python processes and which of them import Prefect (`--cpu-report`, tests/cpu_report.py).

On PYTHONPATH only while `--cpu-report` is on: each Python process that starts under the run (workers,
`fleet` and `prefect` commands, Prefect servers, flow runs, runners, sims) appends one line to
`$SUITE_PROC_LOG` when it starts and one when it first imports Prefect (a process killed later is still
counted). Processes started over SSH get a fresh environment and are not counted.
"""

import atexit
import json
import os
import sys

_LOG = os.environ.get("SUITE_PROC_LOG")


def _write(kind: str, **extra: object) -> None:
    try:
        with open(_LOG, "a") as f:   # one short line per write: appends of many processes do not mix
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), "argv": sys.argv[:6],
                                "orig": list(getattr(sys, "orig_argv", []))[:8], **extra}) + "\n")
    except OSError:
        pass


def _exit() -> None:
    # The process's own CPU (not its children's) when it exits normally: a process killed by a signal
    # it does not handle writes nothing, so the per-kind sums are a lower bound.
    t = os.times()
    _write("exit", cpu=round(t.user + t.system, 3))


class _FirstPrefectImport:
    # Stays on sys.meta_path (a flag, not a removal): removing itself while the import system walks
    # the list would skip the finder after it for that import.
    seen = False

    def find_spec(self, name, path=None, target=None):
        if not self.seen and (name == "prefect" or name.startswith("prefect.")):
            self.seen = True
            _write("prefect-import")
        return None


if _LOG:
    _write("start")
    atexit.register(_exit)
    sys.meta_path.insert(0, _FirstPrefectImport())
