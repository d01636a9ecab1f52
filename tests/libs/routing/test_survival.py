"""The survival table: what share of a predicted hit each endpoint's engine found, by hand."""

from __future__ import annotations

import pytest

from kvmesh.routing.survival import HitSurvival

pytestmark = pytest.mark.timeout(30)


def test_an_unseen_endpoint_keeps_every_prediction():
    s = HitSurvival()
    assert s.rate("e0") == 1.0
    assert s.expected_loss("e0", 10_000) == 0


def test_the_ratio_is_token_weighted_and_decays_per_request():
    s = HitSurvival(decay=0.5, floor=0.9)
    s.observe("e0", 1000, 0)       # found nothing of 1,000
    s.observe("e0", 3000, 3000)    # found all of 3,000
    # found: 0 * 0.5 + 3000; predicted: 1000 * 0.5 + 3000
    assert s.rate("e0") == pytest.approx(3000 / 3500)
    s.observe("e0", 2000, 500)
    assert s.rate("e0") == pytest.approx((3000 * 0.5 + 500) / (3500 * 0.5 + 2000))
    assert s.rate("e1") == 1.0     # per endpoint


def test_no_prediction_says_nothing_and_a_windfall_counts_as_found_in_full():
    s = HitSurvival(decay=0.0)
    s.observe("e0", 0, 5000)       # nothing predicted: no evidence either way
    assert s.rate("e0") == 1.0
    s.observe("e0", 1000, 4000)    # more than predicted (a sibling's prefill landed first)
    assert s.rate("e0") == 1.0
    s.observe("e0", 1000, -5)      # a malformed count is no negative find
    assert s.rate("e0") == 0.0


def test_expected_loss_only_below_the_floor():
    s = HitSurvival(decay=0.0, floor=0.7)
    s.observe("e0", 1000, 750)
    assert s.expected_loss("e0", 8000) == 0          # 0.75 >= 0.7: trusted
    s.observe("e0", 1000, 250)
    assert s.expected_loss("e0", 8000) == 6000       # (1 - 0.25) * 8,000
    assert s.expected_loss("e0", 0) == 0
    off = HitSurvival(decay=0.0, floor=0.0)
    off.observe("e0", 1000, 0)
    assert off.expected_loss("e0", 8000) == 0        # floor 0: the rule is off


def test_a_departed_endpoint_is_forgotten():
    s = HitSurvival(decay=0.0)
    s.observe("e0", 1000, 0)
    s.forget("e0")
    assert s.rate("e0") == 1.0
