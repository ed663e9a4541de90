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
