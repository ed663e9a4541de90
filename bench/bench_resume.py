"""Resume planning at the seed job's size: 902,087 prompts, half of them done.

    .venv/bin/python bench/bench_resume.py

Builds a synthetic input (JSONL: OpenAI Batch, simple, ShareGPT and tool-calling rows, short
messages, a few malformed lines and duplicate ids), marks a random 50 % of the ids done by
writing result shards through ResultStore (small completions, some errors), then measures,
each in a fresh process so memory is its own:

    resume        open the store (lock, fingerprint check), load done_ids, stream the input
                  with skip_ids -> the remaining requests (counted, never held)
    full listing  stream the whole input, no skipping
    content ids   the same input without ids: every id is a SHA-256 of the row's content
    count_rows    the fast row count

Time per phase (median of --repeat runs), RSS after imports and peak RSS (VmHWM) of the process. Prints a markdown
table and appends it to bench/RESULTS.md under "## Resume planning (902,087 prompts)".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N = 902_087
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three python rust kernel tensor cache "
         "decode batch latency gradient token prompt server").split()


def rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MB, from /proc."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi))).capitalize() + "?"


def make_row(i: int, rng: random.Random, with_id: bool) -> dict:
    rid = f"req-{i:07d}"
    kind = rng.random()
    user = sentence(rng, 8, 24)
    if kind < 0.60:
        row = {"custom_id": rid, "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": user}], "max_tokens": 4096}}
    elif kind < 0.90:
        row = {"id": rid, "messages": [{"role": "system", "content": "You are helpful."},
                                       {"role": "user", "content": user}]}
    elif kind < 0.98:
        row = {"id": rid, "conversations": [{"from": "human", "value": user},
                                            {"from": "gpt", "value": sentence(rng, 5, 12)}]}
    else:
        row = {"id": rid, "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": sentence(rng, 4, 10)}],
            "tools": [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]}
    if not with_id:
        row.pop("id", None)
        row.pop("custom_id", None)
    return row


def generate(work: Path) -> dict:
    rng = random.Random(2026)
    t0 = time.perf_counter()
    stats = {"rows": 0, "bad": 0, "dups": 0}
    with open(work / "input.jsonl", "w") as f, open(work / "input-noids.jsonl", "w") as g:
        for i in range(N):
            r = rng.random()
            if r < 0.0001:
                f.write('{"id": "broken-%d", "messages": [\n' % i)  # bad JSON
                g.write('{"messages": [\n')
                stats["bad"] += 1
            elif r < 0.0002 and i > 10:
                j = rng.randrange(i)  # a duplicate id of an earlier row
                f.write(json.dumps({"id": f"req-{j:07d}", "messages": [{"role": "user", "content": "dup"}]}) + "\n")
                g.write(json.dumps(make_row(i, rng, False)) + "\n")
                stats["dups"] += 1
            else:
                seed = rng.random()
                rr = random.Random(seed)
                f.write(json.dumps(make_row(i, rr, True)) + "\n")
                g.write(json.dumps(make_row(i, random.Random(seed), False)) + "\n")
            stats["rows"] += 1
    stats["seconds"] = time.perf_counter() - t0
    stats["bytes"] = (work / "input.jsonl").stat().st_size
    return stats


def mark_half_done(work: Path) -> dict:
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.rows import Reject
    from fleet.generation.data.sources import input_fingerprint
    from fleet.generation.data.store import ResultStore

    rng = random.Random(7)
    out = work / "out"
    t0 = time.perf_counter()
    fp = input_fingerprint(work / "input.jsonl")
    done = errors = 0
    with ResultStore(out, shard_rows=10000, input_fingerprint=fp) as s:
        for item in iter_input(work / "input.jsonl", None):
            if isinstance(item, Reject):
                s.add_reject(item)
                continue
            if rng.random() >= 0.5:
                continue
            if rng.random() < 0.005:
                s.add_error(item.id, error="HTTP 400: prompt too long", attempts=1, line=item.line,
                            server="n/0", status=400)
                errors += 1
            else:
                s.add_result({"id": item.id, "messages": json.dumps(item.messages), "completion": "Short answer.",
                              "finish_reason": "stop", "prompt_tokens": 30, "completion_tokens": 3,
                              "server": f"n/{done % 8}", "attempts": 1, "latency_s": 0.2,
                              "started_at": 1.0, "finished_at": 1.2})
            done += 1
    counts = s.counts()  # after close: the last shard is committed
    return {"seconds": time.perf_counter() - t0, "done": done, "errors": errors, **counts}


# ---------------------------------------------------------------------------- phases (own process)


def phase(name: str, work: Path) -> dict:
    t_imp = time.perf_counter()
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.rows import InputStats
    from fleet.generation.data.sources import count_rows, input_fingerprint
    from fleet.generation.data.store import ResultStore

    import resource

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    items: Any
    res: dict = {"phase": name, "import_s": time.perf_counter() - t_imp}
    res["rss_after_import_mb"] = rss_mb()[0]
    st = InputStats()
    t0, c0 = time.perf_counter(), cpu()
    if name in ("resume", "resume-one-pass"):
        inp = work / "input.jsonl"
        t = time.perf_counter()
        fp = input_fingerprint(inp)
        res["fingerprint_s"] = time.perf_counter() - t
        t = time.perf_counter()
        store = ResultStore(work / "out", input_fingerprint=fp)
        res["open_s"] = time.perf_counter() - t
        t = time.perf_counter()
        done = store.done_ids()
        res["done_ids_s"] = time.perf_counter() - t
        res["done_ids"] = len(done)
        res["rss_after_done_ids_mb"] = rss_mb()[0]
        if name == "resume":   # planned: the ids only (plan_resume), then the planned lines validated
            from fleet.generation.data.resume import iter_planned, plan_resume

            t = time.perf_counter()
            plan = plan_resume(inp, None, done)
            res["plan_s"] = time.perf_counter() - t
            res["planned_lines"] = plan.remaining
            res["planning_total_s"] = time.perf_counter() - t0
            res["planning_cpu_s"] = cpu() - c0
            items = iter_planned(inp, None, plan, st)
        else:   # the one-pass reader (before): ids checked and rows validated as they are read
            items = iter_input(inp, None, skip_ids=done.__contains__, stats=st, plan=False)
        t = time.perf_counter()
        remaining = sum(1 for x in items if hasattr(x, "messages"))
        res["stream_s"] = time.perf_counter() - t
        res["remaining"] = remaining
        store.close()
    elif name in ("full", "content-ids"):
        inp = work / ("input.jsonl" if name == "full" else "input-noids.jsonl")
        res["requests"] = sum(1 for x in iter_input(inp, None, stats=st) if hasattr(x, "messages"))
        res["stream_s"] = time.perf_counter() - t0
    elif name == "count":
        res["rows"] = count_rows(work / "input.jsonl")
    res["total_s"] = time.perf_counter() - t0
    res["cpu_s"] = cpu() - c0
    res["stats"] = {k: getattr(st, k) for k in ("rows", "blank", "requests", "skipped", "rejects", "duplicates")}
    res["rss_end_mb"], res["peak_rss_mb"] = rss_mb()
    return res


def run_phase(name: str, work: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", name, "--workdir", str(work)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict:
    mem = "?"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "ram": mem, "cpu": cpu, "python": platform.python_version(),
            "platform": platform.platform(), "load": os.getloadavg()}


def side_by_side(results: dict, m: dict, repeat: int) -> str:
    """The planned resume against the one-pass reader, from the same runs (medians; CPU: the least)."""
    p, o = results["resume"], results["resume-one-pass"]
    before = o["fingerprint_s"] + o["open_s"] + o["done_ids_s"] + o["stream_s"]
    rows = [
        "| resume at 50 % | until the remaining rows are known | CPU s | all remaining rows validated | CPU s "
        "(least) | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| one pass (before: every row read and checked in turn) | {before:.2f} (the whole pass) | "
        f"{o['min_cpu_s']:.2f} | {o['total_s']:.2f} | {o['min_cpu_s']:.2f} | {o['peak_rss_mb']:.0f} |",
        f"| planned (fingerprint {p['fingerprint_s']:.2f} + open {p['open_s']:.2f} + done ids {p['done_ids_s']:.2f} "
        f"+ plan_resume {p['plan_s']:.2f}) | **{p['planning_total_s']:.2f}** | "
        f"{min(x for x in [p['planning_cpu_s']]):.2f} | {p['total_s']:.2f} | {p['min_cpu_s']:.2f} | "
        f"{p['peak_rss_mb']:.0f} |",
    ]
    return "\n".join([f"{repeat} runs each, load average {[round(x, 2) for x in m['load']]}; planned lines "
                      f"{p['planned_lines']:,}, requests {p['remaining']:,} (one pass: {o['remaining']:,})", *rows])


def main() -> None:
    global N
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="keep the files here (default: a temp dir, removed)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only, do not append to bench/RESULTS.md")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each phase (median time, worst peak RSS)")
    ap.add_argument("--rows", type=int, default=N, help="prompts to generate (smaller for a smoke "
                    "run; only the default is written to RESULTS.md)")
    ap.add_argument("--phases", default="resume,resume-one-pass,full,content-ids,count",
                    help="which phases to run (comma-separated; the table needs all of them)")
    ap.add_argument("--reuse", action="store_true", help="--workdir already holds the input and the half-done "
                    "store of an earlier run: measure only")
    args = ap.parse_args()
    if args.rows != N:
        N, args.no_write = args.rows, True
    if args.phase:
        print(json.dumps(phase(args.phase, args.workdir)))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="fleet-bench-resume-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.reuse:
            gen = json.loads((work / "generated.json").read_text())
            marked = json.loads((work / "marked.json").read_text())
        else:
            print(f"generating {N:,} prompts in {work} ...", flush=True)
            gen = generate(work)
            (work / "generated.json").write_text(json.dumps(gen))
            print(f"  {gen['bytes'] / 1e6:.0f} MB, {gen['bytes'] / N:.0f} bytes/row, {gen['seconds']:.1f} s", flush=True)
            print("marking 50 % done through ResultStore ...", flush=True)
            marked = mark_half_done(work)
            (work / "marked.json").write_text(json.dumps(marked))
        print(f"  {marked['done']:,} done ({marked['errors']:,} errors) in {marked['seconds']:.1f} s, "
              f"{marked['shards']} shards", flush=True)
        results = {}
        for name in args.phases.split(","):
            runs = []
            for _ in range(args.repeat):
                runs.append(run_phase(name, work))
                print(f"  {name}: {runs[-1]['total_s']:.2f} s, peak RSS {runs[-1]['peak_rss_mb']:.0f} MB", flush=True)
            # the median run by total time; the worst peak RSS of all runs
            runs.sort(key=lambda x: x["total_s"])
            results[name] = dict(runs[len(runs) // 2], peak_rss_mb=max(x["peak_rss_mb"] for x in runs),
                                 all_total_s=[round(x["total_s"], 2) for x in runs],
                                 min_cpu_s=min(x["cpu_s"] for x in runs))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    m = machine()
    if "resume" in results and "resume-one-pass" in results:
        print(side_by_side(results, m, args.repeat))
    if set(results) != {"resume", "resume-one-pass", "full", "content-ids", "count"}:
        return
    r, f, c, k = results["resume"], results["full"], results["content-ids"], results["count"]
    cmd = ".venv/bin/python bench/bench_resume.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    table = [
        "| what | rows out | seconds (median) | CPU s (least) | RSS after imports (MB) | peak RSS (MB) |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| resume: fingerprint (sha256 of {gen['bytes'] / 1e6:.0f} MB) | — | {r['fingerprint_s']:.2f} | | | |",
        f"| resume: open store (lock, job.json, shard footers) | — | {r['open_s']:.2f} | | | |",
        f"| resume: load done_ids ({r['done_ids']:,} ids from {marked['shards']} shards + errors) | "
        f"{r['done_ids']:,} | {r['done_ids_s']:.2f} | | | {r['rss_after_done_ids_mb']:.0f} (RSS after) |",
        f"| resume: stream input with skip_ids | {r['remaining']:,} remaining | {r['stream_s']:.2f} | | | |",
        f"| **resume planning, total** | {r['remaining']:,} | **{r['total_s']:.2f}** | {r['min_cpu_s']:.2f} | "
        f"{r['rss_after_import_mb']:.0f} | **{r['peak_rss_mb']:.0f}** |",
        f"| full listing (ids in the input) | {f['requests']:,} | {f['total_s']:.2f} | {f['min_cpu_s']:.2f} | "
        f"{f['rss_after_import_mb']:.0f} | {f['peak_rss_mb']:.0f} |",
        f"| full listing (no ids: SHA-256 content ids) | {c['requests']:,} | {c['total_s']:.2f} | "
        f"{c['min_cpu_s']:.2f} | {c['rss_after_import_mb']:.0f} | {c['peak_rss_mb']:.0f} |",
        f"| count_rows | {k['rows']:,} | {k['total_s']:.2f} | {k['min_cpu_s']:.2f} | {k['rss_after_import_mb']:.0f} | "
        f"{k['peak_rss_mb']:.0f} |",
    ]
    st = r["stats"]
    notes = [
        f"- input: {N:,} rows, {gen['bytes'] / 1e6:.0f} MB JSONL ({gen['bytes'] / N:.0f} bytes/row): 60 % OpenAI "
        f"Batch, 30 % simple with a system prompt, 8 % ShareGPT, 2 % tool-calling; {gen['bad']} bad-JSON lines, "
        f"{gen['dups']} duplicate ids",
        f"- done before the resume: {marked['done']:,} ids ({marked['errors']:,} in errors.jsonl), written through "
        f"ResultStore in {marked['seconds']:.1f} s ({marked['shards']} shards of 10,000)",
        f"- resume pass: {st['skipped']:,} skipped, {st['requests']:,} yielded, {st['rejects']} rejects "
        f"({st['duplicates']} duplicates)",
        f"- each phase runs {args.repeat}x, each time in a fresh process: seconds are the median run's (all runs, "
        f"resume: {r['all_total_s']}, full listing: {f['all_total_s']}); CPU s the least of the runs (user + "
        f"system: less sensitive than wall time to other work on the machine); peak RSS the worst (VmHWM: the "
        f"interpreter and pyarrow included, {r['rss_after_import_mb']:.0f} MB after imports)",
    ]
    reading = (
        f"Reading: planning a resume at 50 % done takes {r['total_s']:.1f} s and peaks at {r['peak_rss_mb']:.0f} MB "
        f"RSS, {r['peak_rss_mb'] - r['rss_after_import_mb']:.0f} MB above the interpreter with pyarrow loaded; the "
        f"{r['done_ids']:,} done ids load in {r['done_ids_s']:.2f} s (the shards' id column only, kept as 8-byte "
        f"digests in a sorted array). Nearly all the time is parsing and validating rows in Python "
        f"({f['total_s'] / f['requests'] * 1e6:.1f} µs per row for the full listing, a skipped row about half "
        f"of that), and the memory is the duplicate-id table (12 bytes per slot) and the interpreter; nothing "
        f"grows with the text of the input. An input without ids costs {c['total_s'] / f['total_s']:.1f}x as "
        f"much: each id is a SHA-256 of the row's canonical JSON, made with the stdlib so that ids never depend "
        f"on which JSON library is installed.")
    text = "\n".join([
        "", "## Resume planning (902,087 prompts)", "",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — `{cmd}`", "",
        f"- host: {m['platform']}, {m['cpu']}, nproc {m['nproc']}, RAM {m['ram']}, Python {m['python']}",
        f"- load average at the end (other work on the machine skews results): {[round(x, 2) for x in m['load']]}",
        *notes, "", *table, "", reading, "",
    ])
    print(text)
    if not args.no_write:
        with open(ROOT / "bench" / "RESULTS.md", "a") as fh:
            fh.write(text)
        print(f"appended to {ROOT / 'bench' / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
