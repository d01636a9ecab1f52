"""The router's chain memories answer as a brute-force scan of what they remember."""

from __future__ import annotations

import random

from kvmesh.hashing.prefix import common_prefix
from kvmesh.routing.prefix_memory import ApproxIndex, SpeculativeIndex, _ChainSet
from tests.libs.hashing.test_prefix_chains import _tree


def _scan(chains: _ChainSet, keys: list[int], live_after: float | None,
          known: dict[str, int] | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for lst in chains.by_head.values():
        for endpoint, chain, value, reported in lst:
            if live_after is not None and value <= live_after:
                continue
            n = common_prefix(chain, keys)
            if n > out.get(endpoint, 0):
                out[endpoint] = n
                if known is not None:
                    known[endpoint] = min(reported, n)
    return out


def test_speculative_and_approx_matches_equal_a_scan() -> None:
    rng = random.Random(11)
    for _ in range(60):
        chains = _tree(rng, 30)
        spec = SpeculativeIndex(ttl_s=1.0, max_chains=rng.choice([5, 1000]), max_per_head=rng.choice([3, 256]))
        approx = ApproxIndex(capacity_blocks=rng.choice([20, 10_000]), max_per_head=rng.choice([3, 256]))
        now = 0.0
        for _ in range(80):
            now += rng.choice([0.0, 0.1, 0.7])
            keys = rng.choice(chains)
            ep = f"e{rng.randrange(5)}"
            if rng.random() < 0.5:
                spec.put(ep, keys, now, rng.choice([None, 0.2, 3.0]), known=rng.randrange(len(keys) + 1))
                approx.insert(ep, keys)
            q = rng.choice(chains)
            assert spec.match(q, now) == _scan(spec._set, q, now)
            index = {f"e{i}": rng.randrange(len(q) + 1) for i in range(5)}
            known: dict[str, int] = {}
            whole = _scan(spec._set, q, now, known)
            assert spec.confirmed(q, now, index.__getitem__) == {
                e: n for e, n in whole.items() if known[e] <= 0 or index[e] >= known[e]}
            assert approx.match(q) == _scan(approx._set, q, None)
