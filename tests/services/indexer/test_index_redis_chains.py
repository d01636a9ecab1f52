"""The Redis backend's probe lookup (prefix-closed endpoints) answers exactly as a block-by-block walk.

Why: the Redis lookup reads only every ``probe_stride``-th block for endpoints
whose blocks are prefix-closed, trusting parent links and child counts kept at
ingest. These tests drive random engine-like traffic (stores with parents,
tail-first evictions) plus the cases that break the guarantee (orphans, a
parent removed before its children, no parent links) and compare every answer
with the in-memory index, which walks every block.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.index.base import Tier
from kvmesh.index.memory import MemoryIndex
from tests.fixtures.indexer import make_redis_index

pytestmark = pytest.mark.timeout(120)

M = "tiny"


class Forest:
    """Chains that share prefixes: block k's parent is parent[k] (None for a first block)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, list[int]] = {}
        self.next_key = 1

    def _new(self, parent: int | None) -> int:
        k = self.next_key
        self.next_key += 1
        self.parent[k] = parent
        if parent is not None:
            self.children.setdefault(parent, []).append(k)
        return k

    def path(self, length: int) -> list[int]:
        """A chain that reuses existing branches at random and grows new blocks past them."""
        out: list[int] = []
        cur: int | None = None
        while len(out) < length:
            kids = [k for k, p in self.parent.items() if p is None] if cur is None else self.children.get(cur, [])
            if kids and self.rng.random() < 0.8:
                cur = self.rng.choice(kids)
            else:
                cur = self._new(cur)
            out.append(cur)
        return out


class Engine:
    """An endpoint/tier that stores prefixes and evicts leaves first, as vLLM's block pool does."""

    def __init__(self, name: str, tier: Tier, forest: Forest) -> None:
        self.name, self.tier, self.forest = name, tier, forest
        self.held: set[int] = set()

    def store(self, chain: list[int], upto: int, indexes: list) -> None:
        first = next((i for i, k in enumerate(chain[:upto]) if k not in self.held), None)
        if first is None:
            return
        keys = chain[first:upto]
        parent = chain[first - 1] if first else None
        for idx in indexes:
            idx.add(M, self.name, self.tier, keys, chain_starts=[(0, parent)])
        self.held.update(keys)

    def evict_leaves(self, n: int, indexes: list) -> None:
        for _ in range(n):
            leaves = [k for k in self.held if not any(c in self.held for c in self.forest.children.get(k, []))]
            if not leaves:
                return
            k = self.forest.rng.choice(sorted(leaves))
            for idx in indexes:
                idx.remove(M, self.name, self.tier, [k])
            self.held.discard(k)


def _answer(idx, chain: list[int], **kw) -> dict[str, tuple[dict[Tier, int], int]]:
    res = idx.lookup(M, chain, **kw)
    return {ep: ({t: n for t, n in m.tiers.items() if n}, m.combined) for ep, m in res.matches.items()
            if m.combined or any(m.tiers.values())}


def _compare(redis_idx, mem: MemoryIndex, chains: list[list[int]], rng: random.Random, eps: list[str]) -> None:
    for chain in chains:
        kw: dict = {}
        r = rng.random()
        if r < 0.2:
            kw["endpoint_filter"] = rng.sample(eps, 2)
        elif r < 0.3:
            kw["exclude"] = [rng.choice(eps)]
        assert _answer(redis_idx, chain, **kw) == _answer(mem, chain, **kw), (chain[:5], kw)


@pytest.mark.parametrize("stride", [1, 4, 32])
def test_probe_lookup_equals_full_walk_on_engine_like_traffic(redis_server, stride: int) -> None:
    rng = random.Random(stride)
    forest = Forest(rng)
    redis_idx = make_redis_index(redis_server, probe_stride=stride)
    mem = MemoryIndex()
    both = [redis_idx, mem]
    engines = [Engine(f"e{i}", tier, forest) for i in range(4) for tier in (Tier.GPU, Tier.CPU)]
    chains = [forest.path(rng.randrange(1, 150)) for _ in range(30)]
    for step in range(60):
        eng = rng.choice(engines)
        chain = rng.choice(chains)
        eng.store(chain, rng.randrange(1, len(chain) + 1), both)
        if step % 3 == 0:
            rng.choice(engines).evict_leaves(rng.randrange(1, 40), both)
        if step % 10 == 9:
            _compare(redis_idx, mem, rng.sample(chains, 10), rng, sorted({e.name for e in engines}))
    # Engine-like traffic never breaks prefix closure: every endpoint takes the probe path.
    assert redis_idx.r.smembers(f"{redis_idx.namespace}:{{{M}}}:dirty") == set()
    _compare(redis_idx, mem, chains, rng, sorted({e.name for e in engines}))
    redis_idx.close()


def test_broken_prefix_closure_marks_dirty_and_stays_exact(redis_server) -> None:
    idx = make_redis_index(redis_server, probe_stride=4)
    mem = MemoryIndex()
    dirty_key = f"{idx.namespace}:{{{M}}}:dirty"
    chain = list(range(1, 41))
    for x in (idx, mem):
        x.add(M, "a", Tier.GPU, chain, chain_starts=[(0, None)])
        x.add(M, "b", Tier.GPU, chain[:30], chain_starts=[(0, None)])
    assert idx.r.smembers(dirty_key) == set()
    # A parent removed while its children stay: "a" holds 0..9 and 11..39.
    for x in (idx, mem):
        x.remove(M, "a", Tier.GPU, [chain[10]])
    assert idx.r.smembers(dirty_key) == {b"a"}
    assert _answer(idx, chain) == _answer(mem, chain) == {"a": ({Tier.GPU: 10}, 10), "b": ({Tier.GPU: 30}, 30)}
    # An orphan store (parent not held) marks "c"; a store without links marks "d".
    for x in (idx, mem):
        x.add(M, "c", Tier.GPU, chain[5:20], chain_starts=[(0, chain[4])])
        x.add(M, "d", Tier.GPU, chain[:12])
    assert idx.r.smembers(dirty_key) == {b"a", b"c", b"d"}
    assert _answer(idx, chain) == _answer(mem, chain)
    assert "c" not in _answer(idx, chain)
    # Clearing an endpoint makes it prefix-closed again.
    for x in (idx, mem):
        x.clear_endpoint("a")
    assert idx.r.smembers(dirty_key) == {b"c", b"d"}
    assert _answer(idx, chain) == _answer(mem, chain)
    idx.close()


def test_removal_order_within_one_batch_does_not_matter(redis_server) -> None:
    idx = make_redis_index(redis_server, probe_stride=2)
    dirty_key = f"{idx.namespace}:{{{M}}}:dirty"
    chain = list(range(100, 120))
    idx.add(M, "a", Tier.GPU, chain, chain_starts=[(0, None)])
    # Root-first order, but the whole tail goes in one call: no orphan is left.
    idx.remove(M, "a", Tier.GPU, chain[10:])
    assert idx.r.smembers(dirty_key) == set()
    assert _answer(idx, chain) == {"a": ({Tier.GPU: 10}, 10)}
    # Several chains in one add, as the ingest merges consecutive BlockStored events.
    other = list(range(200, 210))
    idx.add(M, "a", Tier.GPU, chain[10:15] + other, chain_starts=[(0, chain[9]), (5, None)])
    assert idx.r.smembers(dirty_key) == set()
    assert _answer(idx, chain) == {"a": ({Tier.GPU: 15}, 15)}
    assert _answer(idx, other) == {"a": ({Tier.GPU: 10}, 10)}
    idx.close()


def test_mixed_tiers_combined_run(redis_server) -> None:
    """GPU holds a prefix, CPU the same prefix further: combined is the union's run."""
    idx = make_redis_index(redis_server, probe_stride=3)
    chain = list(range(300, 330))
    idx.add(M, "a", Tier.GPU, chain[:7], chain_starts=[(0, None)])
    idx.add(M, "a", Tier.CPU, chain[:25], chain_starts=[(0, None)])
    assert _answer(idx, chain) == {"a": ({Tier.GPU: 7, Tier.CPU: 25}, 25)}
    idx.close()


def test_other_layout_in_namespace_is_refused(redis_server) -> None:
    idx = make_redis_index(redis_server)
    idx.r.set(f"{idx.namespace}:layout", "1")
    with pytest.raises(ValueError, match="layout v1"):
        idx.add(M, "a", Tier.GPU, [1, 2])
    idx.close()
