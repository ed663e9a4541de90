"""`fleet report`: what a run recorded (its state, summary and artifacts), rendered in the terminal.

Where it reads, and why:
- With `PREFECT_API_URL` set (or a profile that sets it): that server's REST API, two small
  queries over httpx.
- Otherwise: the embedded server's SQLite database, read-only, directly. Starting a temporary
  server to ask it (what `prefect artifact ls/inspect` do) takes 10–25 s on a busy machine,
  runs migrations, prints telemetry errors and can hit "database is locked" against a running
  command's server. A read-only SQLite connection takes milliseconds, never writes (WAL mode:
  readers do not block the writer and are not blocked by it) and needs no server. The cost is
  knowing four columns of Prefect's schema (flow_run, flow_run_state, flow, artifact), which
  `prefect>=3.9,<3.10` pins; a schema change fails loudly here with the remedy (use the API).
Prefect itself is not imported (1 s on an idle machine, 7 s on a busy one): the two settings
that say where to read are taken from the environment and the active profile.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fleet.errors import FleetError

ACTIONS = ("bringup", "revalidate", "teardown", "generate")
REMEDY = "set PREFECT_API_URL to the server the runs were recorded on, or give --run NAME (`fleet report --list`)"


@dataclass(frozen=True)
class Run:
    id: str
    name: str
    state: str
    message: str
    start: str | None
    end: str | None


@dataclass(frozen=True)
class Artifact:
    key: str | None
    type: str
    description: str
    data: Any
    created: str
    run_name: str | None = None


@dataclass(frozen=True)
class State:
    type: str  # Prefect's StateType: RUNNING, FAILED, ...
    name: str
    at: str
    message: str


@dataclass(frozen=True)
class Attempt:
    """One try of a run: a flow-run retry (the UI's Retry, `prefect flow-run retry`, the flow's own
    retries) keeps the run and its id, so its artifacts and states hold every try; each RUNNING
    state starts one."""

    number: int
    started: str
    ended: State | None  # the first state after it that is not RUNNING; None while it runs
    artifacts: list[Artifact]


def _instant(ts: Any) -> datetime:
    """Prefect's timestamps as the API (ISO, 'Z') and SQLite ('YYYY-MM-DD HH:MM:SS.ffffff', UTC) give them."""
    d = datetime.fromisoformat(str(ts).replace("Z", "+00:00").replace(" ", "T", 1))
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


def attempts_of(states: list[State], arts: list[Artifact]) -> list[Attempt]:
    """The run's tries, the LAST FIRST, each with the artifacts created while it was the latest."""
    starts = [st for st in states if st.type == "RUNNING"] or [State("RUNNING", "", "", "")]
    out: list[Attempt] = []
    for i, st in enumerate(starts):
        after = [x for x in states if st.at and _instant(x.at) > _instant(st.at)]
        nxt = starts[i + 1].at if i + 1 < len(starts) else None
        mine = [a for a in arts if (not st.at or i == 0 or _instant(a.created) >= _instant(st.at))
                and (nxt is None or _instant(a.created) < _instant(nxt))]
        ended = next((x for x in after if x.type != "RUNNING"), None)
        out.append(Attempt(i + 1, st.at, ended, mine))
    return out[::-1]


class ReportError(FleetError):
    """The runs or artifacts asked for are not there."""


def _decode(data: Any) -> Any:
    """Artifact data as stored: JSON, and a table's rows are JSON text inside that JSON."""
    for _ in range(2):
        if not isinstance(data, str):
            break
        try:
            decoded = json.loads(data)
        except ValueError:
            break
        if isinstance(decoded, str) and not decoded.lstrip().startswith(("[", "{")):
            return decoded  # markdown: one level
        data = decoded
    return data


class SqliteSource:
    """The embedded server's database, opened read-only."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise ReportError(f"no Prefect database at {path}: nothing was run with this PREFECT_HOME yet",
                              remedy=REMEDY)
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        self.db.row_factory = sqlite3.Row
        self.where = str(path)

    def runs(self, names: list[str] | None, limit: int) -> list[Run]:
        q = ("SELECT r.id, r.name, r.state_name, s.message, r.start_time, r.end_time FROM flow_run r "
             "JOIN flow f ON f.id = r.flow_id LEFT JOIN flow_run_state s ON s.id = r.state_id WHERE f.name = 'fleet'")
        args: list[Any] = []
        if names:
            q += f" AND r.name IN ({','.join('?' * len(names))})"
            args += names
        q += " ORDER BY COALESCE(r.start_time, r.created) DESC LIMIT ?"
        rows = self.db.execute(q, [*args, limit]).fetchall()
        return [Run(r[0], r[1], r[2] or "", r[3] or "", r[4], r[5]) for r in rows]

    def run_by_id(self, prefix: str) -> Run | None:
        rows = self.db.execute(
            "SELECT r.id, r.name, r.state_name, s.message, r.start_time, r.end_time FROM flow_run r "
            "LEFT JOIN flow_run_state s ON s.id = r.state_id WHERE r.id LIKE ? ORDER BY r.created DESC LIMIT 1",
            [prefix + "%"]).fetchall()
        return Run(*[x or "" if i in (2, 3) else x for i, x in enumerate(rows[0])]) if rows else None

    def artifacts(self, run_id: str) -> list[Artifact]:
        rows = self.db.execute("SELECT key, type, description, data, created FROM artifact WHERE flow_run_id = ? "
                               "ORDER BY created", [run_id]).fetchall()
        return [Artifact(r[0], r[1] or "", r[2] or "", _decode(r[3]), r[4]) for r in rows]

    def states(self, run_id: str) -> list[State]:
        rows = self.db.execute("SELECT type, name, timestamp, message FROM flow_run_state WHERE flow_run_id = ? "
                               "ORDER BY timestamp", [run_id]).fetchall()
        return [State(str(r[0]), r[1] or "", str(r[2]), r[3] or "") for r in rows]

    def latest(self, key: str) -> Artifact | None:
        rows = self.db.execute("SELECT a.key, a.type, a.description, a.data, a.created, r.name FROM artifact a "
                               "LEFT JOIN flow_run r ON r.id = a.flow_run_id WHERE a.key = ? "
                               "ORDER BY a.created DESC LIMIT 1", [key]).fetchall()
        return Artifact(rows[0][0], rows[0][1], rows[0][2] or "", _decode(rows[0][3]), rows[0][4], rows[0][5]) \
            if rows else None


class ApiSource:
    """A running Prefect server's REST API."""

    def __init__(self, url: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=url.rstrip("/") + "/", timeout=15)
        self.where = url

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            r = self.http.post(path, json=body)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise ReportError(f"Prefect API at {self.where} did not answer {path}: {exc}",
                              remedy="start it (`prefect server start`) or unset PREFECT_API_URL to read the "
                                     "embedded server's database") from None
        return r.json()

    @staticmethod
    def _run(d: dict[str, Any]) -> Run:
        st = d.get("state") or {}
        return Run(d["id"], d["name"], st.get("name") or d.get("state_name") or "", st.get("message") or "",
                   d.get("start_time"), d.get("end_time"))

    def runs(self, names: list[str] | None, limit: int) -> list[Run]:
        body: dict[str, Any] = {"flows": {"name": {"any_": ["fleet"]}}, "sort": "START_TIME_DESC", "limit": limit}
        if names:
            body["flow_runs"] = {"name": {"any_": names}}
        return [self._run(d) for d in self._post("flow_runs/filter", body)]

    def run_by_id(self, prefix: str) -> Run | None:
        try:
            r = self.http.get(f"flow_runs/{prefix}")
        except Exception:
            return None
        return self._run(r.json()) if r.status_code == 200 else None

    def artifacts(self, run_id: str) -> list[Artifact]:
        rows = self._post("artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}, "sort": "CREATED_DESC"})[::-1]
        return [Artifact(a.get("key"), a.get("type") or "", a.get("description") or "", _decode(a.get("data")),
                         a.get("created") or "") for a in rows]

    def states(self, run_id: str) -> list[State]:
        import httpx

        try:
            r = self.http.get("flow_run_states/", params={"flow_run_id": run_id})
            r.raise_for_status()
        except httpx.HTTPError:
            return []  # attempts unlabelled rather than no report
        found = [State(str(d.get("type")), d.get("name") or "", str(d.get("timestamp")), d.get("message") or "")
                 for d in r.json()]
        return sorted(found, key=lambda st: _instant(st.at))

    def latest(self, key: str) -> Artifact | None:
        rows = self._post("artifacts/filter", {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC",
                                               "limit": 1})
        if not rows:
            return None
        run = self.run_by_id(rows[0]["flow_run_id"]) if rows[0].get("flow_run_id") else None
        return Artifact(rows[0].get("key"), rows[0].get("type") or "", rows[0].get("description") or "",
                        _decode(rows[0].get("data")), rows[0].get("created") or "", run.name if run else None)


def prefect_setting(name: str) -> str | None:
    """A Prefect setting as Prefect resolves it for the usual cases — the environment, then the
    active profile — without importing Prefect (≈ 1 s idle, 7 s measured on a busy 2-core machine)."""
    if os.environ.get(name) is not None:
        return os.environ[name]
    import tomllib

    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral"
    value = (data.get("profiles") or {}).get(active, {}).get(name)
    return None if value is None else str(value)


def open_source() -> SqliteSource | ApiSource:
    api = prefect_setting("PREFECT_API_URL")
    if api:
        return ApiSource(api)
    url = (prefect_setting("PREFECT_API_DATABASE_CONNECTION_URL")
           or prefect_setting("PREFECT_SERVER_DATABASE_CONNECTION_URL"))
    if url is None:
        home = Path(os.environ.get("PREFECT_HOME") or prefect_setting("PREFECT_HOME") or "~/.prefect").expanduser()
        return SqliteSource(home / "prefect.db")
    if not url.startswith("sqlite"):
        raise ReportError("the Prefect database is not SQLite and PREFECT_API_URL is not set",
                          remedy="set PREFECT_API_URL to the server that uses that database")
    return SqliteSource(Path(os.path.expanduser(url.split(":///", 1)[1])))


# -- rendering -------------------------------------------------------------------------------

class _Out:
    """rich at full width: the terminal's on a tty; on a pipe as wide as the content (rich would
    otherwise assume 80 columns and cut tables), with no trailing padding."""

    def __init__(self) -> None:
        import shutil

        self.tty = sys.stdout.isatty()
        self.width = shutil.get_terminal_size((140, 40)).columns if self.tty else 140

    def print(self, renderable: Any = "", width: int | None = None) -> None:
        from rich.console import Console

        w = max(self.width, width or 0)
        if self.tty:
            Console(width=w, soft_wrap=False, highlight=False).print(renderable)
            return
        c = Console(width=w, soft_wrap=False, highlight=False, no_color=True, force_terminal=False)
        with c.capture() as cap:
            c.print(renderable)
        sys.stdout.write("\n".join(ln.rstrip() for ln in cap.get().split("\n")))

    def rule(self, title: str) -> None:
        from rich.rule import Rule

        self.print(Rule(title, align="left"))

    @staticmethod
    def natural_width(renderable: Any) -> int:
        from rich.console import Console

        c = Console(width=100_000)
        return c.measure(renderable).maximum


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, list | dict):
        if not v:
            return "-"
        return json.dumps(v) if not isinstance(v, list) or any(isinstance(x, dict) for x in v) \
            else ",".join(str(x) for x in v)
    return str(v)


def table_of(data: Any) -> tuple[list[str], list[list[str]]]:
    """Columns and rows from what a table artifact holds: a list of dicts, a dict of columns, or rows."""
    if isinstance(data, dict):
        keys = list(data)
        n = max((len(v) for v in data.values() if isinstance(v, list)), default=0)
        return keys, [[_cell(data[c][i] if i < len(data[c]) else None) for c in keys] for i in range(n)]
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        cols: list[str] = []
        for r in data:
            cols += [k for k in r if k not in cols]
        return cols, [[_cell(r.get(c)) for c in cols] for r in data]
    if isinstance(data, list):
        return [], [[_cell(x) for x in (r if isinstance(r, list) else [r])] for r in data]
    return [], [[_cell(data)]]


def render_artifact(console: _Out, art: Artifact, full: bool) -> None:
    from rich.markdown import Markdown
    from rich.table import Table

    title = f"{art.key or '(no key)'} · {art.type}" + (f" · {art.description}" if art.description else "")
    if art.type == "table":
        cols, rows = table_of(art.data)
        t = Table(title=title, title_justify="left", show_lines=False)
        for c in cols or [""] * (len(rows[0]) if rows else 1):
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t, width=console.natural_width(t))  # never cut a column at the terminal's edge
    elif art.type == "markdown" and full:
        console.rule(title)
        console.print(Markdown(str(art.data)))
    elif art.type == "progress":
        console.print(f"{title}: {float(art.data or 0):.1f} %")
    elif full or art.type in ("link", "image"):
        console.print(f"{title}: {art.data}")
    else:
        console.print(f"{title}")


def report(config: str | None, run: str, key: str | None, list_runs: bool, full: bool) -> int:
    try:
        return _report(config, run, key, list_runs, full)
    except BrokenPipeError:  # `fleet report | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _report(config: str | None, run: str, key: str | None, list_runs: bool, full: bool) -> int:
    from fleet.config import load_config

    names = [f"{a}-{load_config(config).name}" for a in ACTIONS] if config else None
    src = open_source()
    console = _Out()
    if list_runs:
        from rich.table import Table

        t = Table("run", "state", "started", "message", title=f"fleet runs ({src.where})", title_justify="left")
        for r in src.runs(names, 30):
            t.add_row(r.name, r.state, _when(r.start), r.message[:160])
        console.print(t, width=console.natural_width(t))
        return 0
    if key and run == "last":
        art = src.latest(key)
        if art is None:
            raise ReportError(f"no artifact with key {key!r} in {src.where}", remedy=REMEDY)
        console.print(f"[bold]{key}[/bold] from run {art.run_name or '?'}, {_when(art.created)}")
        render_artifact(console, art, True)
        return 0
    found = _pick_run(src, names, run)
    console.print(f"[bold]{found.name}[/bold]  {found.state}  {_when(found.start)} → {_when(found.end)}  "
                  f"(id {found.id}; {src.where})")
    if found.message:
        console.print(found.message)
    arts = src.artifacts(found.id)
    if key:
        arts = [a for a in arts if a.key == key]
        if not arts:
            raise ReportError(f"run {found.name} has no artifact {key!r}", remedy="`fleet report --run "
                                                                                  f"{found.name}` lists them")
    tries = attempts_of(src.states(found.id), arts)
    for attempt in tries:
        if len(tries) > 1:
            console.print()
            from rich.markup import escape

            console.print(f"[bold]── {escape(_attempt_title(attempt, len(tries)))}[/bold]")
        # the summary (tables) first, in full; markdown per task in full only when asked for
        for a in sorted(attempt.artifacts, key=lambda a: a.type != "table"):
            console.print()
            render_artifact(console, a, full or bool(key))
    if not key and any(a.type == "markdown" for a in arts) and not full:
        console.print(f"\n(per-task details: `fleet report --run {found.name} KEY`, or --full for all)")
    return 0


def _attempt_title(t: Attempt, count: int) -> str:
    """`attempt 2 of 2 (latest) · started … · Completed`: a retried run's tries are told apart."""
    end = f"{t.ended.name}" + (f": {t.ended.message[:300]}" if t.ended.message else "") if t.ended else "running"
    return (f"attempt {t.number} of {count}" + (" (latest)" if t.number == count else "")
            + f" · started {_when(t.started)} · {end}")


def _pick_run(src: SqliteSource | ApiSource, names: list[str] | None, run: str) -> Run:
    if run == "last":
        runs = src.runs(names, 1)
        if not runs:
            raise ReportError("no fleet run recorded" + (f" for {', '.join(names)}" if names else "")
                              + f" in {src.where}", remedy=REMEDY)
        return runs[0]
    runs = src.runs([run], 1)
    if runs:
        return runs[0]
    by_id = src.run_by_id(run)
    if by_id is None:
        raise ReportError(f"no fleet run named {run!r} in {src.where}", remedy=REMEDY)
    return by_id


def _when(ts: Any) -> str:
    if not ts:
        return "-"
    try:
        return _instant(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return str(ts)

