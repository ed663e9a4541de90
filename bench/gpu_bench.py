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

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal tokens, done
        while True:
            try:
                r = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {"model": model, "messages": r["messages"], "max_tokens": max_tokens, "temperature": 0.6}
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                data = await resp.json(content_type=None)
            if resp.status == 200:
                tokens += data["usage"]["completion_tokens"]
                done += 1

    t0 = time.monotonic()
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                      timeout=aiohttp.ClientTimeout(total=1800)) for _ in urls]
    try:
        await asyncio.gather(*[worker(s, u) for s, u in zip(sessions, urls) for _ in range(concurrency)])
    finally:
        for s in sessions:
            await s.close()
    wall = time.monotonic() - t0
    return {"rows": done, "completion_tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


def runner_pass(cfg: Any, rows_up: list[dict[str, Any]], model: str, inp: Path, out: Path) -> dict[str, Any]:
    from fleet.generation.runner import ServerEntry, run_local

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
    return {"rc": rc, "seconds": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
            "manifest_throughput": manifest.get("throughput")}


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
            spec = plan_servers(cfg, cfg.nodes[0], list(range(n)), model_path=f"/dev/shm/{model.name}",
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
    args = ap.parse_args()
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

    spec = plan_servers(cfg, cfg.nodes[0], list(range(gpus)), model_path=f"/dev/shm/{model.name}",
                        python=sys.executable)[0]
    model_id = get_profile("transformers").request_model(spec)
    urls = [f"http://127.0.0.1:{r['port']}" for r in rows]

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
