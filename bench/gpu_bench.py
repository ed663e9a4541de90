"""The bring-up and a generation job on real GPUs (the lent H200 machines), in one call.

On the device machine (no network; wheels carried in .whl, see bench/RESULTS.md for the exact call):

    python3 bench/gpu_bench.py --out "$OUT" --params-b 1.7 --seconds-per-pass 60

Steps, all through fleet's own code on the local node (the machine has no sshd):
 1. `nvidia-smi` inventory (saved: real CSV for the parser tests).
 2. Build a Qwen3-shaped random-weight model in bf16 (fleet.tinymodel) on the local disk.
 3. Bring-up through the Prefect `fleet` flow, model served from the LOCAL DISK (model.stage=false):
    one `transformers serve --continuous-batching` per GPU; time to healthy per server and for all.
 4. Teardown, then the same bring-up with the model STAGED to /dev/shm (the RAM-disk step).
 5. First-request latency (the smoke) vs steady state (sequential requests after it).
 6. Generation: the same prompts through fleet's runner (work-stealing dispatcher) and through a
    plain saturating aiohttp client straight at the servers (the engine's own ceiling), alternating
    order; tok/s of each and their ratio (goal >= 0.95).
Prints a markdown table and writes $OUT/gpu_results.json and $OUT/gpu_table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout


def drop_caches() -> bool:
    try:
        subprocess.run("sync", shell=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def served_path(cfg: Any, model: Path) -> str:
    """The model path the servers were launched with, from their launch records: the RAM-disk copy
    is per user, fleet and source state (`<ramdisk>/fleet-<uid>/<fleet>/<name>-<key>`), and
    `transformers serve` refuses a request naming another path (HTTP 400 "Server is pinned to …")."""
    from fleet.node import LocalNode
    from fleet.servers import records

    recs = records(LocalNode(), cfg.nodes[0].workdir, cfg.name)
    found = next((r["model_path"] for r in recs if r.get("model_path")), None)
    return str(found or model)


def make_config(args: argparse.Namespace, model: Path, gpus: int, stage: bool, base_port: int) -> Any:
    from fleet.config import FleetConfig

    return FleetConfig(
        name="gpu-bench",
        nodes=[{"name": "h200", "workdir": "/tmp/fleet-gpu"}],
        engine={"kind": "transformers", "device": "cpu" if args.cpu else "cuda", "continuous_batching": True,
                "mem_fraction_static": args.mem_fraction},
        model={"source": str(model), "stage": stage, "stage_margin_gb": 1.0},
        venv={"path": sys.prefix, "use_existing": True},
        servers={"count": gpus, "base_port": base_port, "ready_timeout_s": 600, "stop_grace_s": 10},
        smoke={"first_timeout_s": 300, "timeout_s": 120, "attempts": 3, "max_tokens": 32},
        generation={"max_tokens": args.max_tokens, "temperature": 0.6,
                    "max_concurrency_per_server": args.concurrency},
    )


def bringup(cfg: Any) -> tuple[bool, list[dict[str, Any]], float]:
    from flows.fleet import fleet
    from flows.outcome import run_data

    t0 = time.monotonic()
    state = fleet(config=cfg, action="bringup", return_state=True)
    rows = run_data(state)
    return state.is_completed(), rows if isinstance(rows, list) else [], time.monotonic() - t0


def teardown(cfg: Any) -> None:
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    stop_servers(LocalNode(), cfg, cfg.nodes[0])


def stage_artifact_seconds() -> dict[str, Any]:
    import asyncio as aio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def go() -> dict[str, Any]:
        async with get_client() as c:
            arts = await c.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gpu-bench-h200-stage"])))
            return {"markdown": arts[0].data} if arts else {}

    return aio.run(go())


def prompts(n: int, path: Path) -> None:
    topics = ["a lighthouse", "binary search", "the French revolution", "a sourdough starter", "TCP slow start",
              "a haiku about rain", "the Krebs cycle", "a unit test for a stack", "Rust lifetimes", "a chess opening"]
    with path.open("w") as f:
        for i in range(n):
            msg = f"Request {i}: write a few paragraphs about {topics[i % len(topics)]}, variation {i // len(topics)}."
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": msg}]}) + "\n")


async def plain_client(urls: list[str], model: str, rows: list[dict[str, Any]], max_tokens: int,
                       concurrency: int) -> dict[str, Any]:
    """The engine's ceiling: a saturating aiohttp client, `concurrency` in flight per server."""
    import aiohttp

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for r in rows:
        queue.put_nowait(r)
    tokens = 0
    done = 0
    # per server, like the runner's progress.json timeline: [elapsed s, in flight, rows done, tokens]
    per = {u: {"in_flight": 0, "done": 0, "tokens": 0, "first_s": None, "timeline": []} for u in urls}
    t0 = time.monotonic()

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal tokens, done
        st = per[url]
        while True:
            try:
                r = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"model": model, "messages": r["messages"], "max_tokens": max_tokens, "temperature": 0.6}
            st["in_flight"] += 1
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                    data = await resp.json(content_type=None)
            finally:
                st["in_flight"] -= 1
            if resp.status == 200:
                tokens += data["usage"]["completion_tokens"]
                done += 1
                st["done"] += 1
                st["tokens"] += data["usage"]["completion_tokens"]
                if st["first_s"] is None:
                    st["first_s"] = round(time.monotonic() - t0, 2)

    async def sample() -> None:
        while True:
            t = round(time.monotonic() - t0, 1)
            for st in per.values():
                st["timeline"].append([t, st["in_flight"], st["done"], st["tokens"]])
            await asyncio.sleep(1.0)

    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                      timeout=aiohttp.ClientTimeout(total=1800)) for _ in urls]
    sampler = asyncio.ensure_future(sample())
    try:
        await asyncio.gather(*[worker(s, u) for s, u in zip(sessions, urls) for _ in range(concurrency)])
    finally:
        sampler.cancel()
        for s in sessions:
            await s.close()
    wall = time.monotonic() - t0
    return {"rows": done, "completion_tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "servers": [{"url": u, "rows": st["done"], "first_completion_s": st["first_s"],
                         "timeline": st["timeline"]} for u, st in per.items()]}


def runner_pass(cfg: Any, rows_up: list[dict[str, Any]], model: str, inp: Path, out: Path) -> dict[str, Any]:
    from fleet.generation.job.runner import ServerEntry, run_local

    servers = [ServerEntry(node=r["node"], index=r["server"], url=f"http://127.0.0.1:{r['port']}", model=model,
                           gpus=list(r["gpus"] or [])) for r in rows_up]
    import shutil

    shutil.rmtree(out, ignore_errors=True)  # a fresh job each pass, not a resume
    t0 = time.monotonic()
    rc = run_local(cfg, inp, out, servers, relaunch=False, console=True)
    wall = time.monotonic() - t0
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else {}
    import pyarrow.parquet as pq

    tokens = 0
    for shard in sorted((out / "shards").glob("*.parquet")):
        tokens += sum(x or 0 for x in pq.read_table(shard, columns=["completion_tokens"]).column(0).to_pylist())
    firsts: dict[str, float] = {}
    for shard in sorted((out / "shards").glob("*.parquet")):
        t = pq.read_table(shard, columns=["server", "finished_at"]).to_pylist()
        for row in t:
            firsts[row["server"]] = min(firsts.get(row["server"], float("inf")), row["finished_at"])
    started = (manifest.get("timings") or {}).get("started_at") or 0
    return {"rc": rc, "seconds": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
            "manifest_throughput": manifest.get("throughput"),
            "servers": [{"name": s_.get("name"), "rows": s_.get("requests"), "held_s": s_.get("held_s"),
                         "lat_s": s_.get("lat_s"), "stalls": s_.get("stalls"),
                         "first_completion_s": round(firsts[s_["name"]] - started, 2) if s_.get("name") in firsts
                         and started else None, "timeline": s_.get("timeline")}
                        for s_ in manifest.get("servers") or []]}


def scaling(args: argparse.Namespace, model: Path, gpus: int, base_port: int, out: Path) -> list[dict[str, Any]]:
    """For each N in --scale: a clean bring-up of N servers (time to N healthy), then one runner pass
    sized to N (tok/s as servers are added). Each step tears down first, so N starts from nothing."""
    from fleet.engines import get_profile
    from fleet.servers import plan_servers

    steps = []
    for n in [int(x) for x in args.scale.split(",") if int(x) <= gpus]:
        cfg = make_config(args, model, n, stage=True, base_port=base_port)
        teardown(cfg)
        ok, rows, wall = bringup(cfg)
        step: dict[str, Any] = {"servers": n, "ok": ok, "bringup_wall_s": wall,
                                "ready_s": [r.get("ready_s") for r in rows]}
        if ok:
            spec = plan_servers(cfg, cfg.nodes[0], list(range(n)), model_path=served_path(cfg, model),
                                python=sys.executable)[0]
            model_id = get_profile("transformers").request_model(spec)
            inp = Path(f"/tmp/gpu-bench-scale-{n}.jsonl")
            prompts(args.scale_prompts_per_server * n, inp)
            urls = [f"http://127.0.0.1:{r['port']}" for r in rows]
            warm = [json.loads(ln) for ln in inp.read_text().splitlines()][: args.concurrency * n]
            asyncio.run(plain_client(urls, model_id, warm, args.max_tokens, args.concurrency))  # warm every server
            step["runner"] = runner_pass(cfg, rows, model_id, inp, Path(f"/tmp/gpu-bench-scale-out-{n}"))
        steps.append(step)
        print("scale", {k: v for k, v in step.items() if k != "runner"}, step.get("runner", {}).get("tok_s"), flush=True)
        teardown(cfg)
    if steps and steps[0].get("runner"):
        t1 = max(x for x in steps[0]["ready_s"] if x)
        r1 = steps[0]["runner"]["tok_s"]
        lines = ["| servers (GPUs) | slowest ready_s | vs 1 | runner tok/s | vs 1 |", "| --- | --- | --- | --- | --- |"]
        for st in steps:
            tn = max((x for x in st["ready_s"] if x), default=float("nan"))
            rn = st.get("runner", {}).get("tok_s", float("nan"))
            lines.append(f"| {st['servers']} | {tn:.1f} | {tn / t1:.2f} | {rn:.0f} | {rn / r1:.2f} |")
        (out / "gpu_scaling.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    return steps


def _pid_of(cfg: Any, index: int) -> int | None:
    from fleet.servers import server_paths

    try:
        text = Path(server_paths(cfg.nodes[0].workdir, cfg.name, index).pid).read_text().strip()
    except OSError:
        return None
    first = text.split()[0] if text else ""   # "PID STARTTIME"
    return int(first) if first.isdigit() else None


def stop_test(args: argparse.Namespace, cfg: Any, rows_up: list[dict[str, Any]], model_id: str, out: Path,
              t_start: float) -> dict[str, Any]:
    """SIGSTOP (left stopped) of one server at --stop-at of a job run by the flow's `generate`
    action, at default generation settings; then interleaved runner / plain passes with a
    per-server timeline each (what a half-speed pass would show). Everything is watched by
    polling progress.json and the pid files."""
    import shutil
    import signal
    import threading

    from flows.fleet import fleet
    from fleet.generation.data.checks import account

    res: dict[str, Any] = {}
    victim = len(rows_up) - 1
    inp = Path("/tmp/gpu-stop-prompts.jsonl")
    prompts(args.stop_rows, inp)
    flow_out = Path("/tmp/gpu-bench-stop-out")
    shutil.rmtree(flow_out, ignore_errors=True)
    box: dict[str, Any] = {}

    def run_flow() -> None:
        t = time.monotonic()
        st = fleet(config=cfg, action="generate", input=str(inp), output=str(flow_out), return_state=True)
        r = st.result(raise_on_failure=False)
        box.update(ok=st.is_completed(), message=st.message, seconds=time.monotonic() - t,
                   result=r if isinstance(r, dict) else str(r))

    th = threading.Thread(target=run_flow, daemon=True)
    t0 = time.monotonic()
    th.start()
    ev: dict[str, Any] = {"victim": rows_up[victim].get("server", victim)}
    old_pid = None
    while th.is_alive() and time.monotonic() - t0 < args.stop_deadline_s:
        try:
            p = json.loads((flow_out / "progress.json").read_text())
        except (OSError, ValueError):
            p = None
        now = time.monotonic()
        if p and p.get("servers") and len(p["servers"]) > victim:
            sv = p["servers"][victim]
            total = p.get("rows_total") or args.stop_rows
            if old_pid is None and p.get("rows_done", 0) >= args.stop_at * total:
                old_pid = _pid_of(cfg, victim)
                os.kill(old_pid, signal.SIGSTOP)   # left stopped: the relaunch path must deal with it
                ev.update(t_stop=now - t0, rows_done_at_stop=p["rows_done"], in_flight_at_stop=sv["in_flight"],
                          victim_rows_at_stop=sv["requests"], old_pid=old_pid)
                print("SIGSTOP server", victim, "pid", old_pid, "at", p["rows_done"], "rows", flush=True)
            elif old_pid is not None:
                if "detect_s" not in ev and sv["state"] != "up":
                    ev.update(detect_s=round(now - t0 - ev["t_stop"], 1), down_reason=sv.get("down_reason"))
                    print("detected", ev["detect_s"], sv.get("down_reason"), flush=True)
                pid = _pid_of(cfg, victim)
                if "detect_s" in ev and "up_s" not in ev and sv["state"] == "up" and pid not in (None, old_pid):
                    ev.update(up_s=round(now - t0 - ev["t_stop"], 1), new_pid=pid)
                    ev["relaunch_s"] = round(ev["up_s"] - ev["detect_s"], 1)
                    print("back up", ev["up_s"], "relaunch", ev["relaunch_s"], flush=True)
        time.sleep(0.25)
    th.join(timeout=60)
    res["flow_generate"] = box
    ev["job_s"] = round(time.monotonic() - t0, 1)
    try:
        final = json.loads((flow_out / "progress.json").read_text())
        manifest = json.loads((flow_out / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        final, manifest = {}, {"error": str(exc)}
    acc = account(inp, flow_out)
    ev["account"] = {k: acc[k] for k in ("ok", "requests", "completed", "errors", "missing", "duplicated")}
    ev["servers"] = [{k: s_.get(k) for k in ("name", "state", "requests", "downs", "restarts", "stalls", "down_reason",
                                             "timeline")} for s_ in final.get("servers") or []]
    ev["throughput"] = manifest.get("throughput")
    from fleet.jobs import job_dir

    jlog = Path(job_dir(cfg.nodes[0], cfg, str(flow_out))) / "runner.log"
    try:
        ev["runner_log_tail"] = [ln for ln in jlog.read_text().splitlines()
                                 if "stall" in ln or "relaunch" in ln or "down" in ln or "stopped" in ln][-20:]
    except OSError:
        ev["runner_log_tail"] = []
    res["stop"] = ev
    print("stop test", json.dumps({k: v for k, v in ev.items() if k != "servers"}, default=str), flush=True)

    # interleaved passes, each with a per-server timeline, while device time allows
    urls = [f"http://127.0.0.1:{r['port']}" for r in rows_up]
    probe_rows = [{"messages": [{"role": "user", "content": f"probe {i}: tell me a story"}]}
                  for i in range(args.concurrency * len(urls))]
    probe = asyncio.run(plain_client(urls, model_id, probe_rows, args.max_tokens, args.concurrency))
    n = max(args.concurrency * len(urls) * 2, int(probe["tok_s"] * args.seconds_per_pass / args.max_tokens))
    pin = Path("/tmp/gpu-bench-pass-prompts.jsonl")
    prompts(n, pin)
    rows_in = [json.loads(ln) for ln in pin.read_text().splitlines()]
    passes = []
    for order in ("runner", "plain", "plain", "runner", "runner", "plain"):
        if time.monotonic() - t_start > args.budget_s:
            print("device budget reached: passes stop here", flush=True)
            break
        if order == "runner":
            p = runner_pass(cfg, rows_up, model_id, pin, Path(f"/tmp/gpu-bench-gen-{len(passes)}"))
        else:
            p = asyncio.run(plain_client(urls, model_id, rows_in, args.max_tokens, args.concurrency))
        p["kind"] = order
        passes.append(p)
        print(order, f"{p['tok_s']:.0f} tok/s", [(x.get("rows"), x.get("first_completion_s")) for x in p["servers"]],
              flush=True)
    res["passes"] = passes
    res["pass_rows"] = n
    return res


def stop_table(res: dict[str, Any], gpus: int) -> str:
    ev = res["stop"]
    acc = ev.get("account") or {}
    lines = [
        "| GPUs | rows | SIGSTOP at rows | in flight on it | detected (left `up`) s | relaunch (down → up) s | "
        "stop → back in use s | completed / errors / missing / duplicated | flow generate | job s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {gpus} | {acc.get('requests')} | {ev.get('rows_done_at_stop')} | {ev.get('in_flight_at_stop')} | "
        f"{ev.get('detect_s')} | {ev.get('relaunch_s')} | {ev.get('up_s')} | {acc.get('completed')} / "
        f"{acc.get('errors')} / {acc.get('missing')} / {acc.get('duplicated')} | "
        f"{'ok' if res.get('flow_generate', {}).get('ok') else 'FAILED'} | {ev.get('job_s')} |",
    ]
    if res.get("passes"):
        lines += ["", "| pass | kind | tok/s | rows per server | first completion per server s |", "| --- | --- | --- | --- | --- |"]
        for i, p in enumerate(res["passes"]):
            lines.append(f"| {i} | {p['kind']} | {p['tok_s']:.0f} | "
                         f"{', '.join(str(x.get('rows')) for x in p['servers'])} | "
                         f"{', '.join(str(x.get('first_completion_s')) for x in p['servers'])} |")
        r = [p["tok_s"] for p in res["passes"] if p["kind"] == "runner"]
        q = [p["tok_s"] for p in res["passes"] if p["kind"] == "plain"]
        if r and q and sum(q) > 0:   # passes that all failed have no ratio
            lines.append(f"\nrunner / plain (means): {sum(r) / len(r):.0f} / {sum(q) / len(q):.0f} = "
                         f"{(sum(r) / len(r)) / (sum(q) / len(q)):.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-bench-out"))
    ap.add_argument("--params-b", type=float, default=1.7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64, help="in flight per server, runner and plain client alike")
    ap.add_argument("--seconds-per-pass", type=float, default=60.0)
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--skip-disk", action="store_true", help="skip the local-disk bring-up")
    ap.add_argument("--cpu", action="store_true", help="dry run on this machine: tiny model, one CPU server")
    ap.add_argument("--scale", default="", help="e.g. 1,2,4,8: time to N healthy and runner tok/s for each N "
                                                 "(N <= GPUs), then stop")
    ap.add_argument("--scale-prompts-per-server", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=None, help="servers to use (default: every GPU nvidia-smi lists)")
    ap.add_argument("--stop-test", action="store_true",
                    help="SIGSTOP one server mid-job through the flow's generate action, then interleaved passes")
    ap.add_argument("--stop-rows", type=int, default=1200)
    ap.add_argument("--stop-at", type=float, default=0.3, help="share of rows done when the server is stopped")
    ap.add_argument("--stop-deadline-s", type=float, default=360.0)
    ap.add_argument("--budget-s", type=float, default=480.0, help="no pass starts after this many seconds")
    args = ap.parse_args()
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": vars(args)}
    smi = sh("nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version "
             "--format=csv,noheader,nounits")
    (out / "nvidia_smi.csv").write_text(smi)
    gpus = args.gpus or len([ln for ln in smi.splitlines() if ln.strip()]) or 1
    res["machine"] = {"gpus": gpus, "nvidia_smi": smi.strip().splitlines(), "cpus": os.cpu_count(),
                      "python": sys.version.split()[0], "shm": sh("df -h /dev/shm | tail -1").strip()}
    import torch
    import transformers

    res["machine"].update(torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps(res["machine"], indent=1), flush=True)

    from fleet.demo import free_port_block
    from fleet.tinymodel import build_tiny_model, count_parameters, qwen3_shape

    shape = {} if args.cpu else qwen3_shape(args.params_b)
    t0 = time.monotonic()
    where = Path("/tmp/fleet-models/tiny-cpu" if args.cpu else "/root/fleet-models/qwen3-random")
    model = build_tiny_model(where, device="cpu" if args.cpu else "cuda", **shape)
    res["model"] = {"params": count_parameters(**(shape or {})) if shape else 0, "build_s": time.monotonic() - t0,
                    "bytes": sum(p.stat().st_size for p in model.rglob("*") if p.is_file())}
    print("model", res["model"], flush=True)
    base = free_port_block(gpus, start=30000)
    if args.scale:
        res["scaling"] = scaling(args, model, gpus, base, out)
        (out / "gpu_results.json").write_text(json.dumps(res, indent=2, default=str))
        return 0

    if not args.skip_disk:
        cfg = make_config(args, model, gpus, stage=False, base_port=base)
        res["disk_cache_dropped"] = drop_caches()
        ok, rows, wall = bringup(cfg)
        res["bringup_disk"] = {"ok": ok, "wall_s": wall, "rows": rows}
        print("bring-up from local disk:", ok, f"{wall:.1f}s", [r.get("ready_s") for r in rows], flush=True)
        teardown(cfg)

    cfg = make_config(args, model, gpus, stage=True, base_port=base)
    res["ram_cache_dropped"] = drop_caches()
    ok, rows, wall = bringup(cfg)
    res["bringup_ramdisk"] = {"ok": ok, "wall_s": wall, "rows": rows}
    print("bring-up from RAM disk:", ok, f"{wall:.1f}s", [r.get("ready_s") for r in rows], flush=True)
    if not ok:
        (out / "gpu_results.json").write_text(json.dumps(res, indent=2, default=str))
        sh(f"cp /tmp/fleet-gpu/servers/*.log {out}/ 2>/dev/null")
        return 1
    try:
        res["stage_artifact"] = stage_artifact_seconds()
    except Exception as exc:  # noqa: BLE001 - a bench records what it could not read
        res["stage_artifact"] = {"error": str(exc)}

    from fleet.engines import get_profile
    from fleet.servers import plan_servers

    spec = plan_servers(cfg, cfg.nodes[0], list(range(gpus)), model_path=served_path(cfg, model),
                        python=sys.executable)[0]
    model_id = get_profile("transformers").request_model(spec)
    urls = [f"http://127.0.0.1:{r['port']}" for r in rows]
    if args.stop_test:
        try:
            res.update(stop_test(args, cfg, rows, model_id, out, t_start))
        finally:
            (out / "gpu_results.json").write_text(json.dumps(res, indent=2, default=str))
            sh(f"tail -c 200000 /tmp/fleet-gpu/servers/gpu-bench-{gpus - 1}.log > {out}/server_stopped.log 2>/dev/null")
            teardown(cfg)
        md = stop_table(res, gpus)
        print(md, flush=True)
        (out / "gpu_stop_table.md").write_text(md + "\n")
        return 0 if res["stop"].get("account", {}).get("ok") else 1

    # first request (the smoke's) vs steady state
    import httpx

    lat = []
    with httpx.Client(timeout=300) as c:
        for i in range(5):
            t = time.monotonic()
            r = c.post(f"{urls[0]}/v1/chat/completions", json={"model": model_id, "max_tokens": 32, "temperature": 0.6,
                                                               "messages": [{"role": "user", "content": f"hi {i}"}]})
            r.raise_for_status()
            lat.append(time.monotonic() - t)
    res["latency"] = {"first_request_s": [r.get("smoke_latency_s") for r in rows], "steady_32_tokens_s": lat}
    print("latency", res["latency"], flush=True)

    # size the passes from a probe with the plain client
    probe_rows = [{"messages": [{"role": "user", "content": f"probe {i}: tell me a story"}]}
                  for i in range(args.concurrency * gpus)]
    probe = asyncio.run(plain_client(urls, model_id, probe_rows, args.max_tokens, args.concurrency))
    n = max(args.concurrency * gpus * 2, int(probe["tok_s"] * args.seconds_per_pass / args.max_tokens))
    res["probe"] = probe
    print("probe", probe, "-> prompts per pass", n, flush=True)
    inp = out.parent / "gpu-bench-prompts.jsonl" if os.access(out.parent, os.W_OK) else Path("/tmp/gpu-bench-prompts.jsonl")
    prompts(n, inp)
    rows_in = [json.loads(ln) for ln in inp.read_text().splitlines()]
    # one discarded pass first: the engine's throughput climbs over its first minute (seen on the
    # H200: 680 -> 1,040 tok/s between two identical passes), which would bias whichever ran first
    warm = asyncio.run(plain_client(urls, model_id, rows_in, args.max_tokens, args.concurrency))
    res["warmup"] = warm
    print("warm-up (discarded)", warm, flush=True)
    # the `generate` action of the Prefect flow itself: bring-up adopts, the runner runs detached
    from flows.fleet import fleet

    flow_out = Path("/tmp/gpu-bench-flow-out")
    import shutil

    shutil.rmtree(flow_out, ignore_errors=True)
    t = time.monotonic()
    st = fleet(config=cfg, action="generate", input=str(inp), output=str(flow_out), return_state=True)
    flow_res = st.result(raise_on_failure=False)
    res["flow_generate"] = {"ok": st.is_completed(), "message": st.message, "seconds": time.monotonic() - t,
                            "result": flow_res if isinstance(flow_res, dict) else str(flow_res)}
    print("flow generate", res["flow_generate"], flush=True)
    passes = []
    for order in ("runner", "plain", "plain", "runner", "runner", "plain"):
        if order == "runner":
            p = runner_pass(cfg, rows, model_id, inp, Path(f"/tmp/gpu-bench-gen-{len(passes)}"))
        else:
            p = asyncio.run(plain_client(urls, model_id, rows_in, args.max_tokens, args.concurrency))
        p["kind"] = order
        passes.append(p)
        print(order, {k: v for k, v in p.items() if k != "manifest_throughput"}, flush=True)
    res["generation"] = passes
    r_tok = [p["tok_s"] for p in passes if p["kind"] == "runner"]
    p_tok = [p["tok_s"] for p in passes if p["kind"] == "plain"]
    res["ratio"] = (sum(r_tok) / len(r_tok)) / (sum(p_tok) / len(p_tok))
    sh(f"cp /tmp/fleet-gpu/servers/gpu-bench-0.log {out}/server0.log 2>/dev/null")
    teardown(cfg)

    table = [
        "| GPUs | model | bring-up from disk (all healthy) | bring-up from RAM disk (all healthy) | ready_s per server (RAM disk) "
        "| first request s | steady 32-token request s | runner tok/s | plain client tok/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {gpus} | Qwen3-shaped {res['model']['params'] / 1e9:.2f} B bf16 | "
        f"{res.get('bringup_disk', {}).get('wall_s', float('nan')):.1f} s | {res['bringup_ramdisk']['wall_s']:.1f} s | "
        f"{', '.join(str(r.get('ready_s')) for r in rows)} | "
        f"{', '.join(str(x) for x in res['latency']['first_request_s'])} | "
        f"{sorted(lat)[len(lat) // 2]:.2f} | {sum(r_tok) / len(r_tok):.0f} | {sum(p_tok) / len(p_tok):.0f} | {res['ratio']:.3f} |",
    ]
    md = "\n".join(table)
    print(md)
    (out / "gpu_table.md").write_text(md + "\n")
    (out / "gpu_results.json").write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
