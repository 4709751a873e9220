"""WireConfig: the documented defaults, validation that names the key."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tokenwire.middleware import ConfigError, SlowClientPolicy, TokenWireMiddleware, WireConfig
from tokenwire.middleware.core.config import NonStreamAnswer


def test_defaults_follow_design() -> None:
    config = WireConfig()
    assert (config.heartbeat_s, config.commit_deadline_s, config.write_deadline_s) == (15.0, 2.0, 30.0)
    assert config.max_pending_bytes == 1 << 20
    assert config.slow_client_policy is SlowClientPolicy.COALESCE
    assert config.coalesce_ms == 0.0
    # The middleware's defaults: it cannot re-run its app, and each route's
    # dialect says how its stream ends (a generic SSE app's by ending its response).
    assert (config.retry_attempts, config.terminal_marker) == (0, "auto")
    assert config.volatile_chunk_fields == ("obfuscation",)
    assert config.droppable_event_types == ()


@pytest.mark.parametrize(("key", "value"), [
    ("heartbeat_s", -1.0), ("commit_deadline_s", "2"), ("coalesce_ms", -0.5),
    ("retry_backoff_s", -0.1), ("retry_budget_ratio", -1), ("write_deadline_s", 0),
    ("max_pending_bytes", 0), ("max_pending_bytes", True), ("upstream_headers_timeout_s", -5),
    ("max_line_bytes", 0), ("retry_attempts", -1), ("retry_attempts", 1.5),
    ("slow_client_policy", "fast"), ("max_line_bytes", 10 << 20),
])
def test_config_when_bad_value_then_config_error_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as raised:
        WireConfig(**{key: value})
    assert raised.value.key == key
    assert str(raised.value).startswith(f"{key}: ")


@pytest.mark.parametrize("policy", ["coalesce", "drop", "block"])
def test_config_when_policy_given_as_string_then_enum(policy: str) -> None:
    assert WireConfig(slow_client_policy=policy).slow_client_policy is SlowClientPolicy(policy)  # type: ignore[arg-type]


def test_replace_validates_again() -> None:
    config = WireConfig().replace(heartbeat_s=1.0)
    assert config.heartbeat_s == 1.0
    with pytest.raises(ConfigError):
        config.replace(heartbeat_s=-1.0)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        WireConfig().heartbeat_s = 1.0  # type: ignore[misc]


def _another_valid_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, SlowClientPolicy | NonStreamAnswer):
        return next(p for p in type(value) if p is not value)
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, tuple):
        if any(".." in v for v in value):  # client_settings: one more bound
            return (*value, "slow_client_policy=coalesce")
        return (*value, "/x=generic" if any("=" in v for v in value) else "x")
    if value is None:
        return "[DONE]"
    return value + "x" if value else "x"


SINGLE_KEYS = [f.name for f in dataclasses.fields(WireConfig) if f.name != "retry_attempts"]


@pytest.mark.parametrize("key", SINGLE_KEYS)
def test_middleware_when_any_single_key_changed_then_valid(key: str) -> None:
    """The README's first-contact promise: ``WireConfig(one_key=...)`` always
    builds a middleware (retry_attempts is the one key it refuses, by name)."""
    changed = WireConfig(**{key: _another_valid_value(getattr(WireConfig(), key))})
    assert getattr(changed, key) != getattr(WireConfig(), key)
    TokenWireMiddleware(_app, changed)


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never called
    raise AssertionError
