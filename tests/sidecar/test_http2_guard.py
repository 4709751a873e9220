"""FloodGuard in virtual time: each kind counted against its own limit per window."""

from __future__ import annotations

from tokenwire.sidecar.downstream.http2_guard import Flood, FloodGuard

LIMITS = {Flood.RESET: 3, Flood.CONTROL: 5, Flood.EMPTY: 1}


def test_guard_whenUnderTheLimit_thenNeverTrips() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    assert not any(guard.count(Flood.RESET, 0.1 * i) for i in range(3))
    assert guard.tripped is None


def test_guard_whenOverTheLimitInOneWindow_thenTripsWithThatKind() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    assert [guard.count(Flood.RESET, 0.1) for _ in range(4)] == [False, False, False, True]
    assert guard.tripped is Flood.RESET


def test_guard_whenTheWindowTurns_thenCountsStartAgain() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    for _ in range(3):
        assert not guard.count(Flood.RESET, 0.5)
    # A steady 3 per second is allowed for ever.
    for second in range(1, 100):
        for _ in range(3):
            assert not guard.count(Flood.RESET, float(second))
    assert guard.tripped is None


def test_guard_whenKindsMix_thenEachHasItsOwnLimit() -> None:
    guard = FloodGuard(LIMITS, now=0.0)
    for _ in range(5):
        assert not guard.count(Flood.CONTROL, 0.2)
    assert not guard.count(Flood.EMPTY, 0.2)
    assert guard.count(Flood.EMPTY, 0.3)
    assert guard.tripped is Flood.EMPTY
    assert guard.count(Flood.CONTROL, 0.4)
    assert guard.tripped is Flood.EMPTY  # the first one stays
