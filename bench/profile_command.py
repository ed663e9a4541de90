"""Where a flow command's CPU goes: `fleet ARGS` run in this process under an all-thread sampler.

    .venv/bin/python bench/profile_command.py up -c FILE [--top 25]

Every 4 ms each thread's CPU time (/proc/self/task/<tid>/stat) is read and the CPU it used since
the last look is charged to the stack it is in now, so idle threads cost nothing and waits are
not counted. Prints the CPU per category (imports, TLS contexts, Prefect's flow and task
engines, fleet's own task bodies, artifact writes, the rest), the TLS contexts built and the
HTTP requests sent (by method and path), and the functions with the most CPU (inclusive).
The sampler's own thread is left out; its cost inflates the total by a few per cent.
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import ssl
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EVERY_S = 0.004
TICK = os.sysconf("SC_CLK_TCK")
stacks: collections.defaultdict[tuple[str, ...], float] = collections.defaultdict(float)
contexts: collections.Counter[str] = collections.Counter()
requests: collections.Counter[str] = collections.Counter()
done = threading.Event()


def thread_cpu(tid: int) -> float | None:
    try:
        f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / TICK


def sample() -> None:
    me, last = threading.get_native_id(), dict[int, float]()
    while not done.wait(EVERY_S):
        frames = sys._current_frames()
        for t in threading.enumerate():
            frame = frames.get(t.ident or -1)
            if frame is None or t.native_id in (None, me):
                continue
            cpu = thread_cpu(t.native_id)
            if cpu is None:
                continue
            used, last[t.native_id] = cpu - last.get(t.native_id, cpu), cpu
            if used > 0:
                stacks[tuple(f"{fs.filename}:{fs.name}" for fs in traceback.extract_stack(frame))] += used


def category(stack: tuple[str, ...]) -> str:
    text = " ".join(stack)
    if "_find_and_load" in text:
        return "imports (Prefect's and fleet's, at start and on first use)"
    if "create_default_context" in text:
        return "TLS contexts (CA bundle loads)"
    if "tasks/audit.py" in text or "artifacts.py" in text:
        return "artifact writes"
    if "task_engine.py" in text and "tasks/" in text:
        return "fleet's own task bodies (adopt checks, smoke, SSH/local node)"
    if "task_engine.py" in text:
        return "Prefect's task engine (task runs, states, events)"
    if "flow_engine.py" in text:
        return "Prefect's flow engine (flow run, states, hooks, the flow body's own code)"
    if "settings" in text:
        return "settings (Prefect's and the config's pydantic-settings: load, refresh)"
    return "other (CLI, config, process exit, background workers)"


def count_tls() -> None:
    real = ssl.create_default_context

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        caller = [f"{Path(fs.filename).name}:{fs.name}" for fs in traceback.extract_stack()[:-1]
                  if "ssl" not in fs.filename and "httpx/_config" not in fs.filename]
        contexts[" < ".join(reversed(caller[-3:]))] += 1
        return real(*args, **kwargs)

    ssl.create_default_context = counting


def count_requests() -> None:
    import httpx

    sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

    def key(req: httpx.Request) -> str:
        return f"{req.method} {re.sub(r'[0-9a-f-]{36}', 'ID', req.url.path)}"

    def send(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        requests[key(request)] += 1
        return sync_send(self, request, *args, **kwargs)

    async def asend(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        requests[key(request)] += 1
        return await async_send(self, request, *args, **kwargs)

    httpx.Client.send, httpx.AsyncClient.send = send, asend  # type: ignore[method-assign]


def report(top: int, t0: float, c0: float) -> None:
    done.set()
    total = sum(stacks.values())
    out = sys.stderr
    print(f"\nwall {time.monotonic() - t0:.2f} s, process CPU {time.process_time() - c0:.2f} s, sampled "
          f"{total:.2f} s, load {os.getloadavg()[0]:.1f}", file=out)
    cats: collections.defaultdict[str, float] = collections.defaultdict(float)
    incl: collections.defaultdict[str, float] = collections.defaultdict(float)
    for st, cpu in stacks.items():
        cats[category(st)] += cpu
        for fn in set(st):
            incl[fn.replace(str(ROOT) + "/", "").split("site-packages/")[-1]] += cpu
    for name, cpu in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"  {cpu:5.2f} s  {100 * cpu / total:3.0f} %  {name}", file=out)
    print(f"TLS contexts built: {sum(contexts.values())}", file=out)
    for where, n in contexts.most_common():
        print(f"  {n:3d}  {where}", file=out)
    print(f"HTTP requests: {sum(requests.values())}", file=out)
    for what, n in requests.most_common():
        print(f"  {n:3d}  {what}", file=out)
    print(f"top {top} functions (inclusive CPU s):", file=out)
    for fn, cpu in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {cpu:5.2f}  {fn}", file=out)


def main() -> None:
    args = sys.argv[1:]
    top = 25
    if "--top" in args:
        i = args.index("--top")
        top, args = int(args[i + 1]), args[:i] + args[i + 2:]
    t0, c0 = time.monotonic(), time.process_time()
    count_tls()
    count_requests()
    threading.Thread(target=sample, name="sampler", daemon=True).start()
    atexit.register(report, top, t0, c0)  # registered first: runs after Prefect's own exit work
    import flows.cli

    sys.exit(flows.cli.main(args))


if __name__ == "__main__":
    main()
