"""The hedge budget: hedges <= fraction x requests + burst, over any stretch of traffic."""

from __future__ import annotations

import pytest

from kvmesh.routing.hedge import HedgeBudget


def test_a_full_bucket_allows_its_burst_then_its_fraction() -> None:
    b = HedgeBudget(fraction=0.25, burst=2)
    assert b.take() and b.take()
    assert not b.take()   # the burst is spent
    granted = 0
    for _ in range(40):
        b.on_request()
        granted += b.take()
    assert granted == 10   # a quarter of the requests


def test_a_quiet_spell_refills_only_up_to_the_burst() -> None:
    b = HedgeBudget(fraction=1.0, burst=3)
    for _ in range(100):
        b.on_request()
    assert [b.take() for _ in range(5)] == [True, True, True, False, False]


def test_zero_fraction_or_a_burst_below_one_never_hedges_past_it() -> None:
    b = HedgeBudget(fraction=0.0, burst=1)
    assert b.take()
    for _ in range(1000):
        b.on_request()
    assert not b.take()
    assert not HedgeBudget(fraction=0.5, burst=0.5).take()


@pytest.mark.parametrize("kw", [{"fraction": -0.1}, {"fraction": 1.5}, {"burst": -1}])
def test_bad_budgets_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        HedgeBudget(**kw)
