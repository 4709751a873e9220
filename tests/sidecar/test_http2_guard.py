"""FloodGuard in virtual time: each kind counted against its own limit per window."""

from __future__ import annotations

from tokenwire.sidecar.downstream.http2_guard import Flood, FloodGuard

LIMITS = {Flood.RESET: 3, Flood.CONTROL: 5, Flood.EMPTY: 1}


def test_guard_when_under_the_limit_then_never_trips() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    assert not any(guard.count(Flood.RESET, 0.1 * i) for i in range(3))
    assert guard.tripped is None


def test_guard_when_over_the_limit_in_one_window_then_trips_with_that_kind() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    assert [guard.count(Flood.RESET, 0.1) for _ in range(4)] == [False, False, False, True]
    assert guard.tripped is Flood.RESET


def test_guard_when_the_window_turns_then_counts_start_again() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    for _ in range(3):
        assert not guard.count(Flood.RESET, 0.5)
    # A steady 3 per second is allowed for ever.
    for second in range(1, 100):
        for _ in range(3):
            assert not guard.count(Flood.RESET, float(second))
    assert guard.tripped is None


def test_guard_when_kinds_mix_then_each_has_its_own_limit() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    for _ in range(5):
        assert not guard.count(Flood.CONTROL, 0.2)
    assert not guard.count(Flood.EMPTY, 0.2)
    assert guard.count(Flood.EMPTY, 0.3)
    assert guard.tripped is Flood.EMPTY
    assert guard.count(Flood.CONTROL, 0.4)
    assert guard.tripped is Flood.EMPTY  # the first one stays
