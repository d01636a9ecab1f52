"""The synchronous store core, tiers, policies, arena and wire codec (no gRPC)."""

from __future__ import annotations

import gc
import os

import pytest

from kvmesh.kvstore.block import CapacityError, StoredBlock
from kvmesh.kvstore.eviction import (
    DepthDiscountedPolicy,
    GreedyDualPolicy,
    LRUPolicy,
    SessionRatePolicy,
)
from kvmesh.kvstore.eviction_registry import make_eviction_policy
from kvmesh.kvstore.layout import kv_bytes_per_block, kv_bytes_per_token, namespace_for
from kvmesh.kvstore.ram_tier import RamTier
from kvmesh.kvstore.wire import decode_get_response, decode_put_request, encode_get_response, encode_put_chunk
from kvmesh_api.offload.v1 import offload_pb2
from kvmesh_offload.arena import Arena
from kvmesh_offload.store import BlockIn, OffloadStore, StoreFullError
from kvmesh_tools.policysim import TraceRequest, infinite_hit_rate, replay

pytestmark = pytest.mark.timeout(30)


def test_layout() -> None:
    assert kv_bytes_per_token(32, 8, 128, "bf16") == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(2, 2, 32, "torch.float32") == 2 * 2 * 2 * 32 * 4
    assert kv_bytes_per_block(2, 2, 32, "fp8", 16) == 2 * 2 * 2 * 32 * 16
    assert namespace_for("Qwen/Qwen3 8B", 36, 8, 128, "bfloat16", 64) == "Qwen/Qwen3_8B/L36-H8-D128-bf16-bs64"
    assert namespace_for("m", 2, 2, 32, "bf16", 16) != namespace_for("m", 2, 2, 32, "fp16", 16)
    with pytest.raises(ValueError, match="dtype"):
        kv_bytes_per_token(2, 2, 32, "int3")
    with pytest.raises(ValueError, match="num_layers"):
        namespace_for("m", 0, 2, 32, "bf16", 16)


@pytest.mark.parametrize("policy", ["lru", "agent", "greedy-dual", "session-rate"])
def test_policies_evict_deepest_first_within_a_request(policy: str) -> None:
    tier = RamTier(6, make_eviction_policy(policy))
    tier.new_batch()
    for d in range(4):
        tier.add(("n", d), StoredBlock(size=1, depth=d, session="a"))
    tier.new_batch()
    for d in range(4):
        tier.make_room(1)
        tier.add(("n", 100 + d), StoredBlock(size=1, depth=d, session="b"))
    # the older chain lost its tail, kept its head
    assert [("n", d) in tier for d in range(4)] == [True, True, False, False]


@pytest.mark.parametrize("agent_policy", [lambda: GreedyDualPolicy(share_weight=2.0),
                                          lambda: DepthDiscountedPolicy(clock=_Ticks())])
def test_agent_policy_keeps_blocks_shared_across_sessions(agent_policy) -> None:  # noqa: ANN001
    lru, agent = RamTier(4, LRUPolicy()), RamTier(4, agent_policy())
    for tier in (lru, agent):
        tier.new_batch()
        tier.add(("n", 1), StoredBlock(size=1, session="main"))          # system prompt
        for s in ("sub1", "sub2", "sub3"):
            tier.new_batch()
            tier.touch(("n", 1), s)
        tier.new_batch()
        for k in (2, 3, 4):
            tier.add(("n", k), StoredBlock(size=1, session="sub4", depth=k))
        tier.new_batch()
        tier.make_room(1)
        tier.add(("n", 9), StoredBlock(size=1, session="sub5"))
    assert ("n", 1) not in lru and ("n", 1) in agent


class _Ticks:
    """A clock that advances one second per reading (one request per second)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_agent_policy_keeps_chain_heads_of_many_sessions_over_one_deep_tail() -> None:
    # Capacity 8. Session a stores a 4-block chain at t=0, then b a 6-block chain at t=1.
    # LRU keeps b's whole chain and a's head only; the depth-discounted policy drops
    # b's deep tail instead, so both sessions keep a usable head.
    def run(policy) -> set[tuple[str, int]]:  # noqa: ANN001
        tier = RamTier(8, policy)
        for t, sess, base, n in ((0.0, "a", 0, 4), (1.0, "b", 100, 6)):
            policy.new_batch(t) if isinstance(policy, DepthDiscountedPolicy) else tier.new_batch()
            for d in range(n):
                if not tier.admits(1, d):
                    break
                tier.make_room(1)
                tier.add(("n", base + d), StoredBlock(size=1, depth=d, session=sess))
        return set(tier)

    lru = run(LRUPolicy())
    agent = run(DepthDiscountedPolicy(depth_cost_s=0.5, share_s=0.0))
    assert lru == {("n", d) for d in (0, 1)} | {("n", 100 + d) for d in range(6)}
    # priorities: a = 0 - 0.5d, b = 1 - 0.5d; b5 (-1.5) would evict a block worth more: not stored
    assert agent == {("n", d) for d in range(3)} | {("n", 100 + d) for d in range(5)}


def test_agent_policy_never_orphans_a_child() -> None:
    """Chain-aware: whatever the touches, a block is never evicted before its descendants."""
    import random

    rng = random.Random(7)
    pol = DepthDiscountedPolicy(depth_cost_s=0.01, share_s=5.0)
    tier = RamTier(40, pol)
    chains = {s: [rng.randrange(1 << 30) for _ in range(30)] for s in "abcdef"}
    chains["shared"] = chains["a"][:10]  # sub-agent sessions share a's head
    for t in range(300):
        sess = rng.choice(list(chains))
        pol.new_batch(float(t))
        chain = chains[sess][: rng.randrange(1, 31)]
        for d, k in enumerate(chain):
            if ("n", k) in tier:
                tier.touch(("n", k), sess)
                continue
            if not tier.admits(1, d):
                break
            for vid, _ in tier.make_room(1):
                # the victim's descendants in every chain are gone already
                for c in chains.values():
                    if vid[1] in c:
                        i = c.index(vid[1])
                        assert not any(("n", x) in tier for x in c[i + 1:]), (t, sess, vid)
            tier.add(("n", k), StoredBlock(size=1, depth=d, session=sess))


def test_agent_policy_rejects_negative_costs() -> None:
    with pytest.raises(ValueError, match="depth_cost_s"):
        DepthDiscountedPolicy(depth_cost_s=-1)


def test_session_rate_prefers_fast_loop_sessions() -> None:
    pol = SessionRatePolicy(gap_weight=1.0, default_gap=10.0)
    tier = RamTier(2, pol)
    for t, sess, key in ((0, "slow", 1), (1, "fast", 2), (2, "fast", 2), (300, "slow", 1), (301, "fast", 2)):
        pol.new_batch(float(t))
        if ("n", key) in tier:
            tier.touch(("n", key), sess)
        else:
            tier.add(("n", key), StoredBlock(size=1, session=sess))
    pol.new_batch(302.0)
    victims = tier.make_room(2)
    assert [v[0] for v in victims][0] == ("n", 1)  # the slow session's block goes first


def test_store_put_is_atomic_and_full_store_refuses() -> None:
    store = OffloadStore(10, evict_on_full=False)
    store.put("ns", [BlockIn(i, b"x" * 2, 0) for i in range(4)])
    with pytest.raises(StoreFullError):
        store.put("ns", [BlockIn(10 + i, b"y" * 2, 0) for i in range(2)])
    assert store.contains("ns", [10]) == (0, 0) and store.contains("ns", [0, 1, 2, 3]) == (4, 4)
    with pytest.raises(StoreFullError):
        OffloadStore(10).put("ns", [BlockIn(1, b"z" * 11, 0)])


def test_a_refused_put_evicts_nothing() -> None:
    """A put that cannot fit even after evicting everything it does not itself hold is refused
    before any eviction: the blocks already accepted stay, and stay reported."""
    store = OffloadStore(10)
    store.put("ns", [BlockIn(i, b"x" * 2, 0) for i in range(3)])     # 6 of 10 bytes
    store.put("ns", [BlockIn(9, b"w" * 2, 0)])                       # 8 of 10
    chain = [BlockIn(i, b"x" * 2, 0) for i in range(3)] + [BlockIn(20 + i, b"y" * 2, 0) for i in range(3)]
    with pytest.raises(StoreFullError, match="of this same put"):
        store.put("ns", chain)                                       # 6 held + 6 new > 10
    assert store.contains("ns", [9]) == (1, 1) and store.contains("ns", [0, 1, 2]) == (3, 3)
    assert store.contains("ns", [20]) == (0, 0)
    tier = RamTier(4)
    for k in range(4):
        tier.add(("n", k), StoredBlock(size=1, depth=k))
    with pytest.raises(CapacityError):
        tier.make_room(2, protect={("n", 0), ("n", 1), ("n", 2)})
    assert len(tier) == 4 and tier.evictions == 0
    assert [b for b, _ in tier.make_room(1, protect={("n", 0), ("n", 1), ("n", 2)})] == [("n", 3)]


def test_metadata_only_store_with_a_ram_lower_tier() -> None:
    """The cluster simulator's mode: capacity in blocks, no bytes, a modelled disk tier."""
    store = OffloadStore(3, metadata_only=True, disk=RamTier(5))
    out = store.put("m", [BlockIn(k, None, size=1) for k in range(3)], session="s")
    assert out.stored == 3
    store.put("m", [BlockIn(k, None, size=1) for k in range(10, 13)], session="t")
    assert store.contains("m", [0, 1, 2]) == (3, 0)            # all three spilled to the "disk"
    found = store.get("m", [0, 1, 2, 99])
    assert [f.medium for f in found] == ["DISK"] * 3 and all(f.block.data is None for f in found)
    s = store.stats()
    assert s["ram_bytes"] == 3 and s["counters"]["hits_disk"] == 3 and s["counters"]["misses"] == 1


def test_arena_slots_are_reused_only_after_every_reader_let_go() -> None:
    arena = Arena(limit_bytes=1 << 22, min_block=1024, slab_bytes=4096)
    a = arena.copy_in(os.urandom(2048))
    b = arena.copy_in(os.urandom(2048))
    held = a                                          # a reader still holds block a
    del a
    gc.collect()
    c = arena.alloc(2048)
    assert c is not None and c._idx not in (held._idx, b._idx)
    data_before = bytes(held.view)
    c.view[:] = b"\0" * 2048
    assert bytes(held.view) == data_before            # not overwritten under the reader
    idx = held._idx
    del held
    d, e = arena.alloc(2048), arena.alloc(2048)
    assert idx in (d._idx, e._idx)                     # freed once the last reference went
    assert arena.copy_in(b"small") == b"small"        # under min_block: left as bytes


def test_wire_codec_matches_protobuf() -> None:
    csum = 0xFEDCBA9876543210   # checksums are 64-bit (XXH3-64)
    raw = encode_get_response(2**64 - 1, b"\x01" * 5000, True, csum, 3)
    pb = offload_pb2.GetResponse.FromString(raw)
    assert (pb.chunk.key, pb.chunk.data, pb.chunk.last, pb.chunk.checksum, pb.tier) == (
        2**64 - 1, b"\x01" * 5000, True, csum, 3)
    ch = decode_get_response(pb.SerializeToString())
    assert (ch.key, bytes(ch.data), ch.last, ch.checksum, ch.tier) == (2**64 - 1, b"\x01" * 5000, True, csum, 3)
    req = offload_pb2.PutRequest.FromString(encode_put_chunk(5, b"ab", False, 0, [1, 2, 70000]))
    assert (req.chunk.key, req.chunk.data, req.chunk.last, list(req.chunk.token_ids)) == (5, b"ab", False,
                                                                                          [1, 2, 70000])
    hdr = decode_put_request(offload_pb2.PutRequest(header=offload_pb2.PutHeader(namespace="x")).SerializeToString())
    assert isinstance(hdr, offload_pb2.PutHeader) and hdr.namespace == "x"
    with pytest.raises(ValueError):
        decode_get_response(b"\x0a\xff\xff\xff\x0f")


def test_policy_replay_on_a_small_synthetic_agent_trace() -> None:
    # a main agent growing its context, and sub-agents sharing its first blocks
    reqs = []
    for turn in range(6):
        reqs.append(TraceRequest(turn * 10.0, "f", "main", list(range(0, 10 + turn))))
        reqs.append(TraceRequest(turn * 10.0 + 1, "f", f"main/sub{turn}", [0, 1, 1000 + turn, 2000 + turn]))
    ceiling, unique = infinite_hit_rate(reqs)
    assert 0 < ceiling < 1 and unique == 15 + 12
    big = replay(reqs, "lru", 1000)
    assert big.hit_rate == pytest.approx(ceiling) and big.evictions == 0
    small = {p: replay(reqs, p, 12).hit_rate for p in ("lru", "agent", "greedy-dual", "session-rate")}
    assert all(0 < v <= ceiling for v in small.values())


def test_agent_policy_clock_sources() -> None:
    from kvmesh_offload.store import OffloadStore

    store = OffloadStore(1 << 20, policy="agent")
    assert store.ram.policy._clock is not None  # the service ranks by wall-clock seconds
    # No clock and no time given (e.g. a simulator): one tick per batch, batch-unit costs.
    pol = DepthDiscountedPolicy(depth_cost_batches=0.5, share_s=0.0)
    tier = RamTier(8, pol)
    for sess, base, n in (("a", 0, 4), ("b", 100, 6)):
        tier.new_batch()
        for d in range(n):
            if not tier.admits(1, d):
                break
            tier.make_room(1)
            tier.add(("n", base + d), StoredBlock(size=1, depth=d, session=sess))
    assert set(tier) == {("n", d) for d in range(3)} | {("n", 100 + d) for d in range(5)}


def test_shared_arena_falls_back_to_private_memory(monkeypatch) -> None:  # noqa: ANN001
    from kvmesh.kvstore import shm as shm_mod
    from kvmesh.kvstore.shm import ShmError
    from kvmesh_offload import arena as arena_mod

    a = arena_mod.Arena(64 << 20, slab_bytes=4 << 20, shared=True)
    slot = a.alloc(1 << 20)
    name, off = slot.location()
    assert name.startswith(arena_mod.SLAB_PREFIX) and off == 0
    a.close()
    assert not (shm_mod.SHM_DIR / name).exists()

    def no_shm(*_a: object, **_k: object) -> None:
        raise ShmError("no room in /dev/shm")

    monkeypatch.setattr(arena_mod.Segment, "create", no_shm)
    b = arena_mod.Arena(64 << 20, slab_bytes=4 << 20, shared=True)
    s2 = b.copy_in(b"\x07" * (1 << 20))
    assert s2.location() is None and bytes(s2.view[:2]) == b"\x07\x07"


def test_segments_of_dead_processes_are_pruned() -> None:
    from kvmesh.kvstore.shm import NAME_PREFIX, SHM_DIR, prune_stale

    dead = SHM_DIR / f"{NAME_PREFIX}999999999-deadbeef"   # no such pid
    alive = SHM_DIR / f"{NAME_PREFIX}{os.getpid()}-cafe"
    for p in (dead, alive):
        p.write_bytes(b"x")
    try:
        assert prune_stale(NAME_PREFIX) >= 1
        assert not dead.exists() and alive.exists()
    finally:
        dead.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


def test_put_depth_is_the_depth_in_the_chain() -> None:
    """Workers put from the first block the store lacks; the depth the eviction policy ranks
    by continues from the parent's, in RAM or on disk, and starts at 0 without one."""
    store = OffloadStore(100, metadata_only=True, disk=RamTier(100))
    store.put("n", [BlockIn(key=k, data=None) for k in (1, 2, 3)])
    store.put("n", [BlockIn(key=k, data=None) for k in (4, 5)], parent=3)
    assert [store.ram.depth_of(("n", k)) for k in (1, 2, 3, 4, 5)] == [0, 1, 2, 3, 4]
    store.disk.add(("n", 9), StoredBlock(size=1, depth=40))   # type: ignore[union-attr]
    store.put("n", [BlockIn(key=10, data=None)], parent=9)
    store.put("n", [BlockIn(key=20, data=None)], parent=777)
    assert (store.ram.depth_of(("n", 10)), store.ram.depth_of(("n", 20))) == (41, 0)


def test_tier_membership_test_is_live() -> None:
    """``holds()`` is taken once and asked for millions of ids (the simulator's prefix scans):
    it sees every later add and eviction."""
    tier = RamTier(2)
    holds = tier.holds()
    tier.add(("n", 1), StoredBlock(size=1))
    assert holds(("n", 1)) and not holds(("n", 2))
    tier.add(("n", 2), StoredBlock(size=1))
    tier.make_room(1)
    assert [holds(("n", k)) for k in (1, 2)] == [("n", k) in tier for k in (1, 2)] == [False, True]


def test_tier_add_many_takes_new_blocks_only() -> None:
    """The simulator's one-call put: new metadata-only blocks, counted and ranked as ``add``
    ranks them; a block the tier already holds is an error, not a silent double count."""
    tier, ref = RamTier(8), RamTier(8)
    tier.new_batch()
    ref.new_batch()
    tier.add_many([("n", 5), ("n", 6), ("n", 7)], [0, 1, 2], "s")
    for d, k in enumerate((5, 6, 7)):
        ref.add(("n", k), StoredBlock(size=1, depth=d, session="s"))
    assert tier.used == ref.used == 3 and set(tier) == set(ref)
    assert tier.peek(("n", 6)).depth == 1   # type: ignore[union-attr]
    for d, k in enumerate((5, 6, 7)):   # the positional metadata block is the keyword one, field by field
        assert tier.peek(("n", k)) == ref.peek(("n", k)) == StoredBlock(size=1, depth=d, session="s")
    with pytest.raises(ValueError, match="already held"):
        tier.add_many([("n", 9), ("n", 6)], [0, 1], "s")
    assert ("n", 9) not in tier and tier.used == 3   # refused whole
    assert [b for b, _ in tier.make_room(7)] == [b for b, _ in ref.make_room(7)] == [("n", 7), ("n", 6)]


def test_a_stored_blocks_metadata_stays_small_next_to_its_data() -> None:
    """What the RAM tier does not count (token ids, the block record, the policy's entry) is
    the store's overhead per block: bounded, and small next to even a small block."""
    from tests.fixtures.memory import least_traced_bytes

    n, size = 2048, 32 * 1024
    payloads = [bytes(size) for _ in range(n)]
    stores: list[OffloadStore] = []

    def fill(traced) -> int:
        stores.clear()
        gc.collect()
        base = traced()
        st = OffloadStore(n * size * 2)
        stores.append(st)
        for i in range(0, n, 16):
            # Fresh ids each put, as the wire decodes them (above the small-int cache).
            st.put("ns", [BlockIn(key=i + j + 1, data=payloads[i + j],
                                  token_ids=tuple(100_000 + 64 * (i + j) + t for t in range(64))) for j in range(16)],
                   session="s", block_size=64)
        gc.collect()
        return traced() - base

    per_block = least_traced_bytes(fill, lambda got: got / n < 1024) / n
    st = stores[0]
    assert len(st.ram) == n
    # The data is shared with the caller here; everything traced is metadata. A tuple of 64
    # Python ints alone was ~2.3 KiB.
    assert per_block < 1024, per_block
    assert list(st.ram.peek(("ns", 1)).token_ids) == list(range(100_000, 100_064))
