"""The Redis Cluster index on a real 3-master cluster: same answers as the in-memory index,
at most two shards per lookup, O(own blocks) clears, a master restart and a reshard during ingest."""

from __future__ import annotations

import random
import threading
import time

import pytest

from kvmesh.index.base import IndexUnavailable, Tier
from kvmesh.index.memory import MemoryIndex
from kvmesh_indexer.redis_cluster_backend import RedisClusterIndex, parse_cluster_url
from kvmesh_tools.testing.redis_cluster import RedisClusterProcess
from tests.fixtures.indexer import make_cluster_index

pytestmark = pytest.mark.timeout(180)

M = "tiny"


class ChainTree:
    """Chained block keys: a key fixes its whole prefix, as the engines' hashes do."""

    def __init__(self, rng: random.Random, roots: int, depth: int, fanout: int) -> None:
        self.paths: list[list[int]] = []
        for _ in range(roots):
            stack = [[rng.getrandbits(63) + 1]]
            while stack:
                p = stack.pop()
                if len(p) >= depth or (len(p) > 2 and rng.random() < 0.15):
                    self.paths.append(p)
                    continue
                kids = fanout if rng.random() < 0.3 else 1
                for _ in range(kids):
                    stack.append(p + [rng.getrandbits(63) + 1])


def _answer(res) -> dict:  # noqa: ANN001
    return {e: (m.tiers, m.combined) for e, m in res.matches.items()}


def _random_ops(idx, ref, rng: random.Random, tree: ChainTree, steps: int, eps: list[str]) -> None:  # noqa: ANN001
    models = [M, "m2"]
    for _ in range(steps):
        op = rng.random()
        model, ep, tier = rng.choice(models), rng.choice(eps), rng.choice(list(Tier))
        path = rng.choice(tree.paths)
        if op < 0.5:
            # a prefix-ordered store, as engines do: blocks [a, b) whose parent the endpoint holds
            held = ref.lookup(model, path, [ep]).matches.get(ep)
            a = rng.randrange((held.combined if held else 0) + 1)
            if a == len(path):
                continue
            b = rng.randrange(a, len(path)) + 1
            starts = [(0, path[a - 1] if a else None)]
            assert idx.add(model, ep, tier, path[a:b], starts) == ref.add(model, ep, tier, path[a:b], starts)
        elif op < 0.62:
            # engines evict tails first
            a = rng.randrange(len(path))
            assert idx.remove(model, ep, tier, path[a:]) == ref.remove(model, ep, tier, path[a:])
        elif op < 0.7:
            # ... but a hole in the middle must not make a lookup skip it (the endpoint turns dirty there)
            hole = rng.sample(path, rng.randrange(1, 3))
            assert idx.remove(model, ep, tier, hole) == ref.remove(model, ep, tier, hole)
        elif op < 0.75:
            assert idx.clear_endpoint(ep) == ref.clear_endpoint(ep)
        else:
            filt = rng.sample(eps, 2) if rng.random() < 0.3 else None
            excl = [rng.choice(eps)] if rng.random() < 0.2 else None
            extra = ["any"] if rng.random() < 0.3 else ()
            got = idx.lookup(model, path, filt, exclude=excl, extra_models=extra)
            want = ref.lookup(model, path, filt, exclude=excl, extra_models=extra)
            assert _answer(got) == _answer(want)
    for ep in eps:
        assert idx.endpoint_blocks(ep) == ref.endpoint_blocks(ep)


@pytest.mark.parametrize(("seed", "stride"), [(0, 1), (1, 2), (2, 3), (3, 32)])
def test_random_chain_operations_match_the_memory_index(redis_cluster, seed: int, stride: int) -> None:
    """Exact answers whether a lookup probes every stride-th block (clean endpoints) or walks them all."""
    rng = random.Random(seed)
    idx = make_cluster_index(redis_cluster, anchor_depth=5, probe_stride=stride)
    ref = MemoryIndex()
    tree = ChainTree(rng, roots=4, depth=12, fanout=3)
    eps = ["a", "b", "c", "any-store"]
    _random_ops(idx, ref, rng, tree, 400, eps)
    st = idx.stats()
    assert st.entries == ref.stats().entries
    assert 0 < st.counters["lookup_shards_max"] <= 2
    # a second client (another indexer replica) reads the same keys and answers the same
    other = RedisClusterIndex(redis_cluster.url, namespace=idx.namespace, anchor_depth=5, probe_stride=stride)
    for path in tree.paths:
        assert _answer(other.lookup(M, path)) == _answer(idx.lookup(M, path))
    other.close()
    idx.close()


def test_chains_spread_over_shards_and_lookups_touch_at_most_two(redis_cluster) -> None:
    idx = make_cluster_index(redis_cluster, anchor_depth=8)
    rng = random.Random(5)
    prefix = [rng.getrandbits(63) + 1 for _ in range(8)]       # a shared "system prompt"
    chains = [prefix + [rng.getrandbits(63) + 1 for _ in range(40)] for _ in range(30)]
    for i, c in enumerate(chains):
        idx.add(M, f"e{i % 5}", Tier.GPU, c, [(0, None)])
    for i, c in enumerate(chains):
        assert idx.lookup(M, c).matches[f"e{i % 5}"].combined == len(c)
    assert set(idx.lookup_shards) <= {1, 2} and sum(idx.lookup_shards.values()) == len(chains)
    # the shared prefix lives on one shard; the tails spread over every master
    used = set()
    for n in redis_cluster.nodes:
        if any(True for _ in n.client().scan_iter(match=f"{idx.namespace}:*:h:*", count=1000)):
            used.add(n.port)
    assert len(used) == len(redis_cluster.nodes)
    idx.close()


def _commands(cluster: RedisClusterProcess) -> int:
    return sum(int(n.client().info("stats")["total_commands_processed"]) for n in cluster.nodes)


def test_clearing_an_endpoint_costs_its_own_blocks_only(redis_cluster) -> None:
    idx = make_cluster_index(redis_cluster, anchor_depth=4, clear_chunk=50)
    rng = random.Random(9)
    big = [[rng.getrandbits(63) + 1 for _ in range(400)] for _ in range(10)]
    for c in big:
        idx.add(M, "big", Tier.GPU, c, [(0, None)])
    small = big[0][:20]
    idx.add(M, "small", Tier.CPU, small, [(0, None)])
    before = _commands(redis_cluster)
    assert idx.clear_endpoint("small") == 20
    cost_small = _commands(redis_cluster) - before
    assert idx.lookup(M, big[0]).matches["big"].combined == 400
    assert "small" not in idx.lookup(M, big[0]).matches
    before = _commands(redis_cluster)
    assert idx.clear_endpoint("big") == 4000
    cost_big = _commands(redis_cluster) - before
    # the small clear did not walk the big endpoint's 4000 entries
    assert cost_small * 10 < cost_big
    assert idx.stats().entries == 0 and idx.endpoints() == []
    idx.close()


def test_speculative_entries_and_url_forms(redis_cluster) -> None:
    idx = make_cluster_index(redis_cluster, anchor_depth=2)
    c = [11, 12, 13, 14, 15]
    idx.put_speculative(M, "s", c[:4], ttl_s=0.3)
    idx.put_speculative(M, "t", c[:2], ttl_s=5)
    m = idx.lookup(M, c, include_speculative=True).matches
    assert m["s"].speculative == 4 and m["t"].speculative == 2 and m["s"].combined == 0
    time.sleep(0.35)
    assert "s" not in idx.lookup(M, c, include_speculative=True).matches
    idx.close()
    nodes, opts = parse_cluster_url("rediss+cluster://u:p%40ss@h1:7000,h2:7001")
    assert [(n.host, n.port) for n in nodes] == [("h1", 7000), ("h2", 7001)]
    assert opts == {"ssl": True, "username": "u", "password": "p@ss"}
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        parse_cluster_url("redis://h:1")
    with pytest.raises(ValueError, match="host:port"):
        parse_cluster_url("redis+cluster://h")


def _chains(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.getrandbits(63) + 1 for _ in range(length)] for _ in range(n)]


def test_master_restart_is_unavailable_then_recovers_with_a_new_run_id() -> None:
    cluster = RedisClusterProcess().start()
    try:
        idx = RedisClusterIndex(cluster.url, namespace="rs", anchor_depth=4, timeout_s=0.5)
        rng = random.Random(3)
        chains = _chains(rng, 30, 12)
        for i, c in enumerate(chains):
            idx.add(M, f"e{i % 3}", Tier.GPU, c, [(0, None)])
        rid = idx.run_id()
        assert rid is not None
        cluster.stop_node(0)
        failed = 0
        t0 = time.monotonic()
        for c in chains:
            try:
                idx.lookup(M, c)
            except IndexUnavailable:
                failed += 1
        assert failed > 0                         # lookups on the lost shard fail cleanly ...
        assert time.monotonic() - t0 < 60
        cluster.restart(0)
        deadline = time.monotonic() + 30
        while True:   # ... and the shard serves again once it is back
            try:
                idx.lookup(M, chains[0])
                break
            except IndexUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert idx.run_id() not in (None, rid)    # the pump sees the restart and re-syncs the engines
        for ep in ("e0", "e1", "e2"):
            idx.clear_endpoint(ep)
        for i, c in enumerate(chains):
            idx.add(M, f"e{i % 3}", Tier.GPU, c, [(0, None)])
        for i, c in enumerate(chains):
            assert idx.lookup(M, c).matches[f"e{i % 3}"].combined == len(c)
        idx.close()
    finally:
        cluster.stop()


def test_reshard_during_ingest_keeps_answers_exact() -> None:
    cluster = RedisClusterProcess().start()
    try:
        idx = RedisClusterIndex(cluster.url, namespace="rh", anchor_depth=4, timeout_s=2.0)
        ref = MemoryIndex()
        rng = random.Random(4)
        chains = _chains(rng, 300, 24)
        slots0 = cluster.slots_of(0)
        err: list[BaseException] = []

        def reshard() -> None:
            try:
                cluster.reshard(0, 1, 1500)
            except BaseException as exc:  # noqa: BLE001
                err.append(exc)

        th = threading.Thread(target=reshard)
        th.start()
        retried = 0
        i = 0
        while i < len(chains) or th.is_alive():
            c = chains[i % len(chains)]
            ep = f"e{i % 4}"
            for lo in range(0, len(c), 6):
                starts = [(0, c[lo - 1] if lo else None)]
                for _ in range(50):
                    try:
                        idx.add(M, ep, Tier.GPU, c[lo:lo + 6], starts)
                        break
                    except IndexUnavailable:
                        retried += 1
                        time.sleep(0.05)
                ref.add(M, ep, Tier.GPU, c[lo:lo + 6], starts)
            i += 1
        th.join()
        assert not err, err
        assert cluster.slots_of(0) == slots0 - 1500
        for c in chains:
            assert _answer(idx.lookup(M, c)) == _answer(ref.lookup(M, c))
        assert idx.stats().entries == ref.stats().entries
        assert max(idx.lookup_shards) <= 2
        idx.close()
    finally:
        cluster.stop()


def test_odd_endpoint_names_survive_the_two_shard_merge(redis_cluster) -> None:
    idx = make_cluster_index(redis_cluster, anchor_depth=3, probe_stride=2)
    c = [(7 << 40) + i for i in range(1, 12)]
    for ep, n in (("a|b", 11), ("x\ny", 7), ("{t}", 5)):
        idx.add(M, ep, Tier.GPU, c[:n], [(0, None)])
    got = {e: m.combined for e, m in idx.lookup(M, c).matches.items()}
    assert got == {"a|b": 11, "x\ny": 7, "{t}": 5}
    idx.close()


def test_a_batch_of_many_chains_is_exact_and_survives_lost_scripts(redis_cluster) -> None:
    """A vLLM step stores a few blocks of every running request in one batch: a tag per chain, whose
    holder calls go out in one pipeline. Masters that lost their scripts (SCRIPT FLUSH, as after a
    restart) get them loaded again and the batch still lands whole, for stores and removals."""
    idx = make_cluster_index(redis_cluster, anchor_depth=4)
    ref = MemoryIndex()
    chains = _chains(random.Random(11), 24, 10)
    for lo, hi in ((0, 3), (3, 6), (6, 10)):
        if lo == 3:
            for n in redis_cluster.nodes:
                n.client().script_flush()
        keys: list[int] = []
        starts: list[tuple[int, int | None]] = []
        for c in chains:
            starts.append((len(keys), c[lo - 1] if lo else None))
            keys += c[lo:hi]
        assert idx.add(M, "e0", Tier.GPU, keys, starts) == ref.add(M, "e0", Tier.GPU, keys, starts)
    assert len({idx.r.get_node_from_key(idx._hkey(f"{c[0]:016x}", M)).name for c in chains}) == 3
    for c in chains:
        assert _answer(idx.lookup(M, c)) == _answer(ref.lookup(M, c))
    for n in redis_cluster.nodes:
        n.client().script_flush()
    tails = [k for c in chains for k in c[7:]]
    assert idx.remove(M, "e0", Tier.GPU, tails) == ref.remove(M, "e0", Tier.GPU, tails)
    for c in chains:
        assert _answer(idx.lookup(M, c)) == _answer(ref.lookup(M, c))
    assert idx.endpoint_blocks("e0") == ref.endpoint_blocks("e0") == 24 * 7
    idx.close()


def test_a_continuation_is_one_round_trip_and_a_wrong_guess_is_undone(redis_cluster) -> None:
    """An add whose parent is a chain tail this client stored sends the reverse-index call and the
    holder calls (tags guessed from the tail) in one pipeline. When the guess is wrong (here another
    replica removed the tail, so the next block is filed as a new root), the guessed holder fields
    are removed again and the blocks land where the two-step path puts them: answers, counts and a
    later clear are exact."""
    idx = make_cluster_index(redis_cluster, anchor_depth=4)
    ref = MemoryIndex()
    c = [(9 << 40) + i for i in range(1, 11)]

    def add(keys: list[int], parent: int | None) -> None:
        assert idx.add(M, "e0", Tier.GPU, keys, [(0, parent)]) == ref.add(M, "e0", Tier.GPU, keys, [(0, parent)])

    add(c[:3], None)
    trips: list[str] = []
    pipelined, call = idx._pipelined_calls, idx._call
    idx._pipelined_calls = lambda calls: trips.append("pipeline") or pipelined(calls)  # type: ignore[method-assign]
    idx._call = lambda fn, *a, **kw: trips.append(getattr(fn, "__name__", "script")) or call(fn, *a, **kw)  # type: ignore[method-assign]
    add(c[3:6], c[2])   # crosses the anchor depth: two tags, still one round trip
    assert trips == ["pipeline", "execute"]
    idx._pipelined_calls, idx._call = pipelined, call  # type: ignore[method-assign]
    other = RedisClusterIndex(redis_cluster.url, namespace=idx.namespace, anchor_depth=4)
    assert other.remove(M, "e0", Tier.GPU, [c[5]]) == ref.remove(M, "e0", Tier.GPU, [c[5]]) == 1
    add(c[6:8], c[5])   # this client still has c[5] as a tail: its guess is the anchor's tag
    anchor = idx._hkey(f"{c[4]:016x}", M)
    assert idx.r.hget(anchor, c[6].to_bytes(8, "big")) is None
    for chain in (c, c[6:], c[:5]):
        assert _answer(idx.lookup(M, chain)) == _answer(ref.lookup(M, chain))
    assert idx.endpoint_blocks("e0") == ref.endpoint_blocks("e0") == 7
    assert idx.clear_endpoint("e0") == ref.clear_endpoint("e0") == 7
    assert idx.lookup(M, c[6:]).matches == {} and idx.lookup(M, c).matches == {}
    other.close()
    idx.close()
