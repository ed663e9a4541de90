"""Does fleet's runner keep an engine as busy as a plain client does? (issue 27) One call, every pass recorded.

On the device machine (wheels carried in .whl as bench/RESULTS.md, "Real GPUs", describes):

    python3 bench/gpu_busy.py --out "$OUT" --seconds-per-pass 35 --order R,P,B,R,P,B

Here, on CPU: `--cpu` (a tiny random model under `transformers serve --continuous-batching`)
or `--sim` (fleet's simulated server).

Servers are brought up by fleet's own launch/readiness/smoke code (no Prefect: nothing of it
runs in this process beside the clients), then a discarded warm-up pass, then the passes in
`--order`:

  R  fleet's runner (`run_local`, in this process, as bench/gpu_bench.py runs it)
  A  the same runner streaming every row in flight (`Endpoint.streamed_rows` unbounded), as it
     did on `transformers serve` before issue 27's fix (it now streams 2 rows per server)
  N  the same runner streaming no row (`streamed_rows` 0: no token progress; a control only)
  S  fleet's runner in its own process, as a job runs it (`run_job` on a JobSpec), recorded there
  P  a plain saturating aiohttp client, the bench's own body ({model, messages, max_tokens,
     temperature}), `--concurrency` workers per server
  B  the same plain client sending the runner's exact request bytes (fleet's input reader and
     `client.chat`'s body), so that B and R differ in the client alone
  T  the plain client streaming every row (B's bytes plus `stream`, `stream_options`)

Per pass, what the engine saw as well as what the client did:

- every request: its worker (the slot), when it was sent and answered, the connection pool's
  wait and new connections (aiohttp trace hooks on both clients' sessions);
- the per-slot gap: from an answer to the next request on that slot (p50 / p99 / max), and the
  share of slot-seconds left idle between the pass's first request and its last answer;
- the pass's start before its first request and its end after the last answer (the runner's
  own start and finish: store, admission, manifest, checks);
- tok/s over the wall of the pass and over the span first request .. last answer;
- CPU seconds of this process (the client) and of the engine's processes, GPU utilisation
  (nvidia-smi every 200 ms in its own process), and any other process that used CPU;
- each distinct request shape (the body's keys and every value but the messages).

Beside them, what could move the engine's own cost per token between passes: a canary (a fixed
pure-Python loop, in its own process pinned to a core of its own, timed every 0.5 s: the machine's
speed for a CPU-bound thread), the engine's garbage collections (a `sitecustomize` on its
PYTHONPATH, bench/gcwatch, counts them and their seconds) and its resident memory. `--pin` pins
the engine's threads, this process, the canary and the GPU sampler to separate cores.

Passes are sized from the warm-up pass's rate (the engine's steady rate) to `--seconds-per-pass`,
in whole waves of the slots.

Prints a markdown table and writes $OUT/busy.json and $OUT/busy_table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from gpu_bench import prompts  # noqa: E402  (the same prompts as bench/gpu_bench.py)


# ---------------------------------------------------------------------------- recording

class Recorder:
    """Every request of one pass: (slot, sent, answered, tokens), and the connection pool's events."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.reqs: list[tuple[int, float, float, int]] = []
        self.shapes: dict[str, int] = {}
        self.pool_waits = 0
        self.pool_wait_s = 0.0
        self.new_conns = 0
        self.reused = 0

    def shape(self, body: dict[str, Any]) -> None:
        key = json.dumps({k: v for k, v in body.items() if k != "messages"}, sort_keys=True)
        self.shapes[key] = self.shapes.get(key, 0) + 1

    def trace_config(self) -> Any:
        import aiohttp

        tc = aiohttp.TraceConfig()

        async def queued_start(_s: Any, ctx: Any, _p: Any) -> None:
            ctx.q0 = time.monotonic()

        async def queued_end(_s: Any, ctx: Any, _p: Any) -> None:
            self.pool_waits += 1
            self.pool_wait_s += time.monotonic() - getattr(ctx, "q0", time.monotonic())

        async def created(_s: Any, _c: Any, _p: Any) -> None:
            self.new_conns += 1

        async def reused(_s: Any, _c: Any, _p: Any) -> None:
            self.reused += 1

        tc.on_connection_queued_start.append(queued_start)
        tc.on_connection_queued_end.append(queued_end)
        tc.on_connection_create_end.append(created)
        tc.on_connection_reuseconn.append(reused)
        tc.freeze()
        return tc


REC: Recorder | None = None   # the pass being recorded


def install_runner_hooks() -> None:
    """Record the runner's requests where it sends them (dispatch's `chat`) and trace its sessions."""
    import fleet.generation.hotpath.client as client_mod
    import fleet.generation.hotpath.dispatch as dispatch_mod
    import fleet.generation.hotpath.health as health_mod

    chat, new_session = client_mod.chat, client_mod.new_session

    async def recorded_chat(session: Any, url: str, model: str, request: Any, *a: Any, **kw: Any) -> Any:
        rec = REC
        t = time.monotonic()
        out = await chat(session, url, model, request, *a, **kw)
        if rec is not None:
            rec.reqs.append((id(asyncio.current_task()), t, time.monotonic(), out.completion_tokens or 0))
            streamed = (a[3] if len(a) > 3 else kw.get("on_chunk")) is not None
            rec.shape({"model": model, "messages": None, **(request.params or {}),
                       **({"stream": True, "stream_options": {"include_usage": True}} if streamed else {})})
        return out

    def traced_session(concurrency: int, *, api_key: str | None = None) -> Any:
        s = new_session(concurrency, api_key=api_key)
        if REC is not None:
            s._trace_configs.append(REC.trace_config())   # bench-only: the runner's own session, traced
        return s

    dispatch_mod.chat = recorded_chat          # type: ignore[assignment]
    health_mod.new_session = traced_session    # type: ignore[assignment]


# ---------------------------------------------------------------------------- the machine's view

def cpu_of(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
        for q in procs:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def engine_threads(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each thread of the engine's processes (its scheduler thread, its HTTP loop)."""
    import psutil

    out: dict[int, float] = {}
    for pid in pids:
        try:
            for t in psutil.Process(pid).threads():
                out[t.id] = t.user_time + t.system_time
        except psutil.Error:
            pass
    return out


def engine_switches(pids: list[int]) -> tuple[int, int]:
    import psutil

    vol = inv = 0
    for pid in pids:
        try:
            c = psutil.Process(pid).num_ctx_switches()
            vol, inv = vol + c.voluntary, inv + c.involuntary
        except psutil.Error:
            pass
    return vol, inv


def machine_cpu() -> Any:
    import psutil

    return psutil.cpu_times()


def cpu_table() -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:120]
            out[p.info["pid"]] = (cmd, t.user + t.system)
        except (TypeError, AttributeError):
            continue
    return out


GPU_SAMPLER = r"""
import sys, time, pynvml
pynvml.nvmlInit()
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
with open(sys.argv[1], "w", buffering=1) as f:
    while True:
        t = time.time()
        f.write(" ".join([f"{t:.3f}"] + [str(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in hs]) + "\n")
        time.sleep(0.2)
"""


CANARY = r"""
import os, sys, time
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})
def work():
    x = 0
    for i in range(200_000):
        x += i * i
    return x
with open(sys.argv[1], "w", buffering=1) as f:
    while True:
        c, w = time.thread_time(), time.perf_counter()
        work()
        f.write(f"{time.time():.3f} {1e3 * (time.thread_time() - c):.3f} {1e3 * (time.perf_counter() - w):.3f}\n")
        time.sleep(0.5)
"""


def canary_ms(path: Path, t_from: float, t_to: float) -> dict[str, float] | None:
    """The canary's CPU ms per loop (median, max) in [t_from, t_to]: the same work every time, so
    a larger number is a slower core for a CPU-bound Python thread (host load, clock)."""
    try:
        rows = [ln.split() for ln in path.read_text().splitlines()]
    except OSError:
        return None
    cpu = [float(r[1]) for r in rows if len(r) == 3 and t_from <= float(r[0]) <= t_to]
    return {"median": round(statistics.median(cpu), 2), "max": round(max(cpu), 2)} if cpu else None


def gc_of(where: Path, pids: list[int]) -> dict[str, Any]:
    """The engine's garbage collections so far (bench/gcwatch): counts and seconds per generation."""
    counts, secs = [0, 0, 0], [0.0, 0.0, 0.0]
    for pid in pids:
        try:
            d = json.loads((where / f"gc-{pid}.json").read_text())
        except (OSError, ValueError):
            continue
        counts = [a + b for a, b in zip(counts, d["counts"])]
        secs = [a + b for a, b in zip(secs, d["secs"])]
    return {"counts": counts, "secs": secs}


def rss_mib(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def pin(pids: list[int], cores: set[int]) -> None:
    """Every thread of these processes (and their children) onto `cores`."""
    import psutil

    for pid in pids:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                for t in p.threads():
                    os.sched_setaffinity(t.id, cores)
            except (psutil.Error, OSError):
                pass


def gpu_util(path: Path, t_from: float, t_to: float) -> float | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    vals = []
    for ln in lines:
        parts = ln.split()
        if len(parts) >= 2 and t_from <= float(parts[0]) <= t_to:
            vals.append(statistics.fmean(float(x) for x in parts[1:]))
    return round(statistics.fmean(vals), 1) if vals else None


# ---------------------------------------------------------------------------- the clients

def usage_of_stream(raw: bytes) -> int:
    """completion_tokens of a streamed answer's usage event (the last one that has usage)."""
    for line in reversed(raw.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or {}
            if usage.get("completion_tokens"):
                return int(usage["completion_tokens"])
    return 0


async def plain_pass(urls: list[str], bodies: list[bytes], concurrency: int, rec: Recorder) -> None:
    """A saturating aiohttp client: `concurrency` workers per server, one queue, bodies sent as
    given (a body with `"stream": true` is read to its end and its usage event counted)."""
    import aiohttp

    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        me = id(asyncio.current_task())
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t = time.monotonic()
            async with session.post(f"{url}/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                raw = await resp.read()
            if resp.status != 200:
                tokens = 0
            elif raw.startswith(b"data:"):
                tokens = usage_of_stream(raw)
            else:
                tokens = (json.loads(raw).get("usage") or {}).get("completion_tokens") or 0
            rec.reqs.append((me, t, time.monotonic(), tokens))

    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                      timeout=aiohttp.ClientTimeout(total=1800),
                                      trace_configs=[rec.trace_config()]) for _ in urls]
    try:
        await asyncio.gather(*[worker(s, u) for s, u in zip(sessions, urls) for _ in range(concurrency)])
    finally:
        for s in sessions:
            await s.close()


def plain_bodies(rows: list[dict[str, Any]], model: str, max_tokens: int, rec: Recorder) -> list[bytes]:
    out = []
    for r in rows:
        body = {"model": model, "messages": r["messages"], "max_tokens": max_tokens, "temperature": 0.6}
        rec.shape(body)
        out.append(json.dumps(body).encode())
    return out


def runner_bodies(cfg: Any, inp: Path, model: str, rec: Recorder, stream: bool = False) -> list[bytes]:
    """The bytes fleet's runner sends for each row: its input reader, then `client.chat`'s body
    (`stream`: as `client.chat` sends a streamed one)."""
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.jsonl import dumps
    from fleet.generation.data.rows import Request

    out = []
    for req in iter_input(str(inp), cfg.generation):
        if isinstance(req, Request):
            body = {"model": model, "messages": req.messages, **(req.params or {})}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            rec.shape(body)
            out.append(dumps(body))
    return out


def runner_child(job_file: str, rec_file: str) -> int:
    """Kind S: the runner in its own process, as a job runs it (`run_job` on a JobSpec), recorded."""
    global REC
    from fleet.generation.job.jobspec import JobSpec
    from fleet.generation.job.runner import run_job

    install_runner_hooks()
    REC = Recorder()
    rc = asyncio.run(run_job(JobSpec.load(job_file), install_signals=False, console=False))
    Path(rec_file).write_text(json.dumps({"reqs": REC.reqs, "shapes": REC.shapes, "pool_waits": REC.pool_waits,
                                          "pool_wait_s": REC.pool_wait_s, "new_conns": REC.new_conns,
                                          "reused": REC.reused}))
    return rc


def runner_process(cfg: Any, entries: list[Any], inp: Path, out: Path, rec: Recorder) -> int:
    from fleet.generation.job.jobspec import JobSpec

    shutil.rmtree(out, ignore_errors=True)
    job = JobSpec(config=cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), input=str(inp),
                  output=str(out), servers=entries, retry_errors=False, relaunch=False)
    job_file, rec_file = Path(f"{out}.job.json"), Path(f"{out}.rec.json")
    job_file.write_text(json.dumps(job.to_dict()))
    rc = subprocess.run([sys.executable, __file__, "--child-runner", str(job_file), str(rec_file)]).returncode
    d = json.loads(rec_file.read_text())
    rec.reqs = [tuple(r) for r in d["reqs"]]  # type: ignore[misc]
    rec.shapes, rec.pool_waits, rec.pool_wait_s = d["shapes"], d["pool_waits"], d["pool_wait_s"]
    rec.new_conns, rec.reused = d["new_conns"], d["reused"]
    return rc


def runner_run(cfg: Any, entries: list[Any], inp: Path, out: Path, streamed_rows: int | None = None) -> int:
    """`streamed_rows`: the rows streamed at a time per server instead of the runner's own (kind A:
    every row, as the runner did before issue 27's fix; kind N: none)."""
    import fleet.generation.job.runner as runner_mod

    endpoints = runner_mod._endpoints

    def all_streamed(es: list[Any], stream: bool = False) -> list[Any]:
        eps = endpoints(es, stream)
        for ep in eps:
            ep.streamed_rows = streamed_rows
        return eps

    shutil.rmtree(out, ignore_errors=True)   # a fresh job each pass, not a resume
    runner_mod._endpoints = endpoints if streamed_rows is None else all_streamed   # type: ignore[assignment]
    try:
        return runner_mod.run_local(cfg, inp, out, entries, relaunch=False, console=False)
    finally:
        runner_mod._endpoints = endpoints   # type: ignore[assignment]


# ---------------------------------------------------------------------------- one pass

def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rec: Recorder, t_call: float, t_ret: float, k_total: int) -> dict[str, Any]:
    reqs = sorted(rec.reqs, key=lambda r: r[1])
    first = min(r[1] for r in reqs)
    last = max(r[2] for r in reqs)
    span = last - first
    tokens = sum(r[3] for r in reqs)
    by_slot: dict[int, list[tuple[int, float, float, int]]] = {}
    for r in reqs:
        by_slot.setdefault(r[0], []).append(r)
    gaps = []
    for rs in by_slot.values():
        rs.sort(key=lambda r: r[1])
        gaps += [b[1] - a[2] for a, b in zip(rs, rs[1:])]
    busy = sum(r[2] - r[1] for r in reqs)
    ends = sorted(r[2] for r in reqs)
    # the engine answers in waves (every row runs to max_tokens): when each k-th row was done
    waves = [round(ends[i] - first, 2) for i in range(k_total - 1, len(ends), k_total)]
    # the engine answers a wave's rows in one step when they run in lockstep: completions in
    # bursts; rows out of step finish (and are refilled) in many small groups
    def bursts(ts: list[float]) -> list[int]:
        sizes, n = [], 1
        for a, b in zip(ts, ts[1:]):
            if b - a > 0.05:
                sizes.append(n)
                n = 0
            n += 1
        return sizes + [n]

    # slot-seconds idle while rows were still waiting: the gaps (each slot's own), over K x span
    return {
        "answer_bursts": bursts(ends), "send_bursts": bursts(sorted(r[1] for r in reqs)),
        "raw": [(round(r[1] - first, 4), round(r[2] - first, 4)) for r in reqs],
        "requests": len(reqs), "slots": len(by_slot), "tokens": tokens,
        "wall_s": round(t_ret - t_call, 2), "start_s": round(first - t_call, 3), "end_s": round(t_ret - last, 3),
        "span_s": round(span, 2), "tok_s_wall": round(tokens / (t_ret - t_call), 1),
        "rows_s_wall": round(len(reqs) / (t_ret - t_call), 2),   # not from usage: a streamed answer's may differ
        "tok_s_span": round(tokens / span, 1) if span > 0 else 0.0,
        "mean_in_flight": round(busy / span, 2) if span > 0 else 0.0,
        "gap_ms": {"n": len(gaps), "p50": round(1e3 * pct(gaps, 0.5), 2), "p90": round(1e3 * pct(gaps, 0.9), 2),
                   "p99": round(1e3 * pct(gaps, 0.99), 2), "max": round(1e3 * max(gaps, default=0.0), 2),
                   "sum_s": round(sum(gaps), 3)},
        "idle_share": round(sum(gaps) / (k_total * span), 4) if span > 0 else None,
        "first_answer_s": round(min(r[2] for r in reqs) - t_call, 2), "waves_done_at_s": waves,
        "pool_waits": rec.pool_waits, "pool_wait_s": round(rec.pool_wait_s, 3), "new_conns": rec.new_conns,
        "reused_conns": rec.reused, "shapes": rec.shapes,
        "row_tokens": [min(r[3] for r in reqs), max(r[3] for r in reqs)],   # fixed-length rows: equal
    }


def one_pass(kind: str, ctx: dict[str, Any], n: int) -> dict[str, Any]:
    global REC
    rec = Recorder()
    engine_pids = ctx["engine_pids"]
    before_all = cpu_table()
    import resource

    eng0, me0 = cpu_of(engine_pids), time.process_time()
    ch0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    th0, sw0, m0 = engine_threads(engine_pids), engine_switches(engine_pids), machine_cpu()
    gc0 = gc_of(ctx["gc_dir"], engine_pids)
    if kind in ("R", "A", "N"):
        REC = rec
        t_call = time.monotonic()
        w0 = time.time()
        rc = runner_run(ctx["cfg"], ctx["entries"], ctx["inp"], Path(f"/tmp/gpu-busy-out-{n}"),
                        streamed_rows={"A": 10**6, "N": 0}.get(kind))
        t_ret = time.monotonic()
        REC = None
    elif kind == "S":
        t_call = time.monotonic()
        w0 = time.time()
        rc = runner_process(ctx["cfg"], ctx["entries"], ctx["inp"], Path(f"/tmp/gpu-busy-out-{n}"), rec)
        t_ret = time.monotonic()
    else:
        bodies = (plain_bodies(ctx["rows"], ctx["model"], ctx["max_tokens"], rec) if kind in ("P", "W")
                  else runner_bodies(ctx["cfg"], ctx["inp"], ctx["model"], rec, stream=kind == "T"))
        t_call = time.monotonic()
        w0 = time.time()
        asyncio.run(plain_pass(ctx["urls"], bodies, ctx["concurrency"], rec))
        t_ret = time.monotonic()
        rc = 0
    w1 = time.time()
    eng1, me1 = cpu_of(engine_pids), time.process_time()
    ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if kind == "S":   # the runner's own process (waited for, so counted in RUSAGE_CHILDREN)
        me1 = me0 + (ch1.ru_utime + ch1.ru_stime) - (ch0.ru_utime + ch0.ru_stime)
    th1, sw1, m1 = engine_threads(engine_pids), engine_switches(engine_pids), machine_cpu()
    gc1 = gc_of(ctx["gc_dir"], engine_pids)
    after_all = cpu_table()
    res = summarize(rec, t_call, t_ret, ctx["concurrency"] * len(ctx["urls"]))
    wall = t_ret - t_call
    others = sorted(((after_all[p][1] - before_all[p][1], after_all[p][0]) for p in after_all
                     if p in before_all and p != os.getpid() and p not in ctx["engine_tree"]), reverse=True)[:3]
    res.update(kind=kind, rc=rc, client_cpu_s=round(me1 - me0, 2), engine_cpu_s=round(eng1 - eng0, 2),
               engine_cpu_share=round((eng1 - eng0) / wall, 2), gpu_util=gpu_util(ctx["gpu_log"], w0, w1),
               others=[(round(c, 2), cmd) for c, cmd in others if c >= 0.2],
               canary_ms=canary_ms(ctx["canary_log"], w0, w1),
               engine_gc={"counts": [b - a for a, b in zip(gc0["counts"], gc1["counts"])],
                          "secs": [round(b - a, 3) for a, b in zip(gc0["secs"], gc1["secs"])]},
               engine_rss_mib=rss_mib(engine_pids), streamed=sum(v for k, v in rec.shapes.items() if '"stream"' in k),
               engine_threads_cpu_s=sorted((round(th1[t] - th0.get(t, 0.0), 2) for t in th1), reverse=True)[:4],
               engine_ctx_switches={"voluntary": sw1[0] - sw0[0], "involuntary": sw1[1] - sw0[1]},
               machine={"busy_cores": round((sum(m1) - m1.idle - getattr(m1, "iowait", 0.0)
                                             - sum(m0) + m0.idle + getattr(m0, "iowait", 0.0)) / wall, 2),
                        "steal_cores": round((getattr(m1, "steal", 0.0) - getattr(m0, "steal", 0.0)) / wall, 3)})
    return res


# ---------------------------------------------------------------------------- bring-up, main

def make_cfg(args: argparse.Namespace, model: Path, gpus: int, port: int) -> Any:
    from fleet.config import FleetConfig

    engine: dict[str, Any] = ({"kind": "sim", "sim": {"tokens_per_s": args.sim_tokens_per_s}} if args.sim else
                              {"kind": "transformers", "device": "cpu" if args.cpu else "cuda",
                               "continuous_batching": True, "mem_fraction_static": args.mem_fraction})
    return FleetConfig(
        name="gpu-busy", nodes=[{"name": "local", "workdir": "/tmp/fleet-busy"}], engine=engine,
        model={"source": str(model), "stage": False},
        venv={"path": sys.prefix, "use_existing": True},
        servers={"count": gpus, "base_port": port, "ready_timeout_s": 600, "stop_grace_s": 10},
        smoke={"first_timeout_s": 300, "timeout_s": 120, "attempts": 3, "max_tokens": 32},
        generation={"max_tokens": args.max_tokens, "temperature": 0.6,
                    "max_concurrency_per_server": args.concurrency},
    )


def bring_up(cfg: Any, gpus: int) -> tuple[list[Any], list[dict[str, Any]]]:
    from fleet.engines import get_profile
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, stop_servers, wait_ready
    from fleet.smoke import smoke

    node = LocalNode()
    stop_servers(node, cfg, cfg.nodes[0])
    specs = plan_servers(cfg, cfg.nodes[0], list(range(gpus)), model_path=cfg.model.source, python=sys.executable)
    up = []
    for spec in specs:
        t = time.monotonic()
        res = launch(node, cfg, spec)
        ready = wait_ready(node, cfg, spec, res.pid)
        model = get_profile(cfg.engine.kind).request_model(spec)
        sm = smoke(ready.url, model, cfg.smoke, temperature=cfg.generation.temperature)
        up.append({"index": spec.index, "url": ready.url, "pid": res.pid, "model": model, "gpus": list(spec.gpus),
                   "ready_s": round(time.monotonic() - t, 1), "smoke_s": sm.latency_s})
        print("up", up[-1], flush=True)
    return specs, up


def neighbour_ratio(passes: list[dict[str, Any]], i: int, metric: str, side: str = "both") -> float | None:
    """Pass i over the nearest plain (P) pass of the same size before it (`side` "before"), after
    it ("after"), or the mean of the two ("both")."""
    size = passes[i]["size"]
    before = [p for p in passes[:i] if p["kind"] == "P" and p["size"] == size][-1:]
    after = [p for p in passes[i + 1:] if p["kind"] == "P" and p["size"] == size][:1]
    near = [p[metric] for p in {"before": before, "after": after, "both": before + after}[side]]
    return round(passes[i][metric] / statistics.fmean(near), 3) if near else None


def row(i: int, p: dict[str, Any], passes: list[dict[str, Any]]) -> str:
    g = p["gap_ms"]
    adj = ("" if p["kind"] == "P" else
           " / ".join(str(neighbour_ratio(passes, i, "tok_s_wall", side)) for side in ("before", "after", "both")))
    per_k = round(1000 * p["engine_threads_cpu_s"][0] / p["tokens"], 3) if p["engine_threads_cpu_s"] else None
    # the engine (transformers serve) is one CPU-bound thread: tok/s = its busy share / its CPU per token,
    # so this share says whether the client kept it busy whatever that cost was in this pass
    busy = round(p["engine_threads_cpu_s"][0] / p["span_s"], 2) if p["engine_threads_cpu_s"] else None
    can = p.get("canary_ms") or {}
    gc = p.get("engine_gc") or {"counts": [0, 0, 0], "secs": [0, 0, 0]}
    return (f"| {i} | {p['kind']}{'+' if p['size'] == 'long' else ''} | {p['rows']} | {p['wall_s']} | "
            f"{p['start_s']} / {p['end_s']} | {p['tok_s_wall']:.0f} | {p['tok_s_span']:.0f} | {p['rows_s_wall']} | {adj} | "
            f"{p['mean_in_flight']} | {g['p50']} / {g['p99']} / {g['max']} | {p['pool_waits']} / {p['new_conns']} | "
            f"{p.get('streamed', 0)} | {p['client_cpu_s']} | {per_k} | {busy} | {p['gpu_util']} | "
            f"{can.get('median')} / {can.get('max')} | {sum(gc['counts'])} ({gc['counts'][2]}) / "
            f"{round(sum(gc['secs']), 2)} | {p.get('engine_rss_mib')} | {p.get('row_tokens')} |")


def table(passes: list[dict[str, Any]]) -> str:
    lines = ["| pass | kind | rows | wall s | start / end s | tok/s wall | tok/s span | rows/s wall | "
             "÷ P before / after / their mean (tok/s wall) | mean in flight | slot gap p50 / p99 / max ms | "
             "pool waits / new conns | streamed requests | client CPU s | engine busiest thread s per 1k tok | "
             "engine thread busy / span | GPU util % | canary CPU ms median / max | engine GCs (gen 2) / s | "
             "engine RSS MiB | tokens per row min, max |",
             "| --- " * 21 + "|"]
    lines += [row(i, p, passes) for i, p in enumerate(passes)]
    for size in ("short", "long"):
        for metric in ("tok_s_wall", "tok_s_span"):
            by: dict[str, list[float]] = {}
            for p in passes:
                if p["size"] == size:
                    by.setdefault(p["kind"], []).append(p[metric])
            if by.get("P"):
                q = statistics.fmean(by["P"])
                parts = [f"{k} {statistics.fmean(v):.0f} ({k} / P {statistics.fmean(v) / q:.3f})"
                         for k, v in sorted(by.items()) if k != "P"]
                lines.append(f"\n{size} passes, {metric}: P {q:.0f}; " + "; ".join(parts))
    for kind in ("R", "A", "N", "S", "B", "T"):
        adj = [r for i, p in enumerate(passes) if p["kind"] == kind
               for r in (neighbour_ratio(passes, i, "tok_s_wall", "before"),
                         neighbour_ratio(passes, i, "tok_s_wall", "after")) if r is not None]
        if adj:
            lines.append(f"\n{kind} ÷ each adjacent P (tok/s wall): min {min(adj)}, max {max(adj)}, "
                         f"{sum(r >= 0.97 for r in adj)} of {len(adj)} at ≥ 0.97")
    shapes: dict[str, set[str]] = {}
    for p in passes:
        for sh in p["shapes"]:
            shapes.setdefault(p["kind"], set()).add(sh)
    lines.append("\nrequest shapes (body without messages): " +
                 "; ".join(f"{k}: {sorted(v)}" for k, v in sorted(shapes.items())))
    return "\n".join(lines)


def write_inputs(args: argparse.Namespace, k: int, tok_s: float) -> dict[str, tuple[Path, list[Any], int]]:
    """The passes' prompts, sized from a rate to --seconds-per-pass (and the long passes' size),
    in whole waves of k rows: a pass that ends on a partial wave adds noise to its tok/s."""
    inputs = {}
    for tag, secs in {"": args.seconds_per_pass, "+": args.long_seconds_per_pass}.items():
        n = args.rows or max(2 * k, k * round(tok_s * secs / args.max_tokens / k))
        inp = Path(f"/tmp/gpu-busy-prompts{'-long' if tag else ''}.jsonl")
        prompts(n, inp)
        inputs[tag] = (inp, [json.loads(ln) for ln in inp.read_text().splitlines()], n)
    return inputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-busy-out"))
    ap.add_argument("--params-b", type=float, default=1.7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds-per-pass", type=float, default=35.0)
    ap.add_argument("--long-seconds-per-pass", type=float, default=120.0,
                    help="the size of the passes marked + in --order (e.g. R+,P+)")
    ap.add_argument("--rows", type=int, default=0, help="rows per pass (default: sized from a probe)")
    ap.add_argument("--order", default="R,P,B,R,P,B")
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="here: a tiny model under transformers serve on CPU")
    ap.add_argument("--sim", action="store_true", help="here: fleet's sim")
    ap.add_argument("--sim-tokens-per-s", type=float, default=200.0)
    ap.add_argument("--budget-s", type=float, default=540.0, help="no pass starts after this many seconds")
    ap.add_argument("--deadline-s", type=float, default=1e9,
                    help="a pass starts only if it would end before this many seconds at 0.8x the best rate yet")
    ap.add_argument("--pin", action="store_true",
                    help="engine threads on the first half of the cores, this process, the GPU sampler and "
                         "the canary each on cores of their own")
    ap.add_argument("--child-runner", nargs=2, metavar=("JOB", "REC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_runner:
        return runner_child(*args.child_runner)
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = args.gpus or (1 if args.cpu or args.sim else len(
        [ln for ln in subprocess.run("nvidia-smi -L", shell=True, capture_output=True, text=True).stdout.splitlines()
         if ln.startswith("GPU")]) or 1)
    if args.sim:
        model = Path("/dev/shm/sim-model")
    else:
        from fleet.tinymodel import build_tiny_model, qwen3_shape

        shape = {} if args.cpu else qwen3_shape(args.params_b)
        where = Path("/tmp/fleet-models/tiny-cpu" if args.cpu else "/root/fleet-models/qwen3-random")
        model = build_tiny_model(where, device="cpu" if args.cpu else "cuda", **shape)
    from fleet.demo import free_port_block
    from fleet.generation.job.runner import ServerEntry

    cfg = make_cfg(args, model, gpus, free_port_block(gpus, start=31000))
    gpu_log, canary_log, gc_dir = out / "gpu_util.txt", out / "canary.txt", Path("/tmp/gpu-busy-gcwatch")
    shutil.rmtree(gc_dir, ignore_errors=True)
    gc_dir.mkdir(parents=True)
    os.environ["FLEET_GCWATCH_DIR"] = str(gc_dir)   # the engine inherits it (bench/gcwatch)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "gcwatch"), os.environ.get("PYTHONPATH", "")])
    ncpu = os.cpu_count() or 1
    helpers = [subprocess.Popen([sys.executable, "-c", CANARY, str(canary_log),
                                 *([str(ncpu - 1)] if args.pin else [])])]
    if not (args.cpu or args.sim):
        helpers.append(subprocess.Popen([sys.executable, "-c", GPU_SAMPLER, str(gpu_log)]))
    install_runner_hooks()
    res: dict[str, Any] = {"args": vars(args)}
    try:
        specs, up = bring_up(cfg, gpus)
        res["servers"] = up
        import psutil

        engine_pids = [u["pid"] for u in up]
        tree = set(engine_pids)
        for pid in engine_pids:
            try:
                tree |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                pass
        if args.pin:   # engine: first half; this process: the next quarter; sampler, canary: one each
            pin(sorted(tree), set(range(ncpu // 2)))
            os.sched_setaffinity(0, set(range(ncpu // 2, ncpu // 2 + ncpu // 4)))
            pin([h.pid for h in helpers[1:]], {ncpu - 2})
            res["pinned"] = {"engine": f"0-{ncpu // 2 - 1}", "client": f"{ncpu // 2}-{ncpu // 2 + ncpu // 4 - 1}",
                             "sampler": ncpu - 2, "canary": ncpu - 1}
        entries = [ServerEntry(node=s.node, index=s.index, url=u["url"], model=u["model"], gpus=list(s.gpus))
                   for s, u in zip(specs, up)]
        urls = [u["url"] for u in up]
        model_id = up[0]["model"]
        k = args.concurrency * gpus
        probe_rows = [{"messages": [{"role": "user", "content": f"probe {i}: tell me a story"}]} for i in range(k)]
        ctx: dict[str, Any] = {"cfg": cfg, "entries": entries, "urls": urls, "model": model_id,
                               "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                               "engine_pids": engine_pids, "engine_tree": tree, "gpu_log": gpu_log,
                               "canary_log": canary_log, "gc_dir": gc_dir, "rows": probe_rows}
        probe = one_pass("W", ctx, -1)
        inputs = write_inputs(args, k, probe["tok_s_wall"])
        ctx.update(inp=inputs[""][0], rows=inputs[""][1])
        warm = one_pass("W", ctx, -2)   # discarded: the engine speeds up over its first minute
        inputs = write_inputs(args, k, warm["tok_s_wall"])   # sized from the steady rate
        res.update(probe=probe, warmup=warm, rows_per_pass={t: v[2] for t, v in inputs.items()})
        print("probe", probe["tok_s_wall"], "warm-up", warm["tok_s_wall"], "rows per pass", res["rows_per_pass"],
              flush=True)
        passes: list[dict[str, Any]] = []
        res["passes"] = passes
        for i, item in enumerate(args.order.split(",")):
            if time.monotonic() - t_start > args.budget_s:
                print("budget reached: passes stop here", flush=True)
                break
            kind, tag = item.rstrip("+"), "+" if item.endswith("+") else ""
            rate = max([warm["tok_s_wall"], *(p["tok_s_wall"] for p in passes)])   # the warm-up may be slow
            planned = inputs[tag][2] * args.max_tokens / max(1.0, rate)
            if time.monotonic() - t_start + planned / 0.8 > args.deadline_s:
                print(f"a {planned:.0f}-s pass might not end before the deadline: it is skipped", flush=True)
                continue
            ctx.update(inp=inputs[tag][0], rows=inputs[tag][1])
            p = one_pass(kind, ctx, i)
            p["size"] = "long" if tag else "short"
            p["rows"] = inputs[tag][2]
            passes.append(p)
            (out / "busy.json").write_text(json.dumps(res, indent=1, default=str))   # what a killed call keeps
            print(kind, p["size"], {x: p[x] for x in ("wall_s", "start_s", "end_s", "tok_s_wall", "tok_s_span",
                                                      "mean_in_flight", "gap_ms", "idle_share", "pool_waits",
                                                      "new_conns", "client_cpu_s", "engine_cpu_share",
                                                      "engine_threads_cpu_s", "machine", "gpu_util",
                                                      "waves_done_at_s", "others", "canary_ms", "engine_gc",
                                                      "engine_rss_mib", "streamed", "row_tokens")},
                  "answer bursts", len(p["answer_bursts"]), max(p["answer_bursts"]), "send bursts",
                  len(p["send_bursts"]), max(p["send_bursts"]), flush=True)
        res["passes"] = passes
    finally:
        (out / "busy.json").write_text(json.dumps(res, indent=1, default=str))
        from fleet.node import LocalNode
        from fleet.servers import server_paths, stop_servers

        for i in range(gpus):
            shutil.copy(server_paths(cfg.nodes[0].workdir, cfg.name, i).log, out / f"server{i}.log") \
                if Path(server_paths(cfg.nodes[0].workdir, cfg.name, i).log).exists() else None
        stop_servers(LocalNode(), cfg, cfg.nodes[0])
        for h in helpers:
            h.kill()
    md = table(res["passes"])
    print(md, flush=True)
    (out / "busy_table.md").write_text(md + "\n")
    (out / "busy.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
