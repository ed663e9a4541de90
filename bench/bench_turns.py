"""All-turns regeneration on unequal servers: does work stealing still balance dependent turns?

    .venv/bin/python bench/bench_turns.py [--conversations 1000] [--fast-tps 800] [--turns 3] [--max-tokens 64]

Two sims, one 4x faster than the other (800 vs 200 tok/s by default, 16 slots each). Job A: N
conversations of k assistant turns, `regenerate = "all-turns"` (k dependent requests each).
Job B: the same N*k requests as independent one-turn rows. Reported: each job's wall time,
the fast server's share of the decoded tokens (its share of the capacity is 0.8), and A/B: the
price of the dependency (a turn waits for the previous one) under work stealing. Turns are
not pinned: any free server takes a conversation's next turn. The sim charges nothing for a
prompt, so prefix-cache stickiness cannot show here (README, "What is regenerated").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sims import start_sims  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fast-tps", type=float, default=800.0, help="the fast server's tok/s (the slow one: a quarter)")
    args = ap.parse_args()
    from fleet.config import FleetConfig
    from fleet.generation.data.checks import account
    from fleet.generation.job.runner import ServerEntry, run_local

    procs, urls = start_sims([args.fast_tps, args.fast_tps / 4], 16, seed=5)
    try:
        entries = [ServerEntry(node="local", index=i, url=u, model="sim-model") for i, u in enumerate(urls)]
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            conv = tmp / "conv.jsonl"
            flat = tmp / "flat.jsonl"
            with open(conv, "w") as f, open(flat, "w") as g:
                for i in range(args.conversations):
                    turns = []
                    for t in range(args.turns):
                        turns += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": "old"}]
                        g.write(json.dumps({"id": f"f{i}.{t}", "messages": [
                            {"role": "user", "content": f"question {i}.{t}"}]}) + "\n")
                    f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
            out = {}
            for name, inp, mode in (("A all-turns", conv, "all-turns"), ("B one-turn rows", flat, "last-turn")):
                cfg = FleetConfig(name="b", engine={"kind": "sim"}, generation={
                    "max_tokens": args.max_tokens, "regenerate": mode, "max_concurrency_per_server": 16})
                dest = tmp / name.split()[0]
                t0 = time.monotonic()
                rc = run_local(cfg, inp, dest, entries, flush_interval_s=1.0, progress_interval_s=0.5)
                wall = time.monotonic() - t0
                m = json.loads((dest / "manifest.json").read_text())
                toks = [s["completion_tokens"] for s in m["servers"]]
                ok = account(inp, dest, cfg.generation)["ok"]
                out[name] = wall
                print(f"{name}: rc {rc}, wall {wall:.1f} s, completion tokens per server {toks} "
                      f"(fast share {toks[0] / sum(toks):.2f}), exactly-once {ok}")
            a, b = out["A all-turns"], out["B one-turn rows"]
            print(f"A/B wall = {a / b:.2f}")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
