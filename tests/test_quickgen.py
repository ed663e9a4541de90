"""The quick `fleet generate` re-attach (flows/quickgen.py): the flow's records without Prefect's engine,
and the flow's own path for anything that is not a one-node, local-output re-attach to a live runner.

Fault (issue 37, item 2): a `fleet generate` that re-attached to a running job imported Prefect and ran
its flow engine for an adopt-only bring-up and a follow: ≈ 6.5× a `fleet status` on a loaded 2-core
machine (bench/RESULTS.md).

The jobs here run on real sim servers through the real detached runner; the runner is frozen
(SIGSTOP) once it has shown both servers generating, so a job outlives every check without a race,
and thawed (SIGCONT) when the test lets it finish.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_until
from fleet.config import FleetConfig
from test_quickup import _api, _diff, _env, _norm, _runs

pytestmark = pytest.mark.usefixtures("prefect_api")

ROOT = Path(__file__).resolve().parents[1]
ROWS = 200
_GLYPHS = "▁▂▃▄▅▆▇█▏▎▍▌▋▊▉─"

# Runs the command as `fleet` runs it, then says whether it imported Prefect.
_CODE = ("import sys, flows.cli; rc = flows.cli.main(sys.argv[1:]); "
         "print('PREFECT-IMPORTED' if 'prefect' in sys.modules else 'PREFECT-NOT-IMPORTED', flush=True); "
         "sys.exit(rc)")


def _cfg(tmp_path: Path, name: str, **kw: Any) -> tuple[FleetConfig, Path]:
    from fleet.demo import to_toml
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(2), n=2, name=name,
                     engine={"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 200,
                                                    "max_running_requests": 8}},
                     generation={"max_tokens": 64, "max_concurrency_per_server": 2},
                     smoke={"first_timeout_s": 30, "timeout_s": 30, "attempts": 2, "backoff_s": 0.1,
                            "job_proof_s": 0}, **kw)
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    return cfg, path


def _rows(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                                + "\n" for i in range(ROWS)))
    return path


class Gen:
    """`fleet generate` as a command in its own session, its output in a file."""

    def __init__(self, tmp_path: Path, path: Path, out: Path, log: str, **env: str) -> None:
        self.log = tmp_path / log
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CODE, "generate", "-c", str(path), "--input", str(_rows(tmp_path)),
                 "--output", str(out)], cwd=ROOT, env={**_env(), **env}, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        def seen() -> bool:
            if needle in self.text():
                return True
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {needle!r}:\n{self.text()[-4000:]}"
            return False

        wait_until(seen, timeout=timeout, interval=0.1, what=f"{needle!r} from fleet generate")

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"fleet generate did not end:\n{self.text()[-4000:]}") from None

    @property
    def imported_prefect(self) -> bool:
        return "PREFECT-IMPORTED" in self.text()


def _job_pid(cfg: FleetConfig, out: Path) -> int:
    from fleet.jobs import job_dir

    jdir = Path(job_dir(cfg.nodes[0], cfg, str(out)))
    return int((jdir / "runner.pid").read_text().split()[0])


def _progress(out: Path) -> dict[str, Any] | None:
    try:
        got = json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def frozen_job(tmp_path: Path, cfg: FleetConfig, path: Path, out: Path, log: str) -> int:
    """A job started by `fleet generate` (the flow), its runner frozen once both servers have generated,
    the command stopped (Ctrl-C: the runner is detached). Returns the runner's pid."""
    first = Gen(tmp_path, path, out, log, FLEET_QUICK_UP="0")
    try:
        first.wait_for("started runner pid")

        def generating() -> bool:
            p = _progress(out)
            assert first.proc.poll() is None, first.text()[-4000:]
            return bool(p and len(p.get("servers") or []) == 2
                        and all(s.get("served_s") is not None for s in p["servers"]))

        wait_until(generating, timeout=240, interval=0.1, what="both servers generating")
        pid = _job_pid(cfg, out)
        os.kill(pid, signal.SIGSTOP)
        p = _progress(out)
        assert p and p.get("state") != "done" and (p.get("rows_done") or 0) < ROWS, p
    finally:
        os.killpg(first.proc.pid, signal.SIGINT)
        first.finish()
    return pid


def stop_all(cfg: FleetConfig) -> None:
    """Every runner of the fleet (thawed first: a stopped process holds SIGTERM), then its servers."""
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    for pid_file in Path(cfg.nodes[0].workdir).glob("jobs/*/runner.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
    stop_servers(LocalNode(), cfg, cfg.nodes[0])


def _records(api: Any, run: dict[str, Any], subs: dict[str, str]) -> dict[str, Any]:
    """A run's records as test_quickup compares them, with progress lines as a set (how many the follow
    logs depends on when its polls fall) and the job's own paths made one."""
    rid = run["id"]
    tasks = api.post("task_runs/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    arts = api.post("artifacts/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [rid]}}}).json()
    by_id = {t["id"]: t["name"] for t in tasks}

    def n(text: Any) -> str:
        text = json.dumps(text) if not isinstance(text, str) else text
        for a, b in subs.items():
            text = text.replace(a, b)
        # the manifest's measured series (pairs of numbers) are as long as the job's timing made them
        # and the throughput chart's glyphs and widths are the measured rates
        text = re.sub(r"(\[\s*N,\s*N\s*\],?\s*)+", "[pairs]", _norm(text))
        return re.sub(r" {2,}", " ", re.sub(f"[{_GLYPHS} ]*[{_GLYPHS}][{_GLYPHS} ]*", "#", text))

    return {
        "name": run["name"], "state": run["state_name"], "message": n(run["state"]["message"]),
        "parameters": n(run["parameters"]), "tags": run["tags"], "flow_version": run["flow_version"],
        "tasks": sorted((t["name"], t["state_name"], t["task_key"], t["empirical_policy"]["retries"],
                         n(t["state"]["message"])) for t in tasks),
        "artifacts": sorted((a["key"], a["type"], by_id.get(a["task_run_id"]), n(a["description"]),
                             n(a["data"]) if a["type"] != "progress" else a["data"]) for a in arts
                            if a["key"] and not a["key"].endswith("generate-servers")),
        "servers-tables": sorted({n(a["description"]) for a in arts if (a["key"] or "").endswith("generate-servers")}),
        "logs": sorted({(lg["name"], lg["level"], by_id.get(lg["task_run_id"]), n(lg["message"])) for lg in logs}),
    }


def _finished_logged(api: Any, run_id: str) -> bool:
    logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}}).json()
    return any(lg["message"].startswith("Finished in state") and lg["task_run_id"] is None for lg in logs)


def _rows_once(out: Path) -> list[str]:
    from test_generate_flow import shard_ids

    return [str(i) for i in shard_ids(out)]


@pytest.mark.timeout(900)
def test_a_reattach_writes_the_records_the_flow_writes_without_importing_prefect(tmp_path: Path) -> None:
    """The same re-attach through the flow's path (FLEET_QUICK_UP=0) and the quick one, each to the job's
    end, on one Prefect server: the same flow run (name, state, message, parameters, tags, version), task
    runs (names, states, keys, retry policy, messages), artifacts (keys, types, task, description, text;
    the progress artifact at 100), log lines; the quick command imports no Prefect, prints what
    `fleet generate` prints, and the node lock is back."""
    cfg, path = _cfg(tmp_path, "qgeq")
    out_a, out_b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    try:
        runner = frozen_job(tmp_path, cfg, path, out_a, "start-a.log")
        flow = Gen(tmp_path, path, out_a, "flow.log", FLEET_QUICK_UP="0")
        flow.wait_for("re-attached to runner pid")
        os.kill(runner, signal.SIGCONT)
        assert flow.finish() == 0, flow.text()[-4000:]
        assert flow.imported_prefect

        runner = frozen_job(tmp_path, cfg, path, out_b, "start-b.log")
        quick = Gen(tmp_path, path, out_b, "quick.log")
        quick.wait_for("re-attached to runner pid")
        assert _progress(out_b)["state"] != "done"   # type: ignore[index]
        os.kill(runner, signal.SIGCONT)
        assert quick.finish() == 0, quick.text()[-4000:]
        said = quick.text()
        assert not quick.imported_prefect, said[-4000:]
        assert f"Task run 'generate-local' - re-attached to runner pid {runner}" in said, said[-4000:]
        printed = json.loads(said[said.index("\n{") + 1:said.index("\n}\n") + 2])
        assert printed["state"] == "done" and printed["completed"] == ROWS, printed
        assert re.search(r"^fleet generate: generated [\d,]+ row\(s\) in this run", said, re.M), said[-2000:]
        assert sorted(_rows_once(out_b)) == sorted(f"r{i}" for i in range(ROWS))

        from fleet.jobs import job_dir

        subs = {str(out_b): str(out_a), job_dir(cfg.nodes[0], cfg, str(out_b)): job_dir(cfg.nodes[0], cfg, str(out_a))}
        with _api() as api:
            runs = _runs(api, "generate-qgeq")
            assert [r["state_name"] for r in runs] == ["Crashed", "Completed", "Crashed", "Completed"], \
                [(r["state_name"], r["state"]["message"]) for r in runs]
            for r in (runs[1], runs[3]):
                wait_until(lambda r=r: _finished_logged(api, r["id"]), timeout=60, what=f"{r['name']}'s last line")
            want, got = _records(api, runs[1], subs), _records(api, runs[3], subs)
            for what in want:   # one field at a time: a difference shows as itself
                if isinstance(want[what], list):
                    for g, w in zip(got[what], want[what]):
                        assert g == w, (what, _diff(g, w))
                assert got[what] == want[what], (what, _diff(got[what], want[what]))
            assert any(a[0] == "qgeq-local-generate-progress" and a[4] == 100.0 for a in got["artifacts"])
            from tasks.locks import lock_names, record_name

            for name in lock_names(cfg):
                assert api.get(f"v2/concurrency_limits/{name}").json()["active_slots"] == 0
                assert api.get(f"variables/name/{record_name(name)}").status_code == 404
    finally:
        stop_all(cfg)
