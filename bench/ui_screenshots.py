"""Screenshots of the Prefect UI showing fleet's runs, for the README (docs/img/*.png).

    .venv/bin/python bench/ui_screenshots.py [--out docs/img] [--keep-server]

What it does, all on this machine and offline:
1. starts `prefect server start` (SQLite in a temp PREFECT_HOME, a free port) and waits
   for /api/health;
2. runs the `fleet` flow against it with the sim engine (4 simulated SGLang servers):
   a bring-up, then kills one server's process group and runs `revalidate` (which ends
   Failed naming it), then a teardown; and writes a throughput chart artifact from
   labelled sample numbers (tasks/charts.py; there is no generation run to measure here);
3. drives headless Chromium over the DevTools protocol (no npm: `websockets` comes with
   Prefect) to open the pages, click tabs, wait for their content, and save PNGs.

Needs Debian's `chromium` (`apt-get install -y chromium`). Each page is checked for the
text it must show before the shot is taken, so a spinner never passes for a page.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDTH, HEIGHT = 1600, 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# ------------------------------------------------------------------ Prefect server


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # The UI asks the API at PREFECT_API_URL (else 127.0.0.1:4200): point it at this port.
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="true", PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited {proc.returncode}: {(home / 'server.log').read_text()[-2000:]}")
        return http_ok(base + "/api/health")

    # 90 s was passed at load 12 (eight test runs beside it); a server that dies fails at once above
    try:
        wait_for(healthy, 300, "prefect server /api/health")
    except BaseException:
        stop_process_group(proc)  # a server that never answered was left running (seen: 75 min, a core)
        raise
    return proc, base


def stop_process_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ------------------------------------------------------------------ the runs


def sim_config(state: Path) -> Path:
    from fleet.demo import free_port_block, to_toml

    model = state / "models" / "sim-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["SimForCausalLM"]}\n')
    (model / "model.safetensors").write_bytes(os.urandom(4 << 20))
    (state / "ram").mkdir(exist_ok=True)
    data = {
        "name": "demo",
        "nodes": [{"name": "local", "kind": "local", "workdir": str(state / "work"), "ramdisk": str(state / "ram")}],
        "engine": {"kind": "sim", "sim": {"startup_s": 2.0, "first_request_delay_s": 0.5}},
        "model": {"source": str(model), "stage_margin_gb": 0.0},
        "venv": {"path": str(state / "venv")},
        "servers": {"count": 4, "base_port": free_port_block(4), "stop_grace_s": 2, "ready_timeout_s": 60},
        "smoke": {"first_timeout_s": 20, "timeout_s": 5, "attempts": 2, "backoff_s": 0.2},
    }
    path = state / "demo-sim.toml"
    path.write_text(to_toml(data))
    return path


def run_flows(cfg_path: Path) -> dict[str, Any]:
    """bringup, kill server 2, revalidate (Failed), a chart artifact, teardown; ids for the pages."""
    from flows.fleet import fleet
    from fleet.config import load_config
    from fleet.servers import server_paths
    cfg = load_config(cfg_path)
    up = fleet(config=str(cfg_path), action="bringup", return_state=True)
    if not up.is_completed():
        raise RuntimeError(f"bring-up did not complete: {up.message}")
    pid = int(Path(server_paths(cfg.nodes[0].workdir, cfg.name, 2).pid).read_text())
    os.killpg(pid, signal.SIGKILL)
    reval = fleet(config=str(cfg_path), action="revalidate", return_state=True)
    if not reval.is_failed():
        raise RuntimeError(f"revalidate should have failed: {reval.message}")
    chart_sample(cfg)
    down = fleet(config=str(cfg_path), action="teardown", return_state=True)
    return {"bringup": up.state_details.flow_run_id, "revalidate": reval.state_details.flow_run_id,
            "teardown": down.state_details.flow_run_id, "fleet": cfg.name}


def chart_sample(cfg: Any) -> None:
    """The throughput chart from sample numbers, said so in its title: how the chart reads in the UI."""
    from prefect import flow

    from tasks.charts import write_throughput_artifact

    @flow(name="chart-sample", flow_run_name="chart-sample")
    def sample() -> None:
        # Three hours a minute apart: warm-up, steady state, one server lost for ten minutes, drain.
        series = [{"t": t * 60, "tok_s": (min(1.0, (t + 1) / 8) * (10_000 + 400 * ((t * 7919) % 11) / 10)
                                          * (0.75 if 70 <= t < 80 else 1.0) * (max(0.1, (180 - t) / 12) if t > 168 else 1))}
                  for t in range(0, 180)]
        write_throughput_artifact(cfg, series, {"local/0": 41_200_000, "local/1": 40_700_000,
                                                "local/2": 23_900_000, "local/3": 41_000_000},
                                  title="Generation throughput (sample data: rendering check)")

    sample()


def latest_artifact_ids(api: str, keys: list[str]) -> dict[str, str]:
    req = urllib.request.Request(api + "/artifacts/latest/filter", method="POST",
                                 data=json.dumps({"artifacts": {"key": {"any_": keys}}}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return {a["key"]: a["latest_id"] for a in json.load(r)}


# ------------------------------------------------------------------ headless Chromium over CDP


class Browser:
    """Just enough of the DevTools protocol: navigate, evaluate, click by text, screenshot."""

    def __init__(self) -> None:
        from websockets.sync.client import connect

        self.profile = Path(tempfile.mkdtemp(prefix="fleet-chromium-"))
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"
        port = wait_for(lambda: port_file.exists() and port_file.read_text().split("\n")[0].strip(), 30,
                        "chromium's DevTools port")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 << 20)
        self._id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                  mobile=False)
        self.call("Page.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return res.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        wait_for(lambda: self.js("document.readyState") == "complete", 30, f"load of {url}")

    def wait_text(self, *texts: str, timeout: float = 30) -> None:
        want = json.dumps(list(texts))
        try:
            wait_for(lambda: self.js(f"{want}.every(t => document.body && document.body.innerText.includes(t))"),
                     timeout, f"page text {texts}")
        except TimeoutError as exc:
            seen = self.js("document.body ? document.body.innerText : ''") or ""
            raise TimeoutError(f"{exc}; the page shows: {seen[:1500]!r}") from None

    def visible_text(self) -> str:
        """The text an operator sees without scrolling: text nodes inside the window, in document order."""
        return self.js(
            "(() => { const out = []; const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);"
            " let n; while ((n = w.nextNode())) { const t = n.textContent.trim(); if (!t) continue;"
            " const r = document.createRange(); r.selectNodeContents(n); const b = r.getBoundingClientRect();"
            " const s = getComputedStyle(n.parentElement);"
            " if (b.width > 0 && b.height > 0 && b.bottom > 0 && b.top < innerHeight && b.right > 0"
            " && b.left < innerWidth && s.visibility !== 'hidden' && s.opacity !== '0') out.push(t); }"
            " return out.join('\\n'); })()") or ""

    def click_text(self, text: str) -> None:
        clicked = wait_for(lambda: self.js(
            "(() => { const el = [...document.querySelectorAll('button, [role=tab], a, li')]"
            f".find(e => e.textContent.trim() === {json.dumps(text)});"
            " if (el) { el.click(); return true; } return false; })()"), 15, f"a clickable {text!r}")
        assert clicked

    def scroll_to(self, text: str) -> None:
        """Scroll so the first text starting with `text` is near the top of the view."""
        found = wait_for(lambda: self.js(
            "(() => { const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);"
            f" let n; while ((n = w.nextNode())) {{ if (n.textContent.trim().startsWith({json.dumps(text)})) break; }}"
            " if (!n) return false; const el = n.parentElement; el.scrollIntoView({block: 'start'});"
            " for (let p = el.parentElement; p; p = p.parentElement) { if (p.scrollTop > 0) p.scrollTop -= 120; }"
            " window.scrollBy(0, -120); return true; })()"), 15, f"{text!r} to scroll to")
        assert found

    def shot(self, path: Path, settle_s: float = 1.5) -> int:
        time.sleep(settle_s)  # let the run graph and tables finish drawing
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return len(data)

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            stop_process_group(self.proc)
            shutil.rmtree(self.profile, ignore_errors=True)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Screenshots of the Prefect UI showing fleet's runs.")
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go (default docs/img)")
    p.add_argument("--keep-server", action="store_true", help="leave the Prefect server running at the end")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not Path(CHROMIUM).exists():
        print("ui_screenshots: chromium is missing: apt-get install -y chromium", file=sys.stderr)
        return 2

    state = Path(tempfile.mkdtemp(prefix="fleet-ui-"))
    (state / "prefect-home").mkdir()
    server, base = start_server(state / "prefect-home")
    api = base + "/api"
    print(f"prefect server: {base} (home {state / 'prefect-home'})", flush=True)
    # Only now: Prefect reads these settings when it is first imported.
    os.environ.update(PREFECT_API_URL=api, PREFECT_HOME=str(state / "prefect-home"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_EXTRA_LOGGERS="fleet")
    browser = None
    try:
        ids = run_flows(sim_config(state))
        name = ids["fleet"]
        arts = latest_artifact_ids(api, [f"{name}-summary", f"{name}-local-server-0-launch", f"{name}-revalidate",
                                         f"{name}-generation-throughput"])
        browser = Browser()
        shots: list[tuple[str, int]] = []

        def take(file: str, url: str, *texts: str, click: str | None = None, after: tuple[str, ...] = (),
                 scroll: str | None = None) -> None:
            browser.goto(url)
            browser.wait_text(*texts)
            if click:
                browser.click_text(click)
                browser.wait_text(*after)
            if scroll:
                browser.scroll_to(scroll)
            shots.append((file, browser.shot(out / file)))

        run = f"{base}/runs/flow-run/{ids['bringup']}"
        take("flow-run-bringup.png", run, f"bringup-{name}", "Completed", "Beginning flow run")
        take("flow-run-task-runs.png", run, f"bringup-{name}", click="Task Runs",
             after=("launch-local-0", "smoke-local-3"))
        take("flow-run-artifacts.png", run, f"bringup-{name}", click="Artifacts",
             after=(f"{name}-summary", f"{name}-local-stage"))
        take("artifact-summary.png", f"{base}/artifacts/artifact/{arts[f'{name}-summary']}", "kv_cache_tokens",
             "smoke_latency_s")
        take("artifact-launch.png", f"{base}/artifacts/artifact/{arts[f'{name}-local-server-0-launch']}",
             "launch local server 0", "Log excerpt", "fired up", scroll="Log excerpt")
        take("flow-run-revalidate-failed.png", f"{base}/runs/flow-run/{ids['revalidate']}", f"revalidate-{name}",
             "Failed", "server 2")
        take("artifact-revalidate.png", f"{base}/artifacts/artifact/{arts[f'{name}-revalidate']}", "unhealthy",
             "not running")
        take("artifact-throughput.png", f"{base}/artifacts/artifact/{arts[f'{name}-generation-throughput']}",
             "Tokens per server", "tok/s")
        for file, size in shots:
            print(f"{out / file}: {size / 1024:.0f} KB")
    finally:
        if browser:
            browser.close()
        if args.keep_server:
            print(f"server left running: {base} (pid {server.pid})")
        else:
            stop_process_group(server)
            shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
