"""Configuration precedence: defaults < TOML < MESHD_* environment < flags."""

from pathlib import Path

import pytest

from meshd.config import Config, ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "meshd.toml"
    p.write_text(text)
    return p


def test_each_layer_overrides_the_one_below(tmp_path):
    path = write(tmp_path, 'port = 8000\npairing_port = 8001\nname = "toml"\nheartbeat_interval_s = 0.5\n')
    env = {"MESHD_PORT": "9000", "MESHD_NAME": "env", "HOME": str(tmp_path)}
    cfg = load_config(path, env, {"port": 9500, "name": None})
    assert cfg.port == 9500  # flag beats env
    assert cfg.name == "env"  # env beats TOML (flag not given)
    assert cfg.pairing_port == 8001  # TOML beats default
    assert cfg.heartbeat_interval_s == 0.5
    assert cfg.gone_after_s == Config().gone_after_s  # default


def test_a_meshd_table_is_accepted(tmp_path):
    path = write(tmp_path, '[meshd]\nmodel = "none"\n')
    cfg = load_config(path, {})
    assert not cfg.model_enabled


def test_a_missing_default_file_is_fine_but_a_missing_explicit_file_is_an_error(tmp_path):
    load_config(None, {"HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", {})


@pytest.mark.parametrize(
    "text, match",
    [("port = 'x'\n", "port"), ("bogus = 1\n", "unknown setting"), ("port = [\n", "meshd.toml"),
     ("heartbeat_interval_s = 10\n", "heartbeat"), ("wire_dtype = 'int8'\n", "wire_dtype must be"),
     ("self_profile = 'full'\n", "self_profile must be")],
)
def test_invalid_settings_are_reported_with_their_source(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text), {})


def test_state_dir_comes_from_systemd_then_home(tmp_path):
    cfg = load_config(None, {"HOME": str(tmp_path)})
    assert cfg.resolved_state_dir({"STATE_DIRECTORY": "/var/lib/meshd"}) == Path("/var/lib/meshd")
    assert cfg.resolved_state_dir({"HOME": "/h"}) == Path("/h/.local/state/meshd")
    assert load_config(None, {"MESHD_STATE_DIR": "/x"}).resolved_state_dir({}) == Path("/x")


def test_socket_path_follows_runtime_directory():
    cfg = Config()
    assert cfg.resolved_socket({"RUNTIME_DIRECTORY": "/run/meshd"}) == Path("/run/meshd/meshd.sock")
    assert Config(socket=Path("/tmp/s.sock")).resolved_socket({}) == Path("/tmp/s.sock")


def test_booleans_and_lists_parse_from_strings(tmp_path):
    cfg = load_config(None, {"HOME": str(tmp_path), "MESHD_MODEL": "none", "MESHD_MEMORY_BUDGET_MB": "512"})
    assert cfg.memory_budget_mb == 512 and cfg.model == "none"
