"""The router's local view: index answers and finished prompts, kept for a TTL."""

from __future__ import annotations

from kvmesh.routing.local_view import LocalView
from kvmesh.routing.types import Matches, TierMatch


def test_learns_index_answers_and_answers_a_later_chain() -> None:
    v = LocalView(ttl_s=5.0)
    keys = list(range(100, 120))
    v.learn(keys, Matches(per_endpoint={"a": TierMatch(gpu=12), "b": TierMatch(gpu=0, cpu=3)},
                          store=TierMatch(cpu=15)), now=0.0)
    m = v.matches(keys + [7, 8], now=1.0)
    assert m is not None and m.source == "local"
    assert m.get("a").gpu == 12 and m.get("b").gpu == 0 and m.store.cpu == 15


def test_served_prompts_count_and_everything_expires() -> None:
    v = LocalView(ttl_s=5.0)
    keys = list(range(10))
    assert v.matches(keys, now=0.0) is None
    v.served("w1", keys, now=0.0)
    assert v.matches(keys[:6] + [99], now=4.9).get("w1").gpu == 6
    assert v.matches(keys, now=5.1) is None


def test_a_forgotten_endpoint_is_not_predicted() -> None:
    v = LocalView(ttl_s=5.0)
    v.served("w1", [1, 2, 3], now=0.0)
    v.served("w2", [1, 2], now=0.0)
    v.forget_endpoint("w1")
    m = v.matches([1, 2, 3], now=1.0)
    assert m is not None and m.get("w1").gpu == 0 and m.get("w2").gpu == 2
