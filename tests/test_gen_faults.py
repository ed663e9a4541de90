"""The fault soak, small: every kind of fault once or twice during one job through a local sim fleet.

bench/bench_faults.py runs the same `soak_job` at default settings over jobs of 20,000 rows; here
the watchdog is short (stall_s 1 s, probe 1 s) so that the job stays small. Every wait inside
polls a condition with a deadline; nothing asserts a speed.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_faults import KINDS, launch_fleet, sim_config, soak_job, stop_fleet  # noqa: E402


def test_fault_soak_small_every_row_exactly_once(tmp_path: Path) -> None:
    """Faults: SIGKILL of a server, SIGSTOP of a server (left stopped), SIGKILL of the runner
    then resume, a burst of HTTP 500s, a server killed again while it is being relaunched — all
    in one job. After it: every input id in exactly one place (no loss, no duplicate), errors
    exactly the rows that are genuinely bad (prompts over the context), rejects exactly the
    malformed lines, every faulted server back in use, the runner resumed."""
    from conftest import port_block

    rng = random.Random(7)
    port = port_block(3)
    cfg = sim_config(tmp_path / "work", port, 3, tokens_per_s=50, slots=8, startup_s=0.5, max_tokens=32,
                     generation={"stall_s": 1.0})
    try:
        entries = launch_fleet(cfg)
        res = soak_job(cfg, entries, tmp_path / "job", rows=2500, faults=len(KINDS), kinds=KINDS, rng=rng,
                       first_after_s=0.5, gap_s=(0.2, 0.5), dispatch={"stall_probe_timeout_s": 1.0},
                       progress_interval_s=0.1, flush_interval_s=0.5, deadline_s=240, log=lambda s: None)
    finally:
        stop_fleet(cfg)
    assert sorted(f.kind for f in res.faults) == sorted(KINDS), (res.problems, res.faults)
    assert not res.problems, res.problems
    assert res.account_ok and res.duplicated == 0 and res.missing == 0
    assert res.errors_exact and res.errors == 5, "errors are exactly the rows over the context"
    assert res.rejects_exact and res.runner_runs == 2
    for f in res.faults:
        if f.kind in ("server-kill", "server-stop", "relaunch-kill"):
            assert f.down_s is not None and f.up_s is not None, f
        if f.kind == "relaunch-kill":
            assert f.second_pid is not None, "the relaunch itself was killed"
        if f.kind == "runner-kill":
            assert f.resumed_s is not None


def test_fault_soak_node_loss_small_every_row_exactly_once(tmp_path: Path) -> None:
    """Faults (issue 14): a node lost mid-job twice — frozen (runner and servers SIGSTOPped: no progress,
    no answer) then back, and killed (runner and servers SIGKILLed: a reboot), each while its chunk is
    unfinished. Each time that chunk goes back to the queue: the frozen node's to the other node, starting
    from the shards already gathered; the killed node, which still answers, may take its own back (its
    failed attempt resumes from its committed shards). The frozen node rejoins. After the
    job: every input id exactly once in the merge, errors exactly the rows over the context, rejects
    exactly the malformed lines."""
    from conftest import port_block

    from bench_faults import NODE_KINDS, launch_nodes, soak_nodes, stop_nodes, two_node_config

    rng = random.Random(11)
    port = port_block(3)
    cfg = two_node_config(tmp_path / "w", port, tokens_per_s=40, slots=4, startup_s=0.3, max_tokens=16,
                          generation={"chunk_rows": 200, "shard_rows": 20, "node_lost_s": 4})
    try:
        specs = launch_nodes(cfg)
        res = soak_nodes(cfg, specs, tmp_path / "job", rows=1200, kinds=NODE_KINDS, rng=rng, deadline_s=600,
                         controller={"fetch_every_s": 1.0}, log=lambda s: None)
    finally:
        stop_nodes(cfg)
    assert [f.kind for f in res.faults] == list(NODE_KINDS), (res.problems, res.faults)
    assert not res.problems, res.problems
    assert res.account_ok and res.duplicated == 0 and res.missing == 0 and res.completed == 1200 - 3
    assert res.errors_exact and res.rejects_exact
    assert all(f.lost_s is not None for f in res.faults)
    assert res.faults[0].back_s is not None, "the frozen node rejoined"
