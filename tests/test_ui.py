"""What an operator sees in the Prefect UI after a failed bring-up, read by a real headless Chromium.

Real parts: `prefect server start` on a free port (its UI told where its API is, as the README's
"Operating" section says), the `fleet` flow run by `fleet up` against it, sim servers (one
fails at launch with SGLang's out-of-memory lines), and Debian's Chromium driven over the
DevTools protocol (bench/ui_screenshots.py's Browser: it waits for the text to render, so a
spinner never passes for a page). Skipped only when Chromium is not installed (`./dev.sh test`
installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import seed_prefect_home

ROOT = Path(__file__).resolve().parents[1]


def _load_browser_module() -> Any:
    spec = importlib.util.spec_from_file_location("fleet_ui_screenshots", ROOT / "bench" / "ui_screenshots.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ui = _load_browser_module()
pytestmark = [
    pytest.mark.prefect,
    pytest.mark.skipif(not Path(ui.CHROMIUM).exists(),
                       reason="chromium is not installed (apt-get install -y chromium; ./dev.sh test installs it)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    home = seed_prefect_home(tmp_path_factory.mktemp("prefect-ui"))
    saved = dict(os.environ)
    # start_server points the UI at its own port (PREFECT_UI_API_URL), as an operator must off 4200.
    for k in [k for k in os.environ if k.startswith("PREFECT_")]:
        del os.environ[k]
    try:
        proc, base = ui.start_server(home)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=base + "/api", PREFECT_UI_URL=base,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_EXTRA_LOGGERS="fleet")
    try:
        yield base, env
    finally:
        ui.stop_process_group(proc)


@pytest.fixture
def browser() -> Iterator[Any]:
    b = ui.Browser()
    try:
        yield b
    finally:
        b.close()


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    r = httpx.post(url, json=body, timeout=30)
    r.raise_for_status()
    return r.json()


@pytest.mark.timeout(600)
def test_failed_bringup_shows_the_failed_server_its_error_and_the_remedy(server, browser, tmp_path: Path) -> None:
    """Fault: a bring-up where one server runs out of memory at launch. In the UI the run page must
    show the run Failed with the server, its error and the remedy (the state message, not an
    engine traceback), and the summary artifact must show that server's row with the same."""
    from conftest import port_block
    from fleet.demo import to_toml

    base, env = server
    model = tmp_path / "models" / "sim-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"w" * 50_000)
    (tmp_path / "ram").mkdir()
    data = {
        "name": "ui",
        "nodes": [{"name": "local", "workdir": str(tmp_path / "work"), "ramdisk": str(tmp_path / "ram")}],
        "engine": {"kind": "sim", "sim": {"startup_s": 0.3}},
        "model": {"source": str(model), "stage_margin_gb": 0.0},
        "venv": {"path": str(tmp_path / "venv")},
        "servers": {"count": 2, "base_port": port_block(2), "ready_timeout_s": 60, "stop_grace_s": 2,
                    "extra_args_by_index": {1: ["--oom-at-start"]}},
        "smoke": {"first_timeout_s": 20, "timeout_s": 5, "attempts": 2, "backoff_s": 0.1},
    }
    cfg = tmp_path / "ui.toml"
    cfg.write_text(to_toml(data))
    try:
        up = subprocess.run([sys.executable, "-m", "flows.cli", "up", "-c", str(cfg)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 1, up.stdout + up.stderr
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "down", "-c", str(cfg)], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)
    (run,) = _post(base + "/api/flow_runs/filter", {"flow_runs": {"name": {"any_": ["bringup-ui"]}}})
    assert run["state"]["type"] == "FAILED"
    port1 = data["servers"]["base_port"] + 1

    # The run page: Failed, and the final log line carries the message: server, error, remedy.
    browser.goto(f"{base}/runs/flow-run/{run['id']}")
    browser.wait_text("bringup-ui", "Failed", "Finished in state Failed('1 server(s) up; 1 failed",
                      f"local server 1 (port {port1})", "Not enough memory", timeout=120)
    page = browser.js("document.body.innerText")
    assert "Engine execution exited" not in page and "cannot be resolved into an exception" not in page
    # At a glance: without scrolling, the run page and the runs list name the server and the cause
    # (Prefect shows tags there; the state message only in the last log line, far below).
    cause = f"failed: local server 1 (port {port1}): kv-no-memory"
    assert cause in browser.visible_text(), browser.visible_text()
    browser.shot(tmp_path / "run-page.png", settle_s=0)
    browser.goto(f"{base}/runs")
    browser.wait_text("bringup-ui", "Failed", timeout=60)
    browser.shot(tmp_path / "runs-list.png")
    assert cause in browser.visible_text(), browser.visible_text()
    browser.goto(f"{base}/runs/flow-run/{run['id']}")
    browser.wait_text("bringup-ui", "Finished in state Failed('1 server(s) up", timeout=60)
    line = next(ln for ln in page.splitlines() if "Finished in state Failed('1 server(s) up" in ln)
    assert f"local server 1 (port {port1})" in line and "Not enough memory" in line, line  # server, error
    assert "fix the cause" in line, line  # the remedy, on screen

    # The summary artifact: the failed server's row, its error and the remedy.
    (summary,) = _post(base + "/api/artifacts/filter", {"artifacts": {"key": {"any_": ["ui-summary"]},
                                                                       "flow_run_id": {"any_": [run["id"]]}}})
    row = {r["server"]: r for r in json.loads(summary["data"])}[1]
    assert row["state"] == "launch failed" and "fix the cause" in row["error"]
    browser.goto(f"{base}/artifacts/artifact/{summary['id']}")
    browser.wait_text("ui-summary", "launch failed", "Not enough memory", "fix the cause", "bringup-ui",
                      timeout=120)
    text = browser.js("document.body.innerText")
    assert re.search(r"FAILED|launch failed", text) and f"{port1}" in text
    # At a glance: the error cell begins inside the window, not past its right edge (it was the
    # table's last column, cut at the right edge of the screen).
    browser.shot(tmp_path / "summary.png")
    left = browser.js(
        "(() => { const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT); let n;"
        " while ((n = w.nextNode())) { if (n.textContent.includes('Not enough memory')) {"
        " const r = document.createRange(); r.selectNodeContents(n); const b = r.getBoundingClientRect();"
        " return [b.left, b.right, innerWidth]; } } return null; })()")
    assert left is not None and 0 <= left[0] < left[2] / 2, (left, browser.visible_text())
