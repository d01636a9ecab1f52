"""The synchronous routing core: scoring, policies, speculative co-location, split rule, hash cache, load view."""

from __future__ import annotations

import random

import pytest

from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.routing.hash_cache import HashCache, HashCacheConfig
from kvmesh.routing.load import LoadReport, LoadView
from kvmesh.routing.pd_split import SplitConfig, decide_split
from kvmesh.routing.policy import NoEndpointError
from kvmesh.routing.registry import available_policies, make_policy
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh.routing.scoring import ScoringConfig, tier_split
from kvmesh.routing.types import EndpointView, Matches, RouteRequest, TierMatch

BS = 16
pytestmark = pytest.mark.timeout(60)


def _core(n: int = 4, policy: str = "precise", **kw) -> RouterCore:
    core = RouterCore(RouterCoreConfig(policy=policy, block_size=BS, **kw))
    for i in range(n):
        core.set_endpoint(EndpointView(f"e{i}", f"127.0.0.1:{9000 + i}", "m"))
    return core


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def _req(core: RouterCore, tokens: list[int], rid: str, session: str = "") -> RouteRequest:
    keys = core.chain(tokens, None, session).keys
    return RouteRequest(rid, "m", keys, len(tokens), BS, session)


def test_registry_has_all_policies():
    assert {"precise", "approx", "session", "least_load", "round_robin", "random"} <= set(available_policies())
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")


def test_tier_credits_take_best_tier_per_block():
    c = tier_split(TierMatch(gpu=4), TierMatch(cpu=10, disk=20), cap_blocks=100)
    assert (c.gpu, c.cpu, c.disk) == (4, 6, 10) and c.offload == 16
    # Speculative entries count as the engine's own cache (free), and are reported apart.
    c = tier_split(TierMatch(gpu=2, speculative=5), TierMatch(cpu=3), cap_blocks=100)
    assert (c.gpu, c.cpu, c.speculative) == (5, 0, 3)
    # The engine never reports the last token as cached: the cap bounds every tier.
    c = tier_split(TierMatch(gpu=10), TierMatch(cpu=20), cap_blocks=9)
    assert c.gpu == 9 and c.offload == 0
    # Without an offload tier the store's blocks are worth nothing.
    assert tier_split(TierMatch(gpu=4), TierMatch(cpu=10), cap_blocks=100, offload_enabled=False).offload == 0
    # Each tier is priced at what it really costs: GPU free, restore per token, a miss recomputed.
    cfg = ScoringConfig()
    assert cfg.cpu_restore_s_per_token < cfg.disk_restore_s_per_token < cfg.prefill_s_per_token


def test_precise_prefers_the_endpoint_holding_the_prefix():
    core = _core()
    toks = _tokens(1000)
    req = _req(core, toks, "r1")
    d = core.decide(req, Matches(per_endpoint={"e2": TierMatch(gpu=40), "e1": TierMatch(gpu=10)}), now=0.0)
    assert d.endpoint_id == "e2"
    assert d.predicted_cached_tokens_gpu == 40 * BS
    assert d.uncached_tokens == 1000 - 40 * BS


def test_offload_blocks_are_credited_and_predicted():
    core = _core()
    toks = _tokens(1000)
    req = _req(core, toks, "r1")
    d = core.decide(req, Matches(per_endpoint={"e1": TierMatch(gpu=10)}, store=TierMatch(cpu=50)), now=0.0)
    assert d.endpoint_id == "e1"
    assert d.predicted_cached_tokens_gpu == 10 * BS and d.predicted_cached_tokens_offload == 40 * BS


def test_burst_of_siblings_colocates_via_speculative_entries():
    core = _core(4)
    shared = _tokens(2048, seed=1)
    picks = []
    for i in range(8):
        req = _req(core, shared + _tokens(100, seed=100 + i), f"s{i}")
        # No engine events yet: the index knows nothing.
        d = core.decide(req, Matches(), now=0.01 * i)
        core.on_routed(req, d, now=0.01 * i)
        picks.append(d.endpoint_id)
    assert len(set(picks)) == 1, picks


def test_speculative_entries_expire():
    core = _core(2, speculative_ttl_s=2.0)
    toks = _tokens(1000)
    r1 = _req(core, toks, "a")
    d1 = core.decide(r1, Matches(), now=0.0)
    core.on_routed(r1, d1, now=0.0)
    core.on_finished(r1, d1, now=0.1)
    r2 = _req(core, toks, "b")
    assert core.decide(r2, Matches(), now=1.0).predicted_cached_tokens > 0
    assert core.decide(r2, Matches(), now=5.0).predicted_cached_tokens == 0


def test_a_speculative_entry_the_index_contradicts_claims_nothing():
    """A finished turn's context, reported and then evicted: the index's word stands.

    Live on 114k-token GPUs (kv-cache-tester through `kvmesh up`), the next turn of an agent
    came 0.6 s after its last and found its context evicted; the entry written at the end of
    the last turn still claimed it, and the router predicted 85,824 cached tokens for 8,768.
    """
    core = _core(2, speculative_ttl_s=2.0)
    toks = _tokens(1000)
    r1 = _req(core, toks, "t1", session="s")
    d1 = core.decide(r1, Matches(per_endpoint={"e0": TierMatch(gpu=30)}), now=0.0)
    core.on_routed(r1, d1, now=0.0)
    out = _tokens(100, seed=7)
    core.on_finished(r1, d1, now=0.5, prompt_tokens=toks, output_tokens=out)
    r2 = _req(core, toks + out + _tokens(50, seed=8), "t2", session="s")
    n_prompt = len(r1.keys)
    # The index still holds the whole prompt: the entry adds the output's blocks it may not show yet.
    held = core.decide(r2, Matches(per_endpoint={d1.endpoint_id: TierMatch(gpu=n_prompt)}), now=0.6)
    assert held.predicted_cached_tokens_gpu == (len(toks) + len(out) - 1) // BS * BS
    # The index shows the prompt evicted down to the shared 8 blocks: only those are predicted.
    gone = core.decide(r2, Matches(per_endpoint={d1.endpoint_id: TierMatch(gpu=8)}), now=0.6)
    assert gone.predicted_cached_tokens_gpu == 8 * BS


def test_misses_do_not_pile_onto_a_hot_endpoint():
    core = _core(3)
    for eid, q in (("e0", 0), ("e1", 1), ("e2", 30)):
        core.load.update(eid, LoadReport(running=q, waiting=0, received_at=0.0))
    toks = _tokens(600)
    req = _req(core, toks, "r")
    # e2 holds a small part of the prompt but is overloaded: the guard excludes it.
    d = core.decide(req, Matches(per_endpoint={"e2": TierMatch(gpu=5)}), now=0.1)
    assert d.endpoint_id == "e0"
    hot = [c for c in d.candidates if c.endpoint_id == "e2"][0]
    assert hot.hot and hot.excluded == "hot"
    # A big hit is still worth taking on the hot endpoint.
    d = core.decide(req, Matches(per_endpoint={"e2": TierMatch(gpu=36)}), now=0.1)
    assert d.endpoint_id == "e2"


def test_misses_spread_by_optimistic_inflight_counting():
    core = _core(4)
    picks = []
    for i in range(8):
        req = _req(core, _tokens(300, seed=i), f"r{i}")
        d = core.decide(req, Matches(), now=0.0)
        core.on_routed(req, d, now=0.0)
        picks.append(d.endpoint_id)
    assert sorted(picks.count(f"e{i}") for i in range(4)) == [2, 2, 2, 2]


def test_session_affinity_breaks_ties():
    core = _core(4)
    r = _req(core, _tokens(40), "r", session="s")
    d = core.decide(r, Matches(), now=0.0)
    core.on_routed(r, d, 0.0)
    core.on_finished(r, d, 0.1)
    other = [e for e in core.endpoints if e != d.endpoint_id][0]
    core.load.update(d.endpoint_id, LoadReport(received_at=1.0))
    core.load.update(other, LoadReport(received_at=1.0))
    r2 = _req(core, _tokens(40, seed=9), "r2", session="s")
    assert core.decide(r2, Matches(), now=1.1).endpoint_id == d.endpoint_id


def test_precise_falls_back_to_approx_without_index():
    core = _core(3)
    toks = _tokens(800)
    r1 = _req(core, toks, "a")
    d1 = core.decide(r1, Matches(), now=0.0)
    core.on_routed(r1, d1, 0.0)
    core.on_finished(r1, d1, 0.1)
    r2 = _req(core, toks + _tokens(100, 5), "b")
    d2 = core.decide(r2, None, now=100.0)   # long after speculative TTL; indexer down
    assert d2.fallback and d2.endpoint_id == d1.endpoint_id
    assert d2.predicted_cached_tokens == 800 // BS * BS


def test_a_cold_fallback_learns_nothing_and_changes_no_decision_with_an_index():
    """``warm_fallback=False`` (the simulator, whose index always answers): the approx
    fallback is not trained, and every decision made with the index's answer is the same."""
    warm, cold = _core(3), _core(3, warm_fallback=False)
    for i in range(12):
        toks = _tokens(200 + 40 * (i % 3), seed=i % 4)
        picks = []
        for core in (warm, cold):
            r = _req(core, toks, f"r{i}", session=f"s{i % 2}")
            d = core.decide(r, Matches(), now=float(i))
            core.on_routed(r, d, float(i))
            core.on_finished(r, d, float(i) + 0.5)
            picks.append((d.endpoint_id, d.predicted_cached_tokens, d.reason))
        assert picks[0] == picks[1]
    keys = _req(warm, _tokens(200, seed=0), "q").keys
    assert warm.default_policy.fallback.index.match(keys)   # type: ignore[attr-defined]
    assert not cold.default_policy.fallback.index.match(keys)   # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["approx", "session", "least_load", "round_robin", "random"])
def test_simple_policies_route_and_fail_cleanly(name):
    core = _core(3, policy=name)
    seen = set()
    for i in range(9):
        r = _req(core, _tokens(100, seed=i), f"r{i}", session="s" if name == "session" else "")
        d = core.decide(r, Matches(), now=float(i))
        core.on_routed(r, d, float(i))
        if name != "least_load":   # least_load spreads only what is still in flight
            core.on_finished(r, d, float(i))
        seen.add(d.endpoint_id)
    if name == "session":
        assert len(seen) == 1
    elif name in ("round_robin", "least_load"):
        assert len(seen) == 3
    for eid in list(core.endpoints):
        core.remove_endpoint(eid)
    with pytest.raises(NoEndpointError):
        core.decide(_req(core, _tokens(10), "x"), Matches(), now=0.0)


@pytest.mark.parametrize("name,moves", [("session", 0), ("round_robin", 5)])
def test_a_sent_decision_says_whether_its_session_moved(name, moves):
    """``RouterCore.on_routed`` marks ``Decision.moved`` (kvmesh.routing.moves), the one mark the
    simulator's report and the live router's counters read: sticky ``session`` never moves a
    session's turns, round robin moves each of them after the first over 3 endpoints."""
    core = _core(3, policy=name)
    marks = []
    for i in range(6):
        r = _req(core, _tokens(100 + 10 * i, seed=7), f"r{i}", session="s")
        d = core.decide(r, Matches(), now=float(i))
        assert not d.moved   # not before it is sent
        core.on_routed(r, d, float(i))
        core.on_finished(r, d, float(i))
        marks.append(d.moved)
    assert not marks[0] and sum(marks) == moves


def test_a_moved_decision_reports_what_its_previous_endpoint_held():
    """``Decision.given_up_tokens``: of a moved turn, the cached tokens the policy's view predicted
    on the session's previous endpoint beyond the chosen one's prediction, the store's restorable
    blocks counting alike on both (round robin over two endpoints moves every turn)."""
    core = _core(2, policy="round_robin")
    toks = _tokens(1000, seed=3)
    r0 = _req(core, toks, "r0", session="s")
    d0 = core.decide(r0, Matches(), now=0.0)
    core.on_routed(r0, d0, 0.0)
    assert d0.previous_cached_tokens == 0 and d0.given_up_tokens == 0   # a first turn gave up nothing
    home = d0.endpoint_id
    other = "e1" if home == "e0" else "e0"
    matches = Matches(per_endpoint={home: TierMatch(gpu=40), other: TierMatch(gpu=10)}, store=TierMatch(cpu=25))
    r1 = _req(core, toks, "r1", session="s")
    d1 = core.decide(r1, matches, now=1.0)
    assert d1.endpoint_id == other
    assert d1.previous_cached_tokens == 40 * BS and d1.predicted_cached_tokens == 25 * BS
    assert d1.given_up_tokens == 0        # not sent yet: not a move yet
    core.on_routed(r1, d1, 1.0)
    assert d1.moved and d1.given_up_tokens == 15 * BS
    # Moving to where more is cached gives up nothing.
    r2 = _req(core, toks, "r2", session="s")
    d2 = core.decide(r2, Matches(per_endpoint={other: TierMatch(gpu=5), home: TierMatch(gpu=30)}), now=2.0)
    core.on_routed(r2, d2, 2.0)
    assert d2.endpoint_id == home and d2.moved
    assert d2.previous_cached_tokens == 5 * BS and d2.given_up_tokens == 0


def test_policy_options_reach_only_their_policy():
    """A seeded ``random`` decides the same on two cores (the simulator's reproducibility);
    a policy's own option overrides the shared one; other policies get none of them."""
    def picks(seed: int) -> list[str]:
        core = _core(8, policy="random", policy_options={"random": {"seed": seed, "report_candidates": 2}})
        out = []
        for i in range(40):
            r = _req(core, _tokens(50, seed=i), f"r{i}")
            d = core.decide(r, Matches(), now=float(i))
            assert len(d.candidates) == 2          # the policy's option, not the core's 16
            out.append(d.endpoint_id)
        assert core.policy("session").report_candidates == RouterCoreConfig().report_candidates
        return out

    first = picks(7)
    assert picks(7) == first and len(set(first)) > 1
    assert picks(8) != first


def test_approx_remembers_only_its_own_decisions():
    core = _core(3, policy="approx")
    toks = _tokens(500)
    r1 = _req(core, toks, "a")
    d1 = core.decide(r1, Matches(per_endpoint={"e2": TierMatch(gpu=30)}), now=0.0)
    core.on_routed(r1, d1, 0.0)
    core.on_finished(r1, d1, 0.0)
    r2 = _req(core, toks, "b")
    d2 = core.decide(r2, None, now=50.0)
    assert d2.endpoint_id == d1.endpoint_id and d2.predicted_cached_tokens == (499 // BS) * BS


def test_split_rule_threshold_and_room():
    pre = [EndpointView("p0", role="prefill")]
    from kvmesh.routing.load import EffectiveLoad

    cfg = SplitConfig(enabled=True, threshold_tokens=1000, prefill_max_queue=2)
    assert not decide_split(999, 2000, pre, {"p0": EffectiveLoad()}, cfg).split
    s = decide_split(1000, 2000, pre, {"p0": EffectiveLoad()}, cfg)
    assert s.split and s.prefill_endpoint == "p0" and s.inputs["uncached_tokens"] == 1000
    busy = decide_split(5000, 6000, pre, {"p0": EffectiveLoad(running=2)}, cfg)
    assert not busy.split and "room" in busy.reason
    assert not decide_split(5000, 6000, pre, {}, SplitConfig(enabled=False)).split


def test_load_view_staleness_and_optimistic_inflight():
    lv = LoadView(staleness_s=1.0)
    lv.update("e", LoadReport(running=3, waiting=1, waiting_prefill_tokens=100, received_at=10.0))
    lv.on_sent("e", "old", 50, now=9.0)      # before the report: assumed included in it
    lv.on_sent("e", "new", 70, now=10.5)     # after: counted on top
    eff = lv.effective("e", now=10.6)
    assert not eff.stale and eff.queue == 5 and eff.prefill_tokens == 170
    lv.on_first_token("new")
    assert lv.effective("e", now=10.6).prefill_tokens == 100
    # "old" was in the report; once its first token is out, its prefill is no longer queued there.
    lv.on_first_token("old")
    assert lv.effective("e", now=10.6).prefill_tokens == 50
    stale = lv.effective("e", now=20.0)
    assert stale.stale and stale.queue == 2      # only the router's own in-flight requests
    lv.on_finished("new")
    lv.on_finished("old")
    assert lv.effective("e", now=20.0).queue == 0


# ---------------------------------------------------------------- incremental hashing


@pytest.mark.parametrize("verify", ["sampled", "full"])
def test_hash_cache_extends_sessions_incrementally(verify):
    h = BlockHasher("sha256_cbor", BS)
    hc = HashCache(h, HashCacheConfig(verify=verify))
    toks = _tokens(1000)
    assert hc.chain(toks, None, "s").hashed_blocks == 1000 // BS
    for turn in range(5):
        toks = toks + _tokens(150, seed=turn + 10)
        res = hc.chain(toks, None, "s")
        assert res.keys == h.block_keys(toks)
        assert res.source == "session"
        assert res.hashed_blocks <= 150 // BS + 1


def test_hash_cache_recognises_content_without_session():
    h = BlockHasher("sha256_cbor", BS)
    hc = HashCache(h)
    base = _tokens(1600)
    hc.chain(base)
    ext = base + _tokens(64, 3)
    res = hc.chain(ext)
    assert res.source == "content" and res.reused_blocks == 100 and res.keys == h.block_keys(ext)


def test_hash_cache_divergent_siblings_and_edits_full_verify():
    h = BlockHasher("sha256", BS)
    hc = HashCache(h, HashCacheConfig(verify="full"))
    base = _tokens(1600)
    hc.chain(base)
    edited = list(base)
    edited[800] = (edited[800] + 1) % 32000
    res = hc.chain(edited)
    assert res.reused_blocks == 800 // BS and res.keys == h.block_keys(edited)


def test_hash_cache_salt_first_block_and_lora():
    h = BlockHasher("sha256_cbor", BS)
    hc = HashCache(h)
    toks = _tokens(640)
    plain = hc.chain(toks, None, "s").keys
    salted = ExtraKeys(cache_salt="tenant-a")
    a = hc.chain(toks + _tokens(64, 1), salted, "s")
    assert a.reused_blocks == 0, "a salted prompt must never reuse unsalted hashes"
    assert a.keys == h.block_keys(toks + _tokens(64, 1), salted)
    assert not set(a.keys) & set(plain)
    b = hc.chain(toks + _tokens(128, 1), salted, "s")
    assert b.reused_blocks == 44 and b.keys == h.block_keys(toks + _tokens(128, 1), salted)
    lora = ExtraKeys(lora_name="ad", lora_path="/p")
    c = hc.chain(toks, lora)
    assert c.keys == h.block_keys(toks, lora) and c.reused_blocks == 0


def test_hash_cache_is_bounded():
    h = BlockHasher("sha256_cbor", BS)
    hc = HashCache(h, HashCacheConfig(max_blocks=500))
    for i in range(20):
        hc.chain(_tokens(1600, seed=i), None, f"s{i}")
        assert hc.blocks <= 500 or len(hc) == 1
    assert len(hc) <= 5


def test_hash_cache_is_bounded_in_bytes_and_the_estimate_holds():
    """Ended sessions keep their last chain until it is the oldest: the byte bound, checked
    against what the chains really keep alive (token lists as a JSON body decodes them)."""
    import gc
    import json

    from tests.fixtures.memory import least_traced_bytes

    h = BlockHasher("sha256_cbor", BS)
    bodies = [json.dumps(_tokens(1600, seed=i)) for i in range(40)]
    hc = HashCache(h, HashCacheConfig(max_bytes=1 << 20))

    def fill(traced) -> int:
        hc.clear()
        gc.collect()
        base = traced()
        for i, body in enumerate(bodies):
            hc.chain(json.loads(body), None, f"s{i}")
            assert hc.nbytes <= 1 << 20 or len(hc) == 1
        hc.release()
        gc.collect()
        return traced() - base

    kept = least_traced_bytes(fill, lambda got: got <= hc.nbytes * 1.3)
    assert 5 <= len(hc) < 40
    # The estimate is of the right size: not below what is kept (that would be no bound).
    assert hc.nbytes * 0.6 <= kept <= hc.nbytes * 1.3, (kept, hc.nbytes)


def test_hash_cache_takes_protobuf_fields_and_concat_views():
    from kvmesh.routing.hash_cache import ConcatTokens
    from kvmesh_api.common.v1 import common_pb2

    h = BlockHasher("sha256_cbor", BS)
    hc = HashCache(h)
    toks = _tokens(1000)
    field = common_pb2.TokenIds(ids=toks).ids
    assert hc.chain(field, None, "s").keys == h.block_keys(toks)
    out = _tokens(40, 9)
    view = ConcatTokens(field, out)
    assert len(view) == 1040 and view[999] == toks[999] and view[1000] == out[0] and view[-1] == out[-1]
    assert view[990:1010] == toks[990:] + out[:10]
    res = hc.chain(view, None, "s")
    assert res.keys == h.block_keys(toks + out) and res.source == "session" and res.reused_blocks == 1000 // BS


# ---------------------------------------------------------------- estimated-TTFT scoring


def test_busy_home_loses_to_an_idle_endpoint_that_restores_from_offload():
    core = _core(4)
    n = 20_000
    cap = (n - 1) // BS
    req = _req(core, _tokens(n), "r", session="s")
    home = TierMatch(gpu=cap)
    # The session's home holds its whole context but has 12k tokens of prefill queued (~3 s).
    core.load.update("e0", LoadReport(running=2, waiting=3, waiting_prefill_tokens=12_000, received_at=0.0))
    for eid in ("e1", "e2", "e3"):
        core.load.update(eid, LoadReport(received_at=0.0))
    # Nowhere else holds it: recomputing 20k tokens costs more than the home's queue.
    d = core.decide(req, Matches(per_endpoint={"e0": home}), now=0.1)
    assert d.endpoint_id == "e0"
    # The offload store holds it too: a restore (µs per token) beats the home's queue (seconds).
    d = core.decide(req, Matches(per_endpoint={"e0": home}, store=TierMatch(cpu=cap)), now=0.1)
    assert d.endpoint_id != "e0"
    assert d.predicted_cached_tokens_offload == cap * BS and d.predicted_cached_tokens_gpu == 0
    by = {c.endpoint_id: c for c in d.candidates}
    assert by["e0"].wait_s > by[d.endpoint_id].own_s > 0
    # Without an offload tier the store's blocks are not credited and the home keeps it.
    nooff = _core(4, offload_enabled=False)
    nooff.load = core.load
    d = nooff.decide(req, Matches(per_endpoint={"e0": home}, store=TierMatch(cpu=cap)), now=0.1)
    assert d.endpoint_id == "e0"
    # An idle home still wins over a restore: the GPU hit is free.
    core.load.update("e0", LoadReport(received_at=0.2))
    d = core.decide(req, Matches(per_endpoint={"e0": home}, store=TierMatch(cpu=cap)), now=0.3)
    assert d.endpoint_id == "e0" and d.predicted_cached_tokens_gpu == cap * BS


def test_new_sessions_spread_on_ties_instead_of_piling_on_the_first_endpoint():
    core = _core(4)
    # Same instant, nothing cached, no load: every endpoint ties. The tie-break is a stable
    # hash of the session, not the endpoint id (which would send all of them to e0).
    picks = {}
    for i in range(16):
        req = _req(core, _tokens(300, seed=i), f"r{i}", session=f"s{i}")
        picks[f"s{i}"] = core.decide(req, Matches(), now=0.0).endpoint_id
    assert len(set(picks.values())) >= 3, picks
    # Stable: the same session ties the same way again.
    again = _req(core, _tokens(300, seed=3), "r3b", session="s3")
    assert core.decide(again, Matches(), now=0.0).endpoint_id == picks["s3"]
    # Load outranks the hash: with e2 the only idle endpoint, every new session goes there.
    for eid in core.endpoints:
        core.load.update(eid, LoadReport(running=1, waiting_prefill_tokens=4000, received_at=0.0))
    core.load.update("e2", LoadReport(received_at=0.0))
    for i in range(4):
        req = _req(core, _tokens(300, seed=50 + i), f"q{i}", session=f"q{i}")
        assert core.decide(req, Matches(), now=0.1).endpoint_id == "e2"


def test_decode_load_of_long_contexts_is_weighed():
    core = _core(2)
    # Same queue length, but e0 runs a long context: every decode step there reads its KV.
    core.load.update("e0", LoadReport(running=1, kv_usage=0.8, num_blocks=10_000, received_at=0.0))
    core.load.update("e1", LoadReport(running=1, kv_usage=0.01, num_blocks=10_000, received_at=0.0))
    for i in range(4):
        req = _req(core, _tokens(200, seed=i), f"r{i}", session=f"s{i}")
        assert core.decide(req, Matches(), now=0.1).endpoint_id == "e1"


@pytest.mark.parametrize("policy", ["precise", "approx"])
def test_burst_colocates_although_the_first_sibling_is_queued_there(policy):
    core = _core(4, policy=policy)
    for eid in core.endpoints:
        core.load.update(eid, LoadReport(received_at=0.0))
    shared = _tokens(3000, seed=2)
    picks = []
    for i in range(8):
        req = _req(core, shared + _tokens(60, seed=200 + i), f"b{i}", session=f"agent-{i}")
        d = core.decide(req, Matches() if policy == "precise" else None, now=0.1 + 0.001 * i)
        core.on_routed(req, d, now=0.1 + 0.001 * i)
        picks.append(d.endpoint_id)
    # The first sibling's queued prefill computes the others' prefix: waiting for it is no
    # extra delay, so all of them follow it even though its queue counts in full.
    assert len(set(picks)) == 1, picks
    ld = core.load.effective(picks[0], now=0.2)
    assert ld.prefill_tokens >= 3000


def test_pending_overlap_counts_only_queued_prefill_of_the_shared_prefix():
    lv = LoadView()
    keys = list(range(1, 11))
    lv.on_sent("e", "a", 10 * BS - 4 * BS, now=0.0, keys=keys, num_tokens=10 * BS, cached_tokens=4 * BS)
    # A sibling sharing 7 leading blocks: blocks 4..6 are being computed for it on e.
    assert lv.pending_overlap(keys[:7] + [99, 98], BS) == {"e": 3 * BS}
    assert lv.pending_overlap([77, 78], BS) == {}
    lv.on_first_token("a")
    assert lv.pending_overlap(keys, BS) == {}


def _split_core(policy: str = "precise", prefill: tuple[str, ...] = ("p0", "p1"), **split) -> RouterCore:
    """Two decode endpoints and ``prefill`` endpoints, splitting from 100 uncached tokens."""
    core = _core(2, policy=policy, split=SplitConfig(enabled=True, threshold_tokens=100, **split))
    for p in prefill:
        core.set_endpoint(EndpointView(p, "", "m", role="prefill"))
    return core


def test_split_request_charges_its_prefill_to_the_prefill_endpoint_only():
    core = _split_core(prefill=("p0",))
    req = _req(core, _tokens(2000), "r")
    d = core.decide(req, Matches(), now=0.0)
    split = core.decide_split(d, req, now=0.0)
    assert split.split
    core.on_routed(req, d, now=0.0, split=split)
    ld = core.load.effective(d.endpoint_id, now=0.0)
    assert ld.queue == 1 and ld.prefill_tokens == 0


def test_split_stays_local_when_two_restores_of_a_long_context_cost_more():
    core = _split_core(prefill=("p0",))
    n = 200_000
    cached = (n - 3000) // BS
    req = _req(core, _tokens(n), "r", session="s")
    # The home holds 197k tokens on GPU and the store holds them too; 3k are new.
    m = Matches(per_endpoint={"e0": TierMatch(gpu=cached)}, store=TierMatch(cpu=cached))
    d = core.decide(req, m, now=0.0)
    assert d.endpoint_id == "e0" and d.uncached_tokens >= 100
    s = core.decide_split(d, req, now=0.0)
    # Splitting would restore 197k tokens on the prefill endpoint and 200k back on e0.
    assert not s.split and "TTFT" in s.reason and s.inputs["split_extra_ttft_s"] > 0
    # A fresh prompt with nothing cached splits: the decode endpoint stays free of prefill.
    fresh = _req(core, _tokens(3000, seed=5), "f")
    d = core.decide(fresh, Matches(), now=0.0)
    assert core.decide_split(d, fresh, now=0.0).split


def test_split_goes_to_the_prefill_endpoint_that_still_holds_the_prefix():
    core = _split_core()
    n = 8000
    req = _req(core, _tokens(n), "r", session="s")
    # No decode endpoint and no store holds the prompt any more; p1's GPU still holds 400 blocks.
    m = Matches(per_endpoint={"p1": TierMatch(gpu=400)})
    d = core.decide(req, m, now=0.0)
    assert d.uncached_tokens == n
    s = core.decide_split(d, req, now=0.0, matches=m)
    assert s.split and s.prefill_endpoint == "p1"
    assert s.inputs["prefill_uncached_tokens"] == n - 400 * BS
    # Without the index's answer the choice is by queue only (p0 first on a tie).
    assert core.decide_split(d, req, now=0.0).prefill_endpoint == "p0"
    # Load is charged where the prefill really runs: only its uncached part, on p1.
    core.on_routed(req, d, now=0.0, split=s)
    assert core.load.effective("p1", 0.0).prefill_tokens == n - 400 * BS
    assert core.load.effective(d.endpoint_id, 0.0).prefill_tokens == 0


@pytest.mark.parametrize("policy", ["session", "round_robin", "random", "least_load"])
def test_a_policy_that_predicts_nothing_splits_by_what_the_index_says_its_choice_holds(policy: str):
    core = _split_core(policy, survival_decay=0.0)
    n = 8000
    req = _req(core, _tokens(n), "r", session="s")
    d = core.decide(req, Matches(), now=0.0)
    assert d.predicted_cached_tokens == 0 and d.uncached_tokens == n   # the policy predicts nothing
    held = (n - 40) // BS   # the chosen endpoint holds all but the last 40 tokens
    m = Matches(per_endpoint={d.endpoint_id: TierMatch(gpu=held)})
    assert core.split_lookup(req)
    s = core.decide_split(d, req, now=0.0, matches=m)
    assert not s.split and s.inputs["uncached_tokens"] == n - held * BS and s.inputs["cached_from"] == "index"
    # The split's survival rule learns from that view, as from a policy's own prediction.
    assert d.predicted_cached_tokens == 0 and d.survival_predicted_tokens == held * BS
    # The other endpoint holding it does not matter: the choice is the policy's, the split is for it.
    other = next(e for e in ("e0", "e1") if e != d.endpoint_id)
    s = core.decide_split(d, req, now=0.0, matches=Matches(per_endpoint={other: TierMatch(gpu=held)}))
    assert s.split and s.inputs["uncached_tokens"] == n
    # What the store holds is restored on the decode endpoint as cheaply as on a prefill endpoint.
    s = core.decide_split(d, req, now=0.0, matches=Matches(store=TierMatch(cpu=held)))
    assert not s.split and s.inputs["uncached_tokens"] == n - held * BS
    # Where the chosen engine lately found a fifth of what the index showed, most of the hit is
    # likely lost behind its queue: the rule counts it as uncached and splits.
    core.on_engine_cached(d.endpoint_id, 10_000, 2_000)
    s = core.decide_split(d, req, now=0.0, matches=m)
    assert s.split and s.inputs["uncached_tokens"] == n - held * BS + int(0.8 * held * BS)
    core.on_engine_cached(d.endpoint_id, 10_000, 10_000)
    # Without the index's answer (or with read_index off) every long prompt splits, as before.
    assert core.decide_split(d, req, now=0.0).split
    blind = _split_core(policy, read_index=False)
    d = blind.decide(req, Matches(), now=0.0)
    assert not blind.split_lookup(req) and blind.decide_split(d, req, now=0.0, matches=m).split
    # A prompt below the threshold never splits, so it needs no lookup; nor does a policy with a view.
    assert not core.split_lookup(_req(core, _tokens(50), "short"))
    assert not _split_core("precise").split_lookup(req) and not _split_core("approx").split_lookup(req)
    assert not _core(2, policy=policy).split_lookup(req)   # the split is off


@pytest.mark.parametrize("policy", ["precise", "approx"])
def test_sibling_of_a_split_request_follows_its_prefill_and_splits_too(policy: str):
    core = _split_core(policy)
    shared = _tokens(6000)
    a = _req(core, shared + _tokens(200, seed=1), "a", session="a")
    da = core.decide(a, Matches(), now=0.0)
    sa = core.decide_split(da, a, now=0.0, matches=Matches())
    assert sa.split
    core.on_routed(a, da, now=0.0, split=sa)
    # The sibling (same 6k-token prefix) arrives before any event. It co-locates with the
    # first on its decode endpoint, which holds the prefix only once the prefill is done and
    # restored: pending blocks, never a local GPU hit that would make it compute them itself.
    b = _req(core, shared + _tokens(200, seed=2), "b", session="b")
    db = core.decide(b, Matches(), now=0.01)
    win = next(c for c in db.candidates if c.endpoint_id == db.endpoint_id)
    assert db.endpoint_id == da.endpoint_id and win.pending_blocks == 6000 // BS
    assert db.predicted_cached_tokens_gpu == 0
    sb = core.decide_split(db, b, now=0.01, matches=Matches())
    assert sb.split and sb.prefill_endpoint == sa.prefill_endpoint
    # It computes only its own tail there, and does not wait for the sibling's queued prefill.
    assert sb.inputs["prefill_uncached_tokens"] == b.num_tokens - (6000 // BS) * BS


@pytest.mark.parametrize("policy", ["precise", "approx"])
def test_session_affinity_outranks_the_stable_hash_on_a_tie(policy: str):
    from kvmesh.routing.scoring import _rank

    core = _core(2, policy=policy)
    # Sessions whose stable hash alone would send a tie to e0: only affinity keeps them on e1.
    sessions = [s for s in (f"sess{i}" for i in range(100)) if _rank("s:" + s, "e0") < _rank("s:" + s, "e1")]
    for i, s in enumerate(sessions[:8]):
        core.load.update("e0", LoadReport(running=9, waiting=9, waiting_prefill_tokens=50_000, received_at=float(i)))
        core.load.update("e1", LoadReport(received_at=float(i)))
        r1 = _req(core, _tokens(300, seed=100 + i), f"a{i}", session=s)
        d1 = core.decide(r1, Matches(), now=float(i))
        assert d1.endpoint_id == "e1"                  # e0 is busy
        core.on_routed(r1, d1, now=float(i))
        core.on_finished(r1, d1, now=float(i) + 0.1)
        # e0 is idle again: a fresh prompt of the same session ties, and goes home.
        core.load.update("e0", LoadReport(received_at=float(i) + 0.2))
        r2 = _req(core, _tokens(300, seed=200 + i), f"b{i}", session=s)
        assert core.decide(r2, Matches(), now=float(i) + 0.2).endpoint_id == "e1", s


def test_marking_an_endpoint_down_and_up_changes_the_eligible_set_at_once():
    core = _core(3)
    assert {e.endpoint_id for e in core.decode_endpoints("m")} == {"e0", "e1", "e2"}
    assert core.set_alive("e1", False) and not core.set_alive("e1", False)
    assert {e.endpoint_id for e in core.decode_endpoints("m")} == {"e0", "e2"}
    for i in range(6):
        assert core.decide(_req(core, _tokens(50, seed=i), f"r{i}"), Matches(), now=0.0).endpoint_id != "e1"
    core.set_alive("e1", True)
    assert {e.endpoint_id for e in core.decode_endpoints("m")} == {"e0", "e1", "e2"}
    core.decode_endpoints("m").clear()   # callers get a copy: the cached list is not theirs to change
    assert len(core.decode_endpoints("m")) == 3


def test_split_counts_the_hit_the_chosen_engine_keeps_losing():
    core = _split_core(prefill=("p0",), survival_decay=0.0, survival_floor=0.9)
    n = 8000
    cached = (n - 48) // BS
    req = _req(core, _tokens(n), "r", session="s")
    # The home shows 7,952 tokens on GPU and the store holds them too; 48 are new.
    m = Matches(per_endpoint={"e0": TierMatch(gpu=cached)}, store=TierMatch(cpu=cached))
    d = core.decide(req, m, now=0.0)
    predicted = d.predicted_cached_tokens
    assert d.endpoint_id == "e0" and predicted == cached * BS and d.uncached_tokens < 100
    assert not core.decide_split(d, req, now=0.0, matches=m).split      # trusted: nothing to split
    # e0's engine lately found a fifth of what the router predicted there: 4/5 of this hit is
    # likely recomputed behind its queue, so the rule counts it as uncached and the prefill
    # endpoint restores the prompt from the store instead.
    core.on_engine_cached("e0", 10_000, 2_000)
    s = core.decide_split(d, req, now=0.0, matches=m)
    assert s.split and s.prefill_endpoint == "p0"
    assert s.inputs["uncached_tokens"] == d.uncached_tokens + int(0.8 * predicted)
    assert s.inputs["split_extra_ttft_s"] < 0
    # Once the engine finds what is predicted again, the hit is trusted again.
    core.on_engine_cached("e0", 10_000, 10_000)
    assert not core.decide_split(d, req, now=0.0, matches=m).split
    # Off (floor 0): the prediction alone decides, however badly it fared.
    off = _split_core(prefill=("p0",), survival_floor=0.0)
    off.on_engine_cached("e0", 10_000, 0)
    d = off.decide(req, m, now=0.0)
    assert not off.decide_split(d, req, now=0.0, matches=m).split


def test_split_extra_prices_the_lost_tail_as_a_local_recompute():
    from kvmesh.routing.scoring import split_extra_s
    from kvmesh.routing.types import Candidate
    cfg = ScoringConfig()
    n, u = 50_000, 2_000
    win = Candidate(endpoint_id="e0", cost=0.0, credit_blocks=0.0, gpu_blocks=(n - u) // BS, offload_blocks=0,
                    speculative_blocks=0, uncached_tokens=u, queue=0, prefill_tokens=0.0, wait_s=3.0,
                    own_s=cfg.prefill_cost(u, n - u), store_blocks=(n - u) // BS)
    base = split_extra_s(win, n, BS, 0.0, cfg)
    lost = 30_000
    with_loss = split_extra_s(win, n, BS, 0.0, cfg, local_lost_tokens=lost)
    # Locally the lost 30,000 tokens are recomputed (attention over what survives), not hit.
    extra_local = cfg.prefill_cost(u + lost, n - u - lost) - cfg.prefill_cost(u, n - u)
    assert with_loss == pytest.approx(base - extra_local)
    # At most the whole predicted hit is lost.
    assert split_extra_s(win, n, BS, 0.0, cfg, local_lost_tokens=10 * n) == pytest.approx(
        base - (cfg.prefill_cost(n, 0) - cfg.prefill_cost(u, n - u)))
