"""RetryBudget: a token bucket shared by all streams; time passed in."""

from __future__ import annotations

import pytest
from tokenwire.middleware import RetryBudget


def test_budget_when_fresh_then_full_capacity_available() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=0.0, now=0.0, capacity=3.0)
    assert [budget.try_acquire(0.0) for _ in range(4)] == [True, True, True, False]
    assert (budget.granted, budget.refused) == (3, 1)


@pytest.mark.parametrize(("ratio", "requests", "expected_retries"), [
    (0.2, 10, 2), (0.5, 10, 5), (0.0, 100, 0), (1.0, 3, 3)])
def test_budget_when_requests_arrive_then_ratio_of_them_may_retry(ratio: float, requests: int,
                                                           expected_retries: int) -> None:
    budget = RetryBudget(ratio=ratio, min_per_s=0.0, now=0.0, capacity=100.0)
    while budget.try_acquire(0.0):  # start from an empty bucket
        pass
    for _ in range(requests):
        budget.on_request(0.0)
    granted = 0
    while budget.try_acquire(0.0):
        granted += 1
    assert granted == expected_retries


def test_budget_when_time_passes_then_floor_refills_up_to_capacity() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=2.0, now=0.0, capacity=4.0)
    while budget.try_acquire(0.0):
        pass
    assert budget.try_acquire(0.4) is False
    assert budget.try_acquire(0.5) is True  # 1.0 token after 0.5 s at 2/s (0.8 + 0.2)
    budget.on_request(1000.0)
    assert budget.tokens == 4.0  # a long quiet spell cannot save up a burst


def test_budget_when_clock_goes_backwards_then_no_negative_refill() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=1.0, now=10.0, capacity=1.0)
    assert budget.try_acquire(10.0)
    assert not budget.try_acquire(5.0)
    assert budget.tokens >= 0.0


def test_budget_default_capacity_covers_floor_and_ratio() -> None:
    assert RetryBudget(ratio=0.2, min_per_s=3.0, now=0.0).capacity == pytest.approx(23.0)


@pytest.mark.parametrize("kwargs", [{"ratio": -0.1, "min_per_s": 0.0}, {"ratio": 0.0, "min_per_s": -1.0}])
def test_budget_when_negative_parameters_then_value_error(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryBudget(now=0.0, **kwargs)
