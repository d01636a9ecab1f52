"""The sim block manager against vLLM's own KVCacheManager, driven in-process.

vLLM's v1 KV cache manager is pure Python, so the same request sequence is fed
to both and every observable is compared: hits, allocation success, the KV
event stream (BlockStored/BlockRemoved, in order) and the free-queue
(eviction) order.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.worker.engine.sim import block_manager
from kvmesh.worker.engine.sim.block_manager import BlockManager, Removed, Stored

pytestmark = pytest.mark.timeout(120)


class VllmSide:
    """vLLM's KVCacheManager + Request objects, used the way its scheduler uses them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        # Imported here, not at collection: importing vLLM takes seconds, and the test tier
        # without vLLM then never pays for it (`make test` runs this file in the vLLM tier's process).
        vllm_kcm = pytest.importorskip("vllm.v1.core.kv_cache_manager")
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256_cbor)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        self.m = vllm_kcm.KVCacheManager(cfg, max_model_len=1 << 16, scheduler_block_size=block_size,
                                         hash_block_size=block_size, enable_caching=True,
                                         enable_kv_cache_events=True)
        self.hasher = get_request_block_hasher(block_size, sha256_cbor)
        self.SamplingParams = SamplingParams
        self.reqs: dict[str, object] = {}

    def new(self, rid: str, tokens: list[int], salt: str | None):
        from vllm.v1.request import Request

        r = Request(rid, tokens, self.SamplingParams(max_tokens=64), None, block_hasher=self.hasher,
                    cache_salt=salt)
        self.reqs[rid] = r
        return r

    def admit(self, r) -> tuple[int, bool]:
        blocks, n, _ = self.m.get_computed_blocks(r)
        ok = self.m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None
        if ok:
            r.num_computed_tokens = r.num_tokens
        return n, ok

    def decode(self, r, tok: int) -> bool:
        r.append_output_token_ids(tok)
        ok = self.m.allocate_slots(r, 1) is not None
        if ok:
            r.num_computed_tokens += 1
        return ok

    def free(self, r) -> None:
        self.m.free(r)

    def events(self) -> list[tuple]:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[tuple] = []
        for e in self.m.block_pool.take_events():
            if isinstance(e, BlockStored):
                out.append(("stored", list(e.block_hashes), e.parent_block_hash, len(e.token_ids)))
            elif isinstance(e, BlockRemoved):
                out.extend(("removed", h) for h in e.block_hashes)
        return out

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]

    @staticmethod
    def keys(r) -> list[int]:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return [maybe_convert_block_hash(h) for h in r.block_hashes]


class SimSide:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.ntok: dict[str, int] = {}

    def admit(self, rid: str, keys: list[int], num_tokens: int) -> tuple[int, bool]:
        hit = self.bm.find_longest_hit(keys, num_tokens)
        ok = self.bm.allocate(rid, num_tokens, hit)
        if ok:
            self.bm.cache_blocks(rid, keys, num_tokens)
            self.ntok[rid] = num_tokens
        return len(hit) * self.bm.block_size, ok

    def decode(self, rid: str, keys: list[int]) -> bool:
        n = self.ntok[rid] + 1
        ok = self.bm.allocate(rid, n)
        if ok:
            self.bm.cache_blocks(rid, keys, n)
            self.ntok[rid] = n
        return ok

    def events(self) -> list[tuple]:
        out: list[tuple] = []
        for e in self.bm.take_events():
            if isinstance(e, Stored):
                out.append(("stored", e.block_hashes, e.parent_block_hash, e.token_end - e.token_start))
            elif isinstance(e, Removed):
                out.append(("removed", e.block_hash))
        return out


def _workload(seed: int, n: int, block_size: int) -> list[tuple[str, list[int], str | None, int]]:
    """Shared-prefix mix: a few long prefixes, random suffixes, some salted, some decode."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(block_size * rng.randint(1, 6))] for _ in range(4)]
    out: list[tuple[str, list[int], str | None, int]] = []
    for i in range(n):
        if out and rng.random() < 0.25:
            # An exact repeat of a recent prompt: while both are live, the repeat's capped
            # hit leaves its last block to recompute, giving vLLM's duplicate cached blocks.
            _, p, salt, _ = rng.choice(out[-4:])
            out.append((f"r{i}", list(p), salt, rng.randint(0, block_size + 3)))
            continue
        p = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        n_suffix = block_size * rng.randint(1, 3) if rng.random() < 0.3 else rng.randint(1, block_size * 4)
        p += [rng.randrange(32000) for _ in range(n_suffix)]
        salt = "tenant-b" if rng.random() < 0.15 else None
        out.append((f"r{i}", p, salt, rng.randint(0, block_size + 3)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("queue_slack", [None, 0])
def test_eviction_and_events_match_vllm(seed: int, queue_slack: int | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bs, nb = 16, 24
    v = VllmSide(nb, bs)
    s = SimSide(nb, bs)
    compactions = 0
    if queue_slack is not None:
        # The free queue drops its stale entries (blocks hit while free) as soon as they
        # outnumber the free blocks: the order it keeps must not change.
        monkeypatch.setattr(block_manager, "_QUEUE_SLACK", queue_slack)
        make_deque = block_manager.deque

        def counted(*args: object) -> object:
            nonlocal compactions
            compactions += 1
            return make_deque(*args)

        monkeypatch.setattr(block_manager, "deque", counted)
    rng = random.Random(seed + 100)
    live: list[str] = []
    saw_removed = False
    for rid, toks, salt, n_decode in _workload(seed, 60, bs):
        r = v.new(rid, toks, salt)
        v_hit, v_ok = v.admit(r)
        s_hit, s_ok = s.admit(rid, v.keys(r), r.num_tokens)
        assert (v_hit, v_ok) == (s_hit, s_ok), rid
        if not v_ok:
            v.free(r)
            s.bm.free(rid)
        else:
            for _ in range(n_decode):
                tok = rng.randrange(32000)
                v_ok = v.decode(r, tok)
                assert s.decode(rid, v.keys(r)) == v_ok
                if not v_ok:
                    break
            live.append(rid)
        # Finish some of the live requests (random order: interleaved lifetimes).
        while live and (len(live) > 3 or rng.random() < 0.5):
            done = live.pop(rng.randrange(len(live)))
            v.free(v.reqs[done])
            assert s.bm.free(done)
        ve, se = v.events(), s.events()
        assert se == ve, rid
        saw_removed |= any(e[0] == "removed" for e in ve)
        assert s.bm.free_queue() == v.free_queue(), rid
        assert s.bm.usage == pytest.approx(v.m.block_pool.get_usage())
    assert saw_removed, "workload too small to exercise eviction"
    assert queue_slack is None or compactions > 0


def test_event_stream_consistency() -> None:
    """Every BlockRemoved refers to a hash stored earlier and not yet removed."""
    bs = 16
    s = SimSide(20, bs)
    v = VllmSide(20, bs)
    stored: dict[int, int] = {}
    for rid, toks, salt, _ in _workload(7, 80, bs):
        r = v.new(rid, toks, salt)
        v.admit(r)
        v.free(r)
        _, ok = s.admit(rid, v.keys(r), r.num_tokens)
        s.bm.free(rid)
        for e in s.events():
            if e[0] == "stored":
                for h in e[1]:
                    stored[h] = stored.get(h, 0) + 1
            else:
                assert stored.get(e[1], 0) > 0, f"removal of never-stored block {e[1]:x}"
                stored[e[1]] -= 1


def test_tail_blocks_evicted_before_head_and_lru() -> None:
    bm = BlockManager(num_blocks=9, block_size=4)
    a = [101, 102, 103]
    assert bm.allocate("a", 12)
    bm.cache_blocks("a", a, 12)
    bm.free("a")
    assert bm.allocate("b", 8)          # two uncached blocks: takes never-used ones first
    bm.cache_blocks("b", [201, 202], 8)
    bm.free("b")
    bm.take_events()
    assert bm.allocate("c", 4 * 6)      # 6 blocks: 3 never used, then a's tail, a's middle, a's head
    removed = [e.block_hash for e in bm.take_events() if isinstance(e, Removed)]
    assert removed == [103, 102, 101]
    bm.free("c")


def test_hit_capped_one_token_short_and_cancel_frees() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    keys = [1, 2, 3]
    assert bm.allocate("a", 12)
    bm.cache_blocks("a", keys, 12)
    bm.free("a")
    assert len(bm.find_longest_hit(keys, 12)) == 2   # last token recomputed
    assert len(bm.find_longest_hit(keys, 13)) == 3
    free_before = bm.num_free_blocks
    hit = bm.find_longest_hit(keys, 13)
    assert bm.allocate("b", 13, hit)
    assert bm.num_free_blocks == free_before - 4
    bm.free("b")
    assert bm.num_free_blocks == free_before
    assert bm.free("b") is False


def test_duplicate_blocks_like_vllm() -> None:
    """Two live requests with the same block-aligned prompt: the repeat recomputes (and
    caches) its last block again; evicting either copy emits BlockRemoved, as in vLLM."""
    bs = 16
    v = VllmSide(12, bs)
    s = SimSide(12, bs)
    toks = list(range(2 * bs))
    ra, rb = v.new("a", toks, None), v.new("b", toks, None)
    for rid, r in (("a", ra), ("b", rb)):
        assert v.admit(r) == s.admit(rid, v.keys(r), r.num_tokens)
    assert s.bm._dups, "expected a duplicate cached block"
    v.free(ra), v.free(rb)
    s.bm.free("a"), s.bm.free("b")
    assert s.events() == v.events()
    assert s.bm.free_queue() == v.free_queue()
    # Fill the cache with other blocks so both copies get evicted.
    rc = v.new("c", list(range(1000, 1000 + 11 * bs - 1)), None)
    assert v.admit(rc) == s.admit("c", v.keys(rc), rc.num_tokens)
    ve, se = v.events(), s.events()
    assert se == ve
    assert sum(1 for e in ve if e[0] == "removed") == 3


@pytest.mark.parametrize(("seed", "drop_log_max"), [(5, None), (6, None), (7, None), (8, 3)])
def test_repeated_lookups_of_one_prompt_match_a_fresh_lookup(seed: int, drop_log_max: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """find_longest_hit remembers a prompt's known prefix between calls (by list identity); after
    any mix of caching, eviction, duplicate blocks and reset, it answers as a first lookup would
    (also when the eviction log it checks is cut short)."""
    if drop_log_max is not None:
        monkeypatch.setattr(block_manager, "_DROP_LOG_MAX", drop_log_max)
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=24, block_size=bs)
    shared = [rng.randrange(1 << 30) for _ in range(6)]
    prompts = [shared[:rng.randint(0, 6)] + [rng.randrange(1 << 30) for _ in range(rng.randint(1, 8))]
               for _ in range(6)]
    prompts += [list(prompts[0]), list(prompts[1])]   # equal content, other lists: duplicate blocks
    live: dict[str, list[int]] = {}
    resumed = checked = 0
    for step in range(600):
        keys = rng.choice(prompts)
        op = rng.random()
        if op < 0.45 and len(live) < 4:
            rid = f"r{step}"
            n = len(keys) * bs - rng.randint(0, bs - 1)
            if bm.allocate(rid, n, bm.find_longest_hit(keys, n)):
                bm.cache_blocks(rid, keys, n)
                live[rid] = keys
        elif op < 0.9 and live:
            bm.free(rng.choice(sorted(live)))
            live = {r: k for r, k in live.items() if bm.has_request(r)}
        elif op < 0.92 and not live:
            assert bm.reset()
        for p in prompts:
            n = len(p) * bs
            before = bm._hits.get(id(p))
            got = bm.find_longest_hit(p, n)
            resumed += before is not None and before[1] == bm._dropped
            # Evictions since the last lookup, checked against the remembered prefix.
            checked += before is not None and bm._log_base <= before[1] < bm._dropped
            assert got == bm.find_longest_hit(list(p), n), (step, p)
            assert bm.find_longest_hit(p, n - bs) == got[: max(0, (n - bs - 1) // bs)]   # a shorter cap
            # The free-block count it remembers per hit list answers as a fresh count does.
            need = bm.blocks_to_allocate("new", n, got)
            assert need == bm.blocks_to_allocate("new", n, list(got)) == bm.blocks_to_allocate("new", n, got)
    assert resumed > 100   # the remembered prefix was actually used
    assert checked > 10    # ... and carried across evictions
