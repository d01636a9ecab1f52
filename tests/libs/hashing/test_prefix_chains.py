"""Common prefixes of chained block keys: the shortcuts agree with the binary search."""

from __future__ import annotations

import random

from kvmesh.hashing.prefix import common_prefix, common_prefix_near, extends
from kvmesh_tools.traffic.model import chain_keys


def _tree(rng: random.Random, n: int) -> list[list[int]]:
    """Chains that share prefixes of random lengths (ids drawn from a small pool, then chained)."""
    base = [rng.randrange(1 << 30) for _ in range(rng.randrange(0, 40))]
    out = []
    for _ in range(n):
        ids = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(1 << 30) for _ in range(rng.randrange(0, 20))]
        out.append(chain_keys("t", ids))
    return out


def test_near_equals_binary_search_whatever_the_guess() -> None:
    rng = random.Random(7)
    for _ in range(300):
        chains = _tree(rng, 8)
        for a in chains:
            for b in chains:
                want = common_prefix(a, b)
                guesses = [0, want, want - 1, want + 1, len(a), len(b), rng.randrange(-2, 70)]
                for guess in guesses:
                    assert common_prefix_near(a, b, guess) == want
                    assert common_prefix_near(a, b, guess, rng.choice(guesses)) == want


def test_extends_is_a_full_common_prefix() -> None:
    rng = random.Random(8)
    for _ in range(300):
        chains = _tree(rng, 8)
        for a in chains:
            for b in chains:
                assert extends(a, b) == (common_prefix(a, b) == len(a))
