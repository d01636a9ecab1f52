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
