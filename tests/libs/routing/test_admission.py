"""Admission control (kvmesh.routing.admission), on a two-endpoint cluster known by hand.

Each endpoint holds 400 blocks of 16 tokens (6,400 tokens; vLLM's null block is the 401st
reported) and another session's 3,000-token context from its last turn. A request of 4,000
tokens that hits nowhere does not fit beside that context (6,400 − 3,000 < 4,000), so under
saturation it is held at the router; it is sent when it would hit, when an endpoint has room,
when an endpoint has no prefill queued, once the other contexts leave the reuse window, or after
``admit_max_hold_s``.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.routing.load import LoadReport
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig, max_hit_blocks
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
N = 4000              # prompt tokens of the request decided here
OTHERS = 3000         # tokens of the context another session left on each endpoint
BLOCKS = 400          # KV blocks per endpoint (the report says 401: vLLM's null block)
pytestmark = pytest.mark.timeout(60)


def _core(policy: str = "precise", others: tuple[int, int] = (OTHERS, OTHERS), **scoring: float) -> RouterCore:
    # The displacement priced as the linear overflow estimate, without the blocking term: the
    # figures below are that formula's (tests/libs/routing/test_placement_cost.py, PLAIN).
    opts = {"admit_miss_ratio": 0.5, "displace_cliff": False, "displace_attention": False, "blocking_weight": 0.0,
            **scoring}
    core = RouterCore(RouterCoreConfig(policy=policy, block_size=BS, scoring=ScoringConfig(**opts)))
    for i, tokens in enumerate(others):
        core.set_endpoint(EndpointView(f"e{i}", f"127.0.0.1:{9000 + i}", "m"))
        core.load.working_set.touch(f"other{i}", f"e{i}", tokens, 0.0)
        core.load.working_set.refresh(f"other{i}", f"e{i}", 0.0)   # its turn is over
    return core


def _saturate(core: RouterCore, e0_queued: int = 1000, e1_queued: int = 40_000, at: float = 0.0) -> None:
    """Both endpoints have prefill queued (e1 far more, so a recompute goes to e0)."""
    for ep, q in (("e0", e0_queued), ("e1", e1_queued)):
        core.load.update(ep, LoadReport(running=1, waiting=1, waiting_prefill_tokens=q, num_blocks=BLOCKS + 1,
                                        received_at=at))


def _req(core: RouterCore, rid: str = "miss", seed: int = 2) -> RouteRequest:
    rng = random.Random(seed)
    keys = core.chain([rng.randrange(32000) for _ in range(N)], None, rid).keys
    return RouteRequest(rid, "m", keys, N, BS, rid)


def test_a_recompute_with_no_room_is_held():
    core = _core()
    _saturate(core)
    d = core.decide(_req(core), Matches(), 0.1)
    win = d.candidates[0]
    assert d.endpoint_id == "e0" and d.predicted_cached_tokens == 0
    # What does not fit: the whole prompt (in blocks) beyond the room the other context leaves.
    assert win.displace_s == pytest.approx((N - (BLOCKS * BS - OTHERS)) * core.cfg.scoring.prefill_s_per_token)
    assert d.hold and "no room" in d.hold and "e0" in d.hold


def test_room_on_the_cheapest_endpoint_sends_it():
    core = _core(others=(OTHERS - 1000, OTHERS))   # e0: 6,400 − 2,000 ≥ 4,000
    _saturate(core)
    d = core.decide(_req(core), Matches(), 0.1)
    assert d.endpoint_id == "e0" and d.candidates[0].displace_s == 0.0 and d.hold == ""


def test_an_endpoint_with_no_prefill_queued_means_no_hold():
    core = _core()
    _saturate(core, e0_queued=1000, e1_queued=0)
    assert core.decide(_req(core), Matches(), 0.1).hold == ""


def test_a_request_that_hits_is_never_held():
    core = _core()
    _saturate(core)
    half = max_hit_blocks(N, BS) // 2 + 1   # just above admit_miss_ratio of the prompt
    d = core.decide(_req(core), Matches(per_endpoint={"e0": TierMatch(gpu=half)}), 0.1)
    assert d.endpoint_id == "e0" and d.candidates[0].displace_s > 0 and d.hold == ""
    below = max_hit_blocks(N, BS) // 2 - 1
    assert core.decide(_req(core), Matches(per_endpoint={"e0": TierMatch(gpu=below)}), 0.1).hold


def test_the_hold_ends_when_the_other_contexts_leave_the_reuse_window():
    core = _core(reuse_window_s=600.0)
    _saturate(core, at=599.0)
    assert core.decide(_req(core), Matches(), 599.5, held_s=599.5).hold
    _saturate(core, at=600.5)
    assert core.decide(_req(core), Matches(), 601.0, held_s=100.0).hold == ""


def test_the_hold_ends_after_admit_max_hold_s():
    core = _core(admit_max_hold_s=30.0)
    for t in (29.9, 30.0):
        _saturate(core, at=t)   # fresh reports
        assert bool(core.decide(_req(core), Matches(), t, held_s=t).hold) == (t < 30.0)


@pytest.mark.parametrize("policy", ["llmd", "dynamo", "session", "approx"])
def test_only_precise_is_held(policy: str):
    core = _core(policy)
    _saturate(core)
    assert core.decide(_req(core), Matches(), 0.1).hold == ""


def test_off_by_default():
    assert ScoringConfig().admit_miss_ratio == 0.0
    core = _core(admit_miss_ratio=0.0)
    _saturate(core)
    assert core.decide(_req(core), Matches(), 0.1).hold == ""
