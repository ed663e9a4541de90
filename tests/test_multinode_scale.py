"""The controller over 20 fake nodes: bench/bench_controller_scale.py, small, counting only.

The controller's real code (a node_loop thread per node, run_chunk per attempt, the cuts, the
prestarts, state.json) drives fake nodes at the seam (connect/start_job) on a compressed clock,
some of them lost for a while mid-job. Nothing here asserts a speed or a ratio: only counts that
hold however slowly this machine runs (a thread starved past node_lost_s is a node loss more,
which the controller must survive the same way).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_controller_scale import run  # noqa: E402


def _args(**kw: object) -> argparse.Namespace:
    base = dict(nodes=20, rows=20_000, speed=25.0, losses=0.2, node_lost_s=60.0, probe_s=10.0, poll_s=1.0,
                seed=5, max_wall_s=240.0, uncached=False, whole_state=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_controller_twenty_fake_nodes_every_chunk_done_once_with_losses() -> None:
    """Twenty nodes of 7-8 servers, five of them lost for 60-300 s mid-job: the job ends (no stop
    on the wall-clock deadline, no chunk failed three times), every chunk is done by exactly one
    attempt, and the task runs are one per node plus one per chunk attempt (the Prefect count the
    README's scale section quotes)."""
    r = run(_args())
    assert r["errors"] == []
    assert r["losses"] == 5
    assert r["chunks_done"] == r["chunks"] == r["chunks_done_once"]
    assert r["task_runs"] >= r["nodes"] + r["chunks"]
    assert r["start_jobs"] >= r["chunks"]


def test_controller_scans_state_once_per_change_not_per_node_per_decision() -> None:
    """The first limit the scale bench found: every decision (next_size, min_rest) asked each
    node's rate, and each answer scanned every chunk's attempts — O(nodes × chunks) per decision,
    seconds per decision at 1,000 nodes. Now the rates come from one scan per change of the state:
    the scans are at most the state's writes, however many questions were asked."""
    r = run(_args(losses=0.0, seed=3))
    assert r["errors"] == []
    assert r["rate_questions"] > 5 * r["rate_scans"]
    assert r["rate_scans"] <= r["state_writes"] + 1
