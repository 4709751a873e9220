"""The sidecar and the engine read their keys with one implementation (middleware/process/config_layers.py):
the same text or TOML value gives the same value in both, and a bad one is refused in both, naming the key."""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest
from tokenwire.engine.config import EngineConfig, build_engine_config, engine_keys
from tokenwire.middleware import ConfigError, WireConfig
from tokenwire.middleware.process.config_layers import (
    ConfigKey,
    config_keys,
    value_from_text,
    value_from_toml,
)
from tokenwire.sidecar.settings import SidecarConfig, all_keys, build_config

_UPSTREAM = {"upstream": "http://127.0.0.1:8000"}


def _sample(key: ConfigKey) -> tuple[str, object, object]:
    """A text, a TOML value and the value both must give, for ``key``'s type."""
    if key.kind is bool:
        return "yes", True, True
    if key.kind is float:
        return "2.5", 2.5, 2.5
    if key.kind in (int, int | None):
        return "7", 7, 7
    if isinstance(key.kind, type) and issubclass(key.kind, Enum):
        member = list(key.kind)[-1]
        return str(member.value), str(member.value), member
    if key.kind == tuple[str, ...]:
        return "a, b", ["a", "b"], ("a", "b")
    return "x", "x", "x"


def test_wire_keys_are_the_same_keys_in_both_programs_spelled_under_each_prefix() -> None:
    sidecar = {k.name: k for k in all_keys() if k.wire}
    engine = {k.name: k for k in engine_keys() if k.wire}
    assert sidecar.keys() == engine.keys() == set(WireConfig.__dataclass_fields__)
    assert sidecar["heartbeat_s"].env == "TOKENWIRE_HEARTBEAT_S"
    assert engine["heartbeat_s"].env == "TOKENWIRE_ENGINE_HEARTBEAT_S"
    assert sidecar["heartbeat_s"].flag == engine["heartbeat_s"].flag == "--heartbeat-s"


@pytest.mark.parametrize("key", [k for k in config_keys(SidecarConfig, "") + config_keys(EngineConfig, "")
                                 if k.name not in ("wire",)], ids=lambda k: k.name)
def test_every_key_reads_text_and_toml_to_the_same_value(key: ConfigKey) -> None:
    text, toml_value, expected = _sample(key)
    assert value_from_text(key, text) == expected
    assert value_from_toml(key, toml_value) == expected


@pytest.mark.parametrize("build, extra", [(build_config, _UPSTREAM), (build_engine_config, {})],
                         ids=["sidecar", "engine"])
def test_both_programs_refuse_the_same_bad_values_naming_the_key(build: Any, extra: dict[str, str]) -> None:
    for flags in ({"heartbeat_s": "soon"}, {"retry_attempts": "2.5"}, {"resume": "maybe"},
                  {"slow_client_policy": "ignore"}):
        with pytest.raises(ConfigError) as error:
            build(flags={**extra, **flags})
        assert error.value.key == next(iter(flags))
    with pytest.raises(ConfigError) as error:
        build(flags=extra, file_values={"heartbeat_s": "15"})
    assert error.value.key == "heartbeat_s"


def test_optional_keys_are_unset_by_an_empty_value_or_zero_in_every_layer() -> None:
    assert build_config(flags={**_UPSTREAM, "terminal_marker": ""}).wire.terminal_marker is None
    assert build_engine_config(environ={"TOKENWIRE_ENGINE_TERMINAL_MARKER": ""}).wire.terminal_marker is None
    config = build_engine_config(file_values={"max_model_len": 0, "served_model_name": ""})
    assert config.max_model_len is None and config.served_model_name is None
    assert build_engine_config(flags={"threads": "0"}).threads is None


@pytest.mark.parametrize(("layers", "says"), [
    ({"environ": {"TOKENWIRE_HEARTBEAT_S": "abc"}},
     "not a valid number: 'abc' (from TOKENWIRE_HEARTBEAT_S='abc')"),
    ({"flags": {**_UPSTREAM, "heartbeat_s": "abc"}}, "(from --heartbeat-s)"),
    ({"file_values": {"heartbeat_s": "abc"}}, "(in the config file)"),
    ({"file_values": {"heartbeat": 3}},
     "unknown configuration key in the config file (did you mean heartbeat_s?)"),
])
def test_bad_value_when_refused_then_the_message_names_its_layer(layers: dict[str, Any], says: str) -> None:
    """Which variable, flag or file key to fix: the message says where the value came from."""
    with pytest.raises(ConfigError) as error:
        build_config(**{"flags": _UPSTREAM, **layers})
    assert says in str(error.value)
    with pytest.raises(ConfigError, match=r"\(from TOKENWIRE_ENGINE_MAX_RUNNING='many'\)"):
        build_engine_config(environ={"TOKENWIRE_ENGINE_MAX_RUNNING": "many"})
