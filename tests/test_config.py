"""The fleet config: TOML + FLEET_* env, and an error that names file, key, problem and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.config import FleetConfig, load_config
from fleet.errors import ConfigError

CONFIGS = Path(__file__).parent.parent / "deployments" / "configs"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_example_configs_load(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.nodes and cfg.engine.kind in ("sim", "sglang", "vllm", "transformers")


def test_local_sim_example_is_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: local-sim.toml used a fixed /tmp/fleet-local-sim (workdir and venv), so two people
    trying fleet on one machine adopted each other's servers and jobs. Its paths are now under
    each user's home."""
    dirs = []
    for user in ("alice", "bob"):
        monkeypatch.setenv("HOME", str(tmp_path / user))
        cfg = load_config(CONFIGS / "local-sim.toml")
        assert cfg.nodes[0].workdir.startswith(str(tmp_path / user) + "/")
        assert cfg.venv.path.startswith(str(tmp_path / user) + "/")
        dirs.append((cfg.nodes[0].workdir, cfg.venv.path))
    assert dirs[0][0] != dirs[1][0] and dirs[0][1] != dirs[1][1]
    for path in CONFIGS.glob("*.toml"):   # every example that runs on this machine
        cfg = load_config(path)
        if all(n.kind == "local" for n in cfg.nodes):
            for where in [n.workdir for n in cfg.nodes] + [cfg.venv.path]:
                assert where.startswith(str(tmp_path / "bob") + "/"), f"{path.name}: {where} is shared by all users"


def test_tilde_is_this_users_home_only_on_local_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`~` means this user's home where the path is on this machine (a local node; venv.path when
    every node is local); on an SSH node it is not expanded here (a workdir must be absolute)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    local = load_config(write(tmp_path, '[[nodes]]\nname = "a"\nworkdir = "~/w"\nramdisk = "~/ram"\n'
                                        '[venv]\npath = "~/v"\n'))
    assert (local.nodes[0].workdir, local.nodes[0].ramdisk, local.venv.path) == (
        f"{tmp_path}/w", f"{tmp_path}/ram", f"{tmp_path}/v")
    ssh = load_config(write(tmp_path, '[[nodes]]\nname = "b"\nkind = "ssh"\nhost = "h"\nworkdir = "/w"\n'
                                      '[venv]\npath = "~/v"\n'))
    assert ssh.venv.path == "~/v"
    with pytest.raises(ConfigError, match=r"nodes.0.workdir: .*must be an absolute path \(got '~/w'\)"):
        load_config(write(tmp_path, '[[nodes]]\nname = "b"\nkind = "ssh"\nhost = "h"\nworkdir = "~/w"\n'))


def test_seed_job_flags_in_ssh_example() -> None:
    cfg = load_config(CONFIGS / "ssh-sglang.toml")
    assert (cfg.engine.kind, cfg.engine.context_length, cfg.engine.speculative_algorithm) == ("sglang", 8192, "EAGLE")
    assert cfg.engine.speculative_num_steps == 3 and cfg.engine.mamba_scheduler_strategy == "extra_buffer"
    assert cfg.nodes[0].kind == "ssh" and cfg.servers.host == "127.0.0.1"


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "[servers]\nbase_port = 31000\ncount = 2\n")
    monkeypatch.setenv("FLEET_SERVERS__BASE_PORT", "32000")
    cfg = load_config(p)
    assert cfg.servers.base_port == 32000 and cfg.servers.count == 2


def test_bad_env_value_is_blamed_on_the_env_var_not_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: `FLEET_SERVERS__BASE_PORT=abc` was reported as an error in the TOML file, which
    never mentioned base_port. The message must name the variable."""
    p = write(tmp_path, "[servers]\ncount = 2\n")
    monkeypatch.setenv("FLEET_SERVERS__BASE_PORT", "abc")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith("environment variable FLEET_SERVERS__BASE_PORT: servers.base_port:") and "'abc'" in msg
    assert str(p) not in msg


def test_bad_value_in_a_whole_section_env_var_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: a section given as one JSON variable (FLEET_SERVERS='{...}') with a bad value, or
    not JSON at all (a raw pydantic SettingsError traceback), was not traced to the variable."""
    p = write(tmp_path, "")
    monkeypatch.setenv("FLEET_SERVERS", '{"base_port": "x"}')
    with pytest.raises(ConfigError, match=r"^environment variable FLEET_SERVERS: servers.base_port: "):
        load_config(p)
    monkeypatch.setenv("FLEET_SERVERS", "{not json")
    with pytest.raises(ConfigError, match=r"^environment variable FLEET_SERVERS: not valid JSON"):
        load_config(p)


def test_file_errors_still_name_the_file_when_env_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blaming env vars must not steal the file's own errors: each line names its real source."""
    p = write(tmp_path, "[servers]\ncount = -1\n")
    monkeypatch.setenv("FLEET_SMOKE__ATTEMPTS", "many")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    lines = str(e.value).splitlines()
    assert any(ln.startswith(f"{p}: servers.count:") for ln in lines)
    assert any(ln.startswith("environment variable FLEET_SMOKE__ATTEMPTS: smoke.attempts:") for ln in lines)


@pytest.mark.parametrize("var, needle", [
    ("FLEET_SERVER__BASE_PORT", "unknown key 'server' at the top level; allowed there: endpoints, engine, generation, "),
    ("FLEET_SERVERS__BASE_PROT", "unknown key 'base_prot' in servers; allowed there: api_key, base_port,"),
    ("FLEET_ENGINE__SIM__SPEED", "unknown key 'speed' in engine.sim;"),
    ("FLEET_NODES__0__WORKDIR", "nodes is a list: set it whole (FLEET_NODES=<JSON list>) or in the TOML file"),
    ("FLEET_SERVERS__HOST__X", "servers.host is a single value"),
    ("fleet_servr__count", "unknown key 'servr'"),
])
def test_unknown_fleet_env_var_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str,
                                           needle: str) -> None:
    """Fault: a misspelled section (`FLEET_SERVER__BASE_PORT`) was silently ignored, so the
    default port was used. Every FLEET_* variable that names no setting is an error, like an
    unknown TOML key, with what is allowed and a remedy."""
    p = write(tmp_path, "")
    monkeypatch.setenv(var, "31000")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    reason = str(e.value.reason)
    assert reason.startswith(f"environment variable {var}: ") and needle in reason and "\n" not in reason
    assert e.value.remedy and "FLEET_API_KEY" in e.value.remedy


def test_fleet_env_vars_that_are_not_config_are_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The FLEET_* variables fleet and dev.sh use for other things (the runner's API key, dev.sh's
    venv, the demo's dir) must not trip the unknown-variable check; dict fields take any key.
    Fault: dev.sh's FLEET_VENV=.venv2 was read by pydantic-settings as the whole [venv] section
    (a JSON parse error on every config load)."""
    from fleet.config import NOT_CONFIG_ENV

    for var in NOT_CONFIG_ENV:
        monkeypatch.setenv(var, "x")
    monkeypatch.setenv("FLEET_ENGINE__ENV__ANYTHING", "1")
    monkeypatch.setenv("FLEET_SERVERS__PORTS", "[31000, 31001]")
    cfg = load_config(write(tmp_path, ""))
    assert cfg.servers.ports == [31000, 31001] and cfg.engine.env_values() == {"ANYTHING": "1"}


def test_engine_env_names_from_the_environment_keep_their_case(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: FLEET_ENGINE__ENV__NCCL_DEBUG=INFO reached the servers as `nccl_debug=INFO`
    (pydantic-settings lowercases the keys of a dict set from the environment); environment
    variable names are case-sensitive. The variable also overrides the file's value."""
    p = write(tmp_path, '[engine.env]\nNCCL_DEBUG = "WARN"\nOMP_NUM_THREADS = "4"\n')
    monkeypatch.setenv("FLEET_ENGINE__ENV__NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FLEET_ENGINE__ENV__CUDA_LAUNCH_BLOCKING", "1")
    cfg = load_config(p)
    assert cfg.engine.env_values() == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "CUDA_LAUNCH_BLOCKING": "1"}


def test_cli_env_error_is_one_line_exit_2(tmp_path: Path) -> None:
    """The command line shows an env-var mistake as one config-error line naming the variable,
    the remedy, exit 2, no traceback."""
    import os
    import subprocess
    import sys

    p = write(tmp_path, "")
    env = {**os.environ, "FLEET_SERVER__BASE_PORT": "31000"}
    r = subprocess.run([sys.executable, "-m", "flows.cli", "status", "-c", str(p)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("fleet: config error: environment variable FLEET_SERVER__BASE_PORT: unknown key")
    assert lines[1].startswith("fleet: remedy: fix or unset the variable") and len(lines) == 2


def test_every_fleet_env_var_the_repo_uses_is_config_or_allow_listed() -> None:
    """A FLEET_* variable named in the repo's code (dev.sh, the runner, the demo, the tests) must
    be in NOT_CONFIG_ENV, or setting it would now be refused as an unknown config key."""
    import re
    import subprocess

    from fleet.config import env_problems

    root = Path(__file__).parent.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    used: set[str] = set()
    for f in files:
        if f in ("fleet/config.py", "tests/test_config.py"):   # the check itself and its bad examples
            continue
        if f.endswith((".py", ".sh", ".toml", ".yaml", ".yml")) or f in ("dev.sh", ".ci/run"):
            used |= set(re.findall(r"\bFLEET_[A-Z0-9_]*[A-Z0-9]\b", (root / f).read_text(errors="replace")))
    bad = env_problems({v: "1" for v in used})
    # names only used as a subprocess's own env in tests (test_node's FLEET_A/FLEET_B) or as
    # Python constants (FLEET_ROOT, _FLEET_HEADER) are not read as config by anyone
    not_env = {"FLEET_A", "FLEET_B", "FLEET_ROOT", "FLEET_HEADER"}
    bad = [b for b in bad if b.split(":")[0].removeprefix("environment variable ") not in not_env]
    assert not bad, f"add these to fleet.config.NOT_CONFIG_ENV (or make them config keys): {bad}"
    assert {"FLEET_API_KEY", "FLEET_VENV", "FLEET_DEMO_DIR"} <= used, "the scan must see the known ones"


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "[servers\nbase_port = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "line 1" in str(e.value)


def test_unknown_key_lists_allowed_keys(tmp_path: Path) -> None:
    p = write(tmp_path, "[servers]\nbase_prot = 31000\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}: servers.base_prot: unknown key" in msg and "base_port" in msg


def test_unknown_top_level_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="serverz: unknown key"):
        load_config(write(tmp_path, "[serverz]\ncount = 1\n"))


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, '[servers]\ncount = "many"\n'))
    assert "servers.count" in str(e.value) and "'many'" in str(e.value)


def test_port_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "[servers]\nbase_port = 70000\n"))
    assert "servers.base_port" in str(e.value) and "65535" in str(e.value)


def test_two_servers_on_one_port(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"two servers on one port: \[30001\]"):
        load_config(write(tmp_path, "[servers]\nports = [30000, 30001, 30001]\n"))


def test_public_bind_requires_api_key(tmp_path: Path) -> None:
    """A server on 0.0.0.0 without an API key is an open endpoint on a public IP: refused."""
    with pytest.raises(ConfigError, match="api_key"):
        load_config(write(tmp_path, '[servers]\nhost = "0.0.0.0"\n'))
    cfg = load_config(write(tmp_path, '[servers]\nhost = "0.0.0.0"\napi_key = "s3cret"\n'))
    assert cfg.api_key() == "s3cret" and "s3cret" not in repr(cfg)


def test_ssh_node_needs_host(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nodes.0: an ssh node needs 'host'"):
        load_config(write(tmp_path, '[[nodes]]\nname = "a"\nkind = "ssh"\n'))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/fleet.toml")


def test_fingerprint_ignores_api_key() -> None:
    a = FleetConfig(servers={"api_key": "one"})
    b = FleetConfig(servers={"api_key": "two"})
    assert a.fingerprint() == b.fingerprint() != FleetConfig(servers={"base_port": 31000}).fingerprint()


def test_every_field_has_a_description() -> None:
    """The model is the Prefect UI form and the README's schema: no field goes undocumented."""
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        missing = []
        for name, f in model.model_fields.items():
            if not f.description:
                missing.append(prefix + name)
            for t in getattr(f.annotation, "__args__", ()) or (f.annotation,):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    missing += walk(t, f"{prefix}{name}.")
        return missing

    assert walk(FleetConfig, "") == []
