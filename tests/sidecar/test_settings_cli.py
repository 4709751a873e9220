"""Configuration layers (flag > env > file > default), errors that name the key, the CLI."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from tokenwire.middleware import ConfigError, SlowClientPolicy
from tokenwire.middleware.core.config import load_toml
from tokenwire.sidecar.settings import all_keys, build_config

from tokenwire.tools.cli import load_sidecar_config, main

CONF = Path(__file__).resolve().parents[2] / "conf" / "sidecar.toml"


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    config_file = tmp_path / "s.toml"
    config_file.write_text('upstream = "http://file:1"\nheartbeat_s = 3\nwrite_deadline_s = 7.5\n'
                           'max_body_bytes = 100\n')
    environ = {"TOKENWIRE_HEARTBEAT_S": "2", "TOKENWIRE_WRITE_DEADLINE_S": "6",
               "TOKENWIRE_SOMETHING_FOR_THE_ENGINE": "ignored"}
    config = load_sidecar_config(["--config", str(config_file), "--heartbeat-s", "1"], environ)
    assert config.wire.heartbeat_s == 1.0          # flag
    assert config.wire.write_deadline_s == 6.0     # env
    assert config.max_body_bytes == 100            # file
    assert config.wire.commit_deadline_s == 2.0    # default
    assert config.upstream == ("http://file:1",)


def test_repeated_upstream_flags_and_comma_separated_env() -> None:
    config = load_sidecar_config(["--upstream", "http://a:1", "--upstream", "unix:/tmp/e.sock"], {})
    assert config.upstream == ("http://a:1", "unix:/tmp/e.sock")
    config = load_sidecar_config([], {"TOKENWIRE_UPSTREAM": "http://a:1, http://b:2"})
    assert config.upstream == ("http://a:1", "http://b:2")


def test_enum_and_optional_values() -> None:
    config = build_config(flags={"upstream": ["http://a:1"], "slow_client_policy": "drop",
                                 "terminal_marker": ""})
    assert config.wire.slow_client_policy is SlowClientPolicy.DROP
    assert config.wire.terminal_marker is None


@pytest.mark.parametrize(("flags", "environ", "file_values", "key"), [
    ({"heartbeat_s": "soon"}, {}, {}, "heartbeat_s"),
    ({}, {"TOKENWIRE_MAX_PENDING_BYTES": "1.5"}, {}, "max_pending_bytes"),
    ({}, {}, {"write_deadline_s": "30"}, "write_deadline_s"),
    ({}, {}, {"heartbeat_sec": 1}, "heartbeat_sec"),
    ({"write_deadline_s": "-1"}, {}, {}, "write_deadline_s"),
    ({"slow_client_policy": "ignore"}, {}, {}, "slow_client_policy"),
    ({"listen": "nowhere"}, {}, {}, "listen"),
    ({"tls_cert": "a.pem"}, {}, {}, "tls_cert"),
    ({"abort_url": "http://e/abort"}, {}, {}, "abort_url"),
    ({"max_connections": "0"}, {}, {}, "max_connections"),
])
def test_bad_values_and_unknown_keys_name_the_key(flags: dict[str, str], environ: dict[str, str],
                                                  file_values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_config(flags={"upstream": ["http://a:1"], **flags}, environ=environ, file_values=file_values)
    assert error.value.key == key


def test_missing_upstream_is_an_error() -> None:
    with pytest.raises(ConfigError, match="upstream"):
        build_config()


def test_conf_file_has_every_key_with_its_default() -> None:
    values = load_toml(CONF)
    assert set(values) == {key.name for key in all_keys()}
    config = build_config(file_values=values)
    defaults = build_config(flags={"upstream": ["http://127.0.0.1:8001"]})  # the bundled engine's port
    assert config == defaults


def test_cli_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "sidecar" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["bogus"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["sidecar", "--help"]) == 0
    assert "--heartbeat-s" in capsys.readouterr().out


def test_cli_sidecar_config_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sidecar", "--upstream", "http://a:1", "--heartbeat-s", "x"]) == 2
    assert "heartbeat_s" in capsys.readouterr().err


def test_cli_engine_without_torch_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # torch is now absent, to find_spec and import alike
    assert main(["engine"]) == 2
    said = capsys.readouterr().err
    assert "pip install '.[engine]'" in said and "download.pytorch.org/whl/cpu" in said


def test_up_when_port_taken_then_exits_non_zero_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--listen", f"127.0.0.1:{port}", "--admin-listen", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is not available" in err
    assert "starting the engine" not in err  # refused before anything was started
