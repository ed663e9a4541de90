"""`--cpu-report PATH`: the CPU each test costs, to find what makes the suite slow (off by default).

The suite is CPU-bound on its 2-core CI machine, and most of that CPU is not in the test process:
`fleet` commands, Prefect servers and workers, flow-run subprocesses, sshd sessions, simulated and
`transformers serve` servers. So each test process puts itself in its own cpuacct cgroup (v1, when
the machine lets it make one): every process it starts stays in it, also one that detaches (setsid,
double fork) or one that sshd forks for a session of the test's sshd, and the cgroup's counters are
exact. Per test (setup, call and teardown: a module's servers are counted in the tests that start,
use and stop them) one JSON line is appended to PATH: the node id, the worker, wall seconds, the
cgroup's user and system CPU seconds, and the whole machine's busy CPU seconds (/proc/stat: other
work on the machine included) with the load average. Without a cgroup the CPU is the test process's
own and that of the children it waited for (getrusage), which misses servers it leaves running.

    .venv/bin/python -m pytest -n 0 tests/test_x.py --cpu-report /tmp/cpu.jsonl
    .venv/bin/python tests/cpu_report.py /tmp/cpu.jsonl      # per module and the top tests

It also counts the run's Python processes by kind, and which imported Prefect (tests/proccount/:
PATH.procs), for the processes that inherit the run's environment (not those started over SSH).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_TICK = os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="PATH", default=None,
                     help="append one JSON line per test with its CPU seconds (the test process and "
                          "everything it started) to PATH")


class _Meter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.cgroup: Path | None = None
        try:
            # below this process's own cpuacct cgroup, so that one around the whole run counts it too
            mine = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if "cpuacct" in line.split(":")[1].split(","))
            cg = _CPUACCT / mine.lstrip("/") / f"fleet-tests-{os.getpid()}"
            cg.mkdir(exist_ok=True)
            (cg / "cgroup.procs").write_text(str(os.getpid()))
            self.cgroup = cg
        except (OSError, StopIteration):
            pass

    def cpu(self) -> tuple[float, float]:
        """User and system CPU seconds so far of this process and everything it started."""
        if self.cgroup is not None:
            return (int((self.cgroup / "cpuacct.usage_user").read_text()) / 1e9,
                    int((self.cgroup / "cpuacct.usage_sys").read_text()) / 1e9)
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:   # one short line per write: appends of the workers do not mix
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.cgroup is None:
            return
        user, sys_ = self.cpu()
        self.write({"worker": self.worker, "session_total": True, "user": round(user, 3), "sys": round(sys_, 3)})
        try:   # back to the root cgroup; the directory goes once nothing started here is left in it
            (self.cgroup.parent / "cgroup.procs").write_text(str(os.getpid()))
            self.cgroup.rmdir()
        except OSError:
            pass


def _machine_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


_METER_KEY = pytest.StashKey[_Meter]()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-report")
    if path and not hasattr(config, "workerinput") and not os.environ.get("SUITE_PROC_LOG"):
        # every Python process of the run from here on (the workers too) counts itself: proccount/
        os.environ["SUITE_PROC_LOG"] = str(Path(path).resolve()) + ".procs"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent / "proccount"), *filter(None, [os.environ.get("PYTHONPATH")])])
    if not path or (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")):
        return   # off, or the xdist controller (it runs no test)
    config.stash[_METER_KEY] = _Meter(Path(path))


def pytest_unconfigure(config: pytest.Config) -> None:
    meter = config.stash.get(_METER_KEY, None)
    if meter is not None:
        meter.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    meter = item.config.stash.get(_METER_KEY, None)
    if meter is None:
        return (yield)
    t0, (u0, s0), m0 = time.monotonic(), meter.cpu(), _machine_busy()
    try:
        return (yield)
    finally:
        (u1, s1), m1 = meter.cpu(), _machine_busy()
        meter.write({"test": item.nodeid, "worker": meter.worker, "wall": round(time.monotonic() - t0, 3),
                     "user": round(u1 - u0, 3), "sys": round(s1 - s0, 3), "machine": round(m1 - m0, 3),
                     "load1": os.getloadavg()[0], "end": round(time.time(), 3)})


def report(path: Path, top: int = 40) -> None:
    """CPU per module, then the costliest tests, from a --cpu-report file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tests = [r for r in rows if "test" in r]
    by_module: dict[str, list[float]] = {}
    for r in tests:
        m = by_module.setdefault(r["test"].split("::")[0], [0, 0.0, 0.0, 0.0])
        m[0] += 1
        m[1] += r["wall"]
        m[2] += r["user"] + r["sys"]
        m[3] += r["machine"]
    total = sum(m[2] for m in by_module.values())
    print(f"{'module':45} {'tests':>5} {'wall s':>8} {'cpu s':>8} {'share':>6} {'machine s':>9}")
    for name, (n, wall, cpu, machine) in sorted(by_module.items(), key=lambda kv: -kv[1][2]):
        print(f"{name:45} {n:5d} {wall:8.1f} {cpu:8.1f} {cpu / total:6.1%} {machine:9.1f}")
    sessions = [r for r in rows if r.get("session_total")]
    print(f"{'all tests':45} {len(tests):5d} {sum(r['wall'] for r in tests):8.1f} {total:8.1f}")
    if sessions:
        print(f"test processes' cgroups in all (between tests too): "
              f"{sum(r['user'] + r['sys'] for r in sessions):.1f} s CPU")
    print(f"\n{'test':100} {'wall s':>7} {'cpu s':>7}")
    for r in sorted(tests, key=lambda r: -(r["user"] + r["sys"]))[:top]:
        print(f"{r['test'][:100]:100} {r['wall']:7.1f} {r['user'] + r['sys']:7.1f}")


def kind_of(argv: list[str]) -> str:
    """What a Python process of the run was, from its interpreter's argv (`sys.orig_argv`)."""
    line = " ".join(argv)
    if "create_app" in line:
        return "Prefect server (uvicorn)"
    if "prefect.engine" in line:
        return "flow run (prefect.engine)"
    if " worker start" in line:
        return "prefect worker"
    if "/bin/prefect " in line or "-m prefect " in line:
        return "prefect command"
    if (len(argv) > 1 and argv[1].endswith("/bin/fleet")) or "-m flows.cli" in line:
        return "fleet command"
    if "exec(eval(sys.stdin.readline()))" in line:
        return "pytest worker"
    if "fleet.generation.job.runner" in line or "multinode" in line:
        return "runner or controller"
    if "fleet_sim.pyz" in line or "fleet.cli sim" in line:
        return "sim server"
    if "fleet_stage.py" in line:
        return "staging helper"
    return "other python"


def count_report(path: Path) -> dict[str, tuple[int, int]]:
    """Per kind of process: how many started, how many of them imported Prefect, and the CPU of those
    that exited normally (their own, not their children's; from PATH.procs)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    started = {r["pid"]: kind_of(r.get("orig") or r["argv"]) for r in rows if r["kind"] == "start"}
    imported = {r["pid"] for r in rows if r["kind"] == "prefect-import"}
    exited = {r["pid"]: float(r["cpu"]) for r in rows if r["kind"] == "exit"}
    out: dict[str, tuple[int, int]] = {}
    cpu: dict[str, tuple[int, float]] = {}
    for pid, kind in started.items():
        n, p = out.get(kind, (0, 0))
        out[kind] = (n + 1, p + (pid in imported))
        if pid in exited:
            m, c = cpu.get(kind, (0, 0.0))
            cpu[kind] = (m + 1, c + exited[pid])
    print(f"\n{'python processes':30} {'started':>8} {'imported prefect':>17} {'exited':>7} {'their cpu s':>12}")
    for kind, (n, p) in sorted(out.items(), key=lambda kv: -kv[1][0]):
        m, c = cpu.get(kind, (0, 0.0))
        print(f"{kind:30} {n:8d} {p:17d} {m:7d} {c:12.1f}")
    print(f"{'all':30} {sum(n for n, _ in out.values()):8d} {sum(p for _, p in out.values()):17d} "
          f"{sum(m for m, _ in cpu.values()):7d} {sum(c for _, c in cpu.values()):12.1f}")
    return out

if __name__ == "__main__":
    report(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
    if Path(sys.argv[1] + ".procs").exists():
        count_report(Path(sys.argv[1] + ".procs"))
