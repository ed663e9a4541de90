"""What one commit costs at the seed job's shape, per commit interval (generation.commit_every_s).

    .venv/bin/python bench/bench_commit.py [--rate 7] [--commits 40] [--open-shards 2000]

The seed job: 902,087 rows in one to two days on one node (≈ 7 rows/s), answers of a
reasoning model (up to 4,096 tokens: lengths drawn log-normal, median ≈ 1,500 tokens, ≈ 4
characters per token, a third of it reasoning_content), a short prompt. For each interval the
runner buffers `rate × interval` rows and commits them as one Parquet shard (zstd, fsync of
the file and the directory): this measures, through the real `ResultStore`, the wall time and
the bytes of each commit (median and max of --commits), the rows a kill -9 can lose at most
(one interval's), and the shards a whole job leaves. Then the cost those shards carry later:
opening the store (a resume loads every shard's id column) with --open-shards shards of one
interval's size, scaled to the job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.generation.data.store import ResultStore  # noqa: E402

N_ROWS = 902_087
WORDS = ("the", "model", "a", "reason", "step", "so", "we", "check", "value", "then", "answer", "is", "because",
         "first", "second", "let", "x", "equals", "compute", "sum", "of", "and", "therefore", "wait")


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def row(rng: random.Random, i: int) -> dict[str, Any]:
    tokens = min(4096, max(16, int(rng.lognormvariate(math.log(1500), 0.7))))
    reasoning = tokens // 3
    now = time.time()
    return {"id": f"row-{i:07d}", "messages": [{"role": "user", "content": text(rng, 120)}],
            "completion": text(rng, tokens - reasoning), "reasoning_content": text(rng, reasoning),
            "finish_reason": "length" if tokens == 4096 else "stop", "prompt_tokens": 160,
            "completion_tokens": tokens, "server": "gpu1/3", "attempts": 1, "latency_s": 120.0,
            "started_at": now - 120, "finished_at": now, "turns": 1}


def measure(interval: float, rate: float, commits: int, rng: random.Random) -> dict[str, Any]:
    per = max(1, round(rate * interval))
    times, sizes = [], []
    with tempfile.TemporaryDirectory() as d:
        store = ResultStore(d, shard_rows=10**9)
        try:
            for c in range(commits):
                for k in range(per):
                    store.add_result(row(rng, c * per + k))
                before = set(os.listdir(store.shards_dir))
                t0 = time.perf_counter()
                store.flush()
                times.append(time.perf_counter() - t0)
                [new] = set(os.listdir(store.shards_dir)) - before
                sizes.append((store.shards_dir / new).stat().st_size)
        finally:
            store.close()
    med = statistics.median(times)
    return {"interval_s": interval, "rows_per_commit": per, "commit_ms_median": round(1000 * med, 1),
            "commit_ms_max": round(1000 * max(times), 1), "kib_per_commit": round(statistics.median(sizes) / 1024, 1),
            "busy_share_pct": round(100 * med / interval, 3), "shards_per_job": math.ceil(N_ROWS / per)}


def open_cost(shards: int, per: int, rng: random.Random) -> float:
    """Seconds to open a store of `shards` shards of `per` rows and load its done ids."""
    with tempfile.TemporaryDirectory() as d:
        store = ResultStore(d, shard_rows=10**9)
        for s in range(shards):
            for k in range(per):
                store.add_result(row(rng, s * per + k))
            store.flush()
        store.close()
        t0 = time.perf_counter()
        again = ResultStore(d, shard_rows=10**9)
        n = len(again.done_ids())
        dt = time.perf_counter() - t0
        again.close()
        assert n == shards * per
        return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=7.0, help="rows finished per second on the node")
    p.add_argument("--commits", type=int, default=40, help="commits measured per interval")
    p.add_argument("--intervals", default="2,5,10,30", help="commit intervals to compare, seconds")
    p.add_argument("--open-shards", type=int, default=2000, help="shards in the store-open measurement")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(a.seed)
    out = [measure(float(i), a.rate, a.commits, rng) for i in a.intervals.split(",")]
    print("| commit_every_s | rows per commit (lost at most by a kill -9) | commit ms (median / max) | KiB per commit "
          "| share of the interval spent committing | shards per 902,087-row job |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in out:
        print(f"| {r['interval_s']:g} | {r['rows_per_commit']} | {r['commit_ms_median']} / {r['commit_ms_max']} "
              f"| {r['kib_per_commit']} | {r['busy_share_pct']} % | {r['shards_per_job']:,} |")
    ten = next((r for r in out if r["interval_s"] == 10.0), out[0])
    t = open_cost(a.open_shards, ten["rows_per_commit"], rng)
    per_shard_ms = 1000 * t / a.open_shards
    print(f"\nopening a store of {a.open_shards:,} shards of {ten['rows_per_commit']} rows: {t:.2f} s "
          f"({per_shard_ms:.2f} ms per shard)")
    for r in out:
        print(f"  resume open at {r['interval_s']:g} s commits (whole job, scaled): "
              f"{r['shards_per_job'] * per_shard_ms / 1000:.0f} s")
    print(json.dumps({"rows": out, "open_shards": a.open_shards, "open_s": round(t, 2), "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
