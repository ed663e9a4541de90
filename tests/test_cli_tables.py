"""Pure tests of the pieces issue 15 moved onto libraries or typed: rich tables, tomli-w, the TOML
source, and the typed stage results the tasks hand to the flow."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.cli import print_rows
from fleet.config import FleetConfig, load_config
from fleet.demo import to_toml
from fleet.errors import ConfigError
from fleet.preflight import Check, Gpu, NodeReport, PathInfo, render
from fleet.stages import ModelPlace, Provisioned, TeardownRow


def test_print_rows_is_not_wrapped_at_80_columns_on_a_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    """rich sizes a console that is not a terminal at 80 columns: a 12-column summary row would
    wrap or be cut, and `fleet up | grep` would miss it. One line per row, no trailing spaces."""
    columns = ["node", "server", "gpus", "port", "pid", "state", "ready_s", "smoke_latency_s",
               "kv_cache_tokens", "max_running_requests", "flag", "error"]
    rows = [{"node": "local", "server": i, "gpus": [i], "port": 31000 + i, "pid": 4000 + i, "state": "up",
             "ready_s": 12.3456, "smoke_latency_s": 0.03, "kv_cache_tokens": 500000, "max_running_requests": 64,
             "flag": None, "error": "x" * 100 if i else None} for i in range(3)]
    print_rows(rows, columns)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[0].split() == columns
    assert lines[1].split() == ["local", "0", "0", "31000", "4000", "up", "12.35", "0.03", "500000", "64", "-", "-"]
    assert all(line == line.rstrip() for line in lines)
    assert lines[2].endswith("x" * 100) and "…" not in lines[2]   # whole on a pipe, never wrapped


def test_print_rows_caps_a_long_cell_on_a_terminal_only(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet status | grep` and a saved `fleet up > log` cut the error column with "…" (seen with
    an error whose remedy was lost): on a pipe every cell is whole; a terminal keeps rows short."""
    rows = [{"server": 0, "error": "y" * 100 + " remedy-at-the-end"}]
    print_rows(rows, ["server", "error"])
    assert "remedy-at-the-end" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    print_rows(rows, ["server", "error"])
    out = capsys.readouterr().out
    assert "…" in out and "remedy-at-the-end" not in out


def test_preflight_render_tables() -> None:
    report = NodeReport("n", "h", True, gpus=[Gpu(0, "NVIDIA H200", "u", 143771, 0, 143181, "580.1")],
                        paths=[PathInfo("venv", "/opt/" + "v" * 90, "/opt/v", True, "ext4", "/", False, 10**11)],
                        checks=[Check("gpus", True, True, "1 GPU")])
    text = render([report])
    assert "  gpu  name         total MiB  used MiB  free MiB  driver" in text
    assert "    0  NVIDIA H200     143771         0    143181  580.1" in text
    assert "/opt/" + "v" * 90 in text   # a path is never cut
    assert "  [ok  ] gpus: 1 GPU" in text


def test_to_toml_round_trips_a_dumped_config(tmp_path: Path) -> None:
    """model_dump output (None values, int keys of extra_args_by_index) is written as TOML that loads back equal."""
    cfg = FleetConfig(name="rt", nodes=[{"name": "a", "kind": "local", "workdir": str(tmp_path)}],
                      servers={"count": 2, "extra_args_by_index": {1: ["--x"]}})
    data = cfg.model_dump(mode="python")
    data["servers"].pop("api_key")
    path = tmp_path / "rt.toml"
    path.write_text(to_toml(data))
    assert load_config(path) == cfg


@pytest.mark.parametrize("content,needle", [
    (None, "not found"),
    ("dir", "Is a directory"),
    (b"\xff\xfename = 1", "not UTF-8"),
    (b"[servers\n", "at line 1"),
])
def test_toml_source_errors_are_one_line_with_the_file(tmp_path: Path, content: bytes | str | None,
                                                       needle: str) -> None:
    """The TOML source reads a missing file or a directory as empty (every default): refused here."""
    path = tmp_path / "c.toml"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert needle in str(exc.value) and str(path) in str(exc.value)
    assert len(str(exc.value.reason).splitlines()) == 1


def test_stage_results_are_typed_and_keep_their_artifact_keys() -> None:
    """The flow reads attributes; the artifacts keep the keys they had as dicts."""
    from fleet.config import NodeConfig

    report = NodeReport("n", "h", True, gpus=[Gpu(i, "G", "u", 1, 0, 1, "d") for i in range(4)],
                        paths=[PathInfo("venv", "/v", "/v", True, "nfs4", "/", True, None)])
    prov = Provisioned.of(report, NodeConfig(name="n", gpus=[1, 3]))
    assert prov.gpu_ids == [1, 3] and prov.venv_network_fs and not prov.adopted
    assert {"gpu_ids", "venv_network_fs", "gpus", "paths", "ok"} <= set(prov.as_dict())
    unstaged = ModelPlace("/models/m")
    assert unstaged.adopted and unstaged.as_dict() == {"model_path": "/models/m", "staged": False, "adopted": True}
    row = TeardownRow.of_server({"node": "n", "index": 2, "port": 31002, "pid": 7, "action": "killed", "seconds": 1.5})
    assert row.is_server and row.stopped and not row.failed and row.what == "server 2"
    assert TeardownRow.of_ramdisk("n", {"path": "/dev/shm/m", "action": "error: busy"}).failed
