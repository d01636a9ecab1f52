"""The simulator's offload store takes a put as the store service does.

``SimOffload`` runs the store's RAM tier and eviction policy in metadata-only mode; its
put must keep what the service's ``OffloadStore.put`` keeps: blocks already there are
touched, room for the new ones is made at once, the put's own blocks never push each
other out, and a put larger than the store is refused whole.
"""

from __future__ import annotations

import random

import pytest

from kvmesh_offload.store import BlockIn, OffloadStore, StoreFullError
from kvmesh_tools.clustersim.parts import SimOffload
from kvmesh_tools.traffic.model import chain_keys

NS = SimOffload.NS


@pytest.mark.parametrize("seed", range(30))
def test_puts_keep_what_the_store_service_keeps(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randrange(4, 40)
    sim = SimOffload(capacity, "lru")
    real = OffloadStore(capacity, policy="lru", metadata_only=True)
    trunks = [[rng.randrange(1 << 20) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    refused = 0
    for _ in range(60):
        ids = rng.choice(trunks)[:rng.randrange(1, 31)] + [rng.randrange(1 << 20) for _ in range(rng.randrange(12))]
        keys = chain_keys("t", ids)
        # As workers put: from the first block the store lacks, with its parent's key.
        start = sim.leading(keys, len(keys)) if rng.random() < 0.8 else 0
        sim.put(keys, start, "s")
        try:
            real.put(NS, [BlockIn(key=k, data=None) for k in keys[start:]], session="s",
                     parent=keys[start - 1] if start else None)
        except StoreFullError:
            refused += 1
        held = {bid[1] for bid in real.ram}
        assert sim._present == held
        assert set(sim.tier) == held
        for cap in (len(keys) + 3, rng.randrange(len(keys) + 1), 0):   # the first call fills the memo
            want = next((i for i, k in enumerate(keys[:cap]) if k not in held), min(cap, len(keys)))
            assert sim.leading(keys, cap) == want
    assert sim.refused == refused


@pytest.mark.parametrize("seed", range(10))
def test_a_prompt_asked_again_after_puts_and_evictions_gets_a_fresh_answer(seed: int) -> None:
    """``leading`` goes on from what it found for the same prompt list while nothing was
    evicted; across puts that add and evict, it answers as a first scan of the tier would."""
    rng = random.Random(seed)
    sim = SimOffload(rng.randrange(6, 14), "lru")
    trunk = [rng.randrange(1 << 20) for _ in range(10)]
    prompts = [chain_keys("t", trunk[:rng.randrange(1, 8)] + [rng.randrange(1 << 20) for _ in range(rng.randrange(6))])
               for _ in range(6)]
    for _ in range(80):
        keys = rng.choice(prompts)
        sim.put(keys, sim.leading(keys, len(keys)), "s")
        for p in prompts:
            cap = rng.randrange(len(p) + 2)
            want = next((i for i, k in enumerate(p[:cap]) if k not in sim._present), min(cap, len(p)))
            assert sim.leading(p, cap) == want
    assert sim.tier.evictions > 0
