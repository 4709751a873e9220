"""PingPolicy: gRPC keepalive enforcement, with injected time."""

from __future__ import annotations

import pytest
from tokenwire.sidecar.downstream.keepalive import PingLimits, PingPolicy


def test_pings_at_the_minimum_interval_are_never_strikes() -> None:
    policy = PingPolicy(PingLimits(min_ping_interval_s=10.0, max_ping_strikes=0))
    for i in range(100):
        assert policy.on_ping(i * 10.0, open_calls=1) is False
    assert policy.strikes == 0


def test_too_frequent_pings_end_the_connection_after_the_allowed_strikes() -> None:
    policy = PingPolicy(PingLimits(min_ping_interval_s=10.0, max_ping_strikes=2))
    assert policy.on_ping(0.0, open_calls=1) is False  # the first is never early
    assert policy.on_ping(1.0, open_calls=1) is False  # strike 1
    assert policy.on_ping(2.0, open_calls=1) is False  # strike 2
    assert policy.on_ping(3.0, open_calls=1) is True  # strike 3 > 2


def test_pings_without_a_call_are_strikes_unless_permitted() -> None:
    strict = PingPolicy(PingLimits(min_ping_interval_s=1.0, max_ping_strikes=1))
    assert strict.on_ping(0.0, open_calls=0) is False
    assert strict.on_ping(100.0, open_calls=0) is True
    lenient = PingPolicy(PingLimits(min_ping_interval_s=1.0, max_ping_strikes=1, permit_without_calls=True))
    assert all(not lenient.on_ping(t * 2.0, open_calls=0) for t in range(50))


def test_sending_to_the_client_forgives_the_strikes() -> None:
    policy = PingPolicy(PingLimits(min_ping_interval_s=10.0, max_ping_strikes=1))
    for i in range(20):
        assert policy.on_ping(float(i), open_calls=1) is False
        policy.on_sent()
    assert policy.strikes == 0


@pytest.mark.parametrize("kwargs", [{"min_ping_interval_s": -1.0}, {"max_ping_strikes": -1}])
def test_limits_refuse_negative_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PingLimits(**kwargs)  # type: ignore[arg-type]
