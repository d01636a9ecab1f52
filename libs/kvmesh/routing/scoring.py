"""Cost of serving a request on an endpoint: its estimated time to first token there.

The shape follows NVIDIA Dynamo's KV router and llm-d's scorers (queued prefill +
this request's uncached prefill − what the cache saves, plus a decode-load term),
but in *seconds*, from the same latency figures as the engine model (the
neutral :mod:`kvmesh.perfmodel`, shared with the sim engine), so that every tier
and every kind of load is weighed at its real price::

    cost = wait + own + decode + work + displace + blocking (+ evicted) + kv_wait
    wait     = prefill_s/token · queue_weight · max(queued_prefill − shared, 0)
               (with ``queue_attention``, each queued token also at its attention to the queued
               prefill's mean context: :func:`queued_s_per_token`)
    own      = prefill_cost(uncached, context=cached)            (linear + attention)
             + restore_s/token · offload tokens (+ overhead)     (GPU hit: free)
               (with ``store_keep``, the share of the restore the store likely loses while the
               request waits there is recomputed instead: :func:`store_kept`)
    decode   = horizon · (running · decode_s/seq + KV context · decode_s/ctx token); the horizon
               shortens with the share of the prompt the store holds (ScoringConfig.decode_horizon)
    work     = cluster_work_weight · saturation · (own − least own of any endpoint)
    displace = displace_weight · prefill_s/token · tokens of the others' KV the prompt evicts: its
               new GPU blocks, up to what the whole prompt exceeds (capacity − others' working set);
               with ``displace_cliff`` (default), :func:`cliff_displaced` instead (an LRU under cyclic
               reuse); with ``displace_attention`` (default), a displaced token at its recompute with
               attention over the mean context of the endpoint's sessions (:func:`displaced_s_per_token`)
    blocking = blocking_weight · others · own² / (2 · turn_interval_s): the waits of the other
               sessions homed there whose turns arrive while this prefill runs (vLLM's default
               scheduler gives a running prefill the whole step budget) (:func:`blocking_s`)
    evicted  = with ``gpu_survival``, no store: the recompute of the GPU hit's tail that the
               contexts in flight there evict before the turn runs (:func:`gpu_lost_tokens`), on
               top of the estimate; the cluster terms keep the index's hit (off by default)
    kv_wait  = max(0, kv_wait_w · max(0, in-flight KV + prompt − capacity) / capacity · residence
                      − wait): the wait for KV space beyond the queued prefill's. vLLM admits a
               waiting request only when its blocks fit beside the running requests', and those
               free the cache as they finish decoding; residence is how long the endpoint's
               requests lately held their KV after their first token (:func:`kv_wait_s`; off by
               default)

The first three are this request's TTFT there; ``work``, ``displace`` and ``blocking`` are
what the placement costs everyone else. Once every endpoint has a queue (``saturation``), prefill
beyond the cheapest placement's is work every queued request waits behind; and new blocks
beyond what an endpoint's recently used contexts leave free evict KV that their sessions'
next turns would reuse (``LoadView.working_set``). See docs/router.md.

* Each leading block counts at the best tier that holds it: the endpoint's own
  GPU cache (or a speculative entry the router wrote for a request it just sent
  there) is free; a block in the shared offload store is restorable by *every*
  decode endpoint at the cost of the host-to-device copy (~7 µs/token for a 32B
  model against ~250 µs/token to recompute); a miss is recomputed, attention
  included, so a long uncached tail on a long context costs what it really costs.
* ``queued_prefill`` is the prefill already waiting on the endpoint (last load
  report plus what the router sent since). ``shared`` is the part of it that
  computes leading blocks of *this* prompt (a sibling sub-agent's shared prefix,
  :meth:`LoadView.pending_overlap`): the request would wait for it, but elsewhere
  it would recompute it, so a burst co-locates instead of scattering.
* The decode term is the KV every decode step must read there, over the steps the
  request will decode alongside it: long contexts decoding on an endpoint slow
  everything that runs there, and weighing them keeps busy time balanced.

An overload guard marks endpoints whose queue is far above the least-loaded one
(or whose KV cache is full) as hot; a hot endpoint only takes requests with a
large hit there, so misses never pile onto one busy endpoint (SGLang's "death
spiral"). Under saturation it also holds a request for the endpoints that hold its
prompt (:func:`holders`): a recompute elsewhere starts a wave of evictions through that
endpoint's queue. Ties go to session affinity, then the least load, then a stable hash of
the session (or prefix) — never the endpoint id, which would send every new
session to the same first endpoint.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.config import ConfigError
from kvmesh.perfmodel import DISK_BYTES_PER_S, H100, KV_BYTES_PER_TOKEN
from kvmesh.routing.load import EffectiveLoad
from kvmesh.routing.types import Candidate, RouteRequest, TierMatch

_H100 = H100


@dataclass
class ScoringConfig:
    """Latency figures and weights of the cost (seconds); defaults: the H100-class engine model."""

    prefill_s_per_token: float = field(default=_H100.prefill_s_per_token, metadata={
        "help": "prefill time per uncached token (linear part)"})
    attn_s_per_token_pair: float = field(default=_H100.attn_s_per_token_pair, metadata={
        "help": "prefill attention time per (new token, context token) pair"})
    cpu_restore_s_per_token: float = field(default=KV_BYTES_PER_TOKEN / _H100.h2d_bytes_per_s, metadata={
        "help": "restore time per token from the offload RAM tier (KV bytes/token / H2D bandwidth)"})
    disk_restore_s_per_token: float = field(default=KV_BYTES_PER_TOKEN / DISK_BYTES_PER_S, metadata={
        "help": "restore time per token from the offload disk tier (NVMe ~5 GB/s)"})
    restore_overhead_s: float = field(default=_H100.restore_overhead_s, metadata={
        "help": "fixed cost of one restore"})
    queue_weight: float = field(default=1.0, metadata={
        "help": "weight of the prefill already queued on the endpoint (minus what this prompt shares)"})
    queue_attention: bool = field(default=False, metadata={
        "help": "price the queued prefill with its attention, as the engine computes it: each queued token at "
                "prefill_s_per_token plus attn_s_per_token_pair times the mean context the router's in-flight "
                "requests still prefilling there attend to (LoadView: their cached tokens plus half their own); "
                "false = the linear part only"})
    decode_s_per_seq: float = field(default=_H100.decode_s_per_seq, metadata={
        "help": "decode step time per running sequence"})
    decode_s_per_ctx_token: float = field(default=_H100.decode_s_per_ctx_token, metadata={
        "help": "decode step time per context token held by running sequences (KV reads)"})
    decode_horizon_steps: float = field(default=64.0, metadata={
        "help": "decode steps the request is expected to share with the endpoint's running sequences"})
    decode_horizon_steps_stored: float = field(default=32.0, metadata={
        "help": "the decode horizon for a prompt the shared offload store holds, interpolated by the share it "
                "holds: any endpoint can then take the session's next turn for a restore, so a placement is not "
                "for the session's life and a busy home is left only for a larger decode load (equal to "
                "--decode-horizon-steps: the same horizon for every prompt)"})
    tie_epsilon_s: float = field(default=0.01, metadata={"help": "costs within this many seconds tie"})
    hot_abs: float = field(default=4.0, metadata={"help": "hot if queue exceeds the minimum by this many"})
    hot_rel: float = field(default=2.0, metadata={"help": "... and is this many times (min+1)"})
    hot_kv_usage: float = field(default=0.98, metadata={"help": "hot if KV usage reaches this"})
    hot_min_hit_ratio: float = field(default=0.5, metadata={"help": "a hot endpoint only takes hits >= this"})
    max_inflight: int = field(default=0, metadata={"help": "per-endpoint in-flight cap (0 = none)"})
    cluster_work_weight: float = field(default=0.5, metadata={
        "help": "price, per second of saturation, of the prefill a placement adds beyond the cheapest "
                "placement's: when every endpoint has a queue, that recompute is work every queued "
                "request waits behind (0 = off)"})
    saturation_s: float = field(default=1.0, metadata={
        "help": "queued prefill (s) on the least-loaded endpoint at which the cluster counts as saturated; "
                "the cluster-work term scales with min(1, that queue / this)"})
    displace_weight: float = field(default=1.0, metadata={
        "help": "price of a token of reusable KV a placement evicts (its new blocks beyond the endpoint's "
                "capacity minus the contexts of sessions that used it within --reuse-window-s), as a "
                "fraction of its recompute (0 = off)"})
    reuse_window_s: float = field(default=600.0, metadata={
        "help": "a session's context counts in its endpoint's working set for this long after its last turn"})
    displace_free_at: float = field(default=0.0, metadata={
        "help": "displaced KV is priced in full while the other sessions' working set fits the endpoint's "
                "cache, and less as it exceeds it, down to 0 at this many times the capacity: such an "
                "endpoint already recycles every context before its next turn (0 = always in full)"})
    displace_cliff: bool = field(default=True, metadata={
        "help": "price displacement as an LRU cache under cyclic reuse does: a placement that pushes an endpoint's "
                "working set over its cache costs the whole working set, one onto an endpoint already over it only "
                "the placed context, one that fits nothing (scoring.cliff_displaced; false = the overflow estimate). "
                "Without an offload store only: with one, a context pushed out of the GPU comes back by a restore, and "
                "the overflow estimate prices what a placement costs (see --displace-cliff-with-store)"})
    displace_cliff_with_store: bool = field(default=False, metadata={
        "help": "with --displace-cliff, price displacement as the cliff also when an offload store is on"})
    displace_cliff_max_sessions: int = field(default=4, metadata={
        "help": "with --displace-cliff, the cliff prices an endpoint whose working set holds at most this many other "
                "sessions: a few contexts return in turn and an LRU cache loses them whole; many return in no fixed "
                "order and lose about what the cache overflows, the overflow estimate (0 = every endpoint)"})
    displace_attention: bool = field(default=True, metadata={
        "help": "price a displaced token at its recompute with attention: prefill_s_per_token plus attn_s_per_token_pair "
                "times half the mean context of the sessions in the endpoint's working set (a token of an 800k-token "
                "context costs ~6 times its linear part; scoring.displaced_s_per_token; false = the linear part only)"})
    blocking_weight: float = field(default=0.14, metadata={
        "help": "price, per second, of the waits this request's own prefill adds to the other sessions homed on the "
                "endpoint (its working set): each turns again about every --turn-interval-s, and under vLLM's default "
                "scheduler a running prefill holds the step's whole token budget, so a turn arriving during it waits "
                "for the rest (scoring.blocking_s; 0 = off). Without an offload store; with one, "
                "--blocking-weight-with-store"})
    blocking_weight_with_store: float = field(default=0.07, metadata={
        "help": "--blocking-weight when an offload store is on (ScoringConfig.blocking_w; on the shared traces "
                "0.14 raised precise's p99 from 354 s to 493 s with a 4M-token store, and from 87 s to 153 s with a "
                "32M one)"})
    turn_interval_s: float = field(default=120.0, metadata={
        "help": "the mean time between an active session's turns (the blocking term's arrival rate per session)"})
    displace_store_price: bool = field(default=False, metadata={
        "help": "price the displaced KV the offload store holds at its restore (--cpu-restore-s-per-token), the "
                "rest at its recompute: a session whose context the store keeps loses a copy, not the work "
                "(scoring.stored_displaced; false = every displaced token at its recompute)"})
    store_keep: bool = field(default=False, metadata={
        "help": "price a restore from the offload store only for the share the store likely keeps until the turn "
                "runs there (its queue wait against the store's horizon as the router sees it, "
                "kvmesh.routing.load.StoreHorizon); the rest at its recompute (scoring.store_kept; false = every "
                "restorable block at the restore)"})
    gpu_survival: bool = field(default=False, metadata={
        "help": "without an offload store, price a GPU hit only for what survives until the turn runs there: the "
                "contexts of the router's requests in flight there are touched before it, so what they and the "
                "prompt exceed of the cache is evicted from the tail of the hit and priced as a recompute "
                "(scoring.gpu_lost_tokens; false = every GPU-cached block as a hit; docs/router.md)"})
    cold_first: bool = field(default=True, metadata={
        "help": "precise: a new session goes to a cold endpoint (no request placed on it, once the router has "
                "routed for --cold-after-s, and none of the prompt there) with nothing queued, the cheapest of them, "
                "while there is one: greedy costs never warm a spare endpoint, because its first placement "
                "recomputes a shared prefix warm endpoints hold, so a fleet larger than its sessions need packs "
                "them onto part of its cache (docs/router.md, \"cold endpoints\")"})
    cold_after_s: float = field(default=300.0, metadata={
        "help": "with --cold-first: the router's warm-up, from its first decision; until then the cost alone "
                "places new sessions (it warms a small cluster's endpoints within a few minutes by itself); an "
                "endpoint that joins later is cold at once"})
    hold_min_ratio: float = field(default=0.0, metadata={
        "help": "when every endpoint has prefill queued, a request whose prompt some endpoint holds at least this "
                "share of (GPU cache or restorable) only goes to such a holder: a recompute elsewhere would start "
                "a wave of evictions there (0 = off; see docs/router.md for why it is off by default)"})

    kv_wait_weight: float = field(default=0.0, metadata={
        "help": "weight of the wait for KV space (scoring.kv_wait_s): vLLM admits a waiting request only when its "
                "blocks fit beside the running requests', which free the cache as they finish decoding, so what the "
                "router's in-flight contexts there (a shared prefix once) and the prompt exceed the endpoint's "
                "capacity by waits that share of a residence (how long its requests lately held their KV after their "
                "first token); the cost adds what that exceeds the queued-prefill wait by. 0 = off, the default: it "
                "raised the p99 of Mooncake's conversation trace at every weight tried (docs/bench-history.md, "
                "\"#18: the wait for KV space\"). Without an offload store; with one, --kv-wait-weight-with-store"})
    kv_wait_weight_with_store: float = field(default=0.0, metadata={
        "help": "--kv-wait-weight when an offload store is on (ScoringConfig.kv_wait_w; 0 = off)"})
    admit_miss_ratio: float = field(default=0.0, metadata={
        "help": "admission control: when every endpoint has prefill queued, hold at the router a request whose "
                "predicted hit on the chosen endpoint is below this share of its prompt (it recomputes anyway) and "
                "whose prompt does not fit there beside the other sessions' working set (0 = off; "
                "kvmesh.routing.admission)"})
    admit_recheck_s: float = field(default=1.0, metadata={
        "help": "a held request is decided again after this many seconds"})
    admit_max_hold_s: float = field(default=600.0, metadata={
        "help": "a request is never held longer than this in all"})

    def validate(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise ConfigError(f"setting {name!r} must be >= 0")

    def decode_horizon(self, stored_blocks: int, cap_blocks: int) -> float:
        """Decode steps the ``decode`` term looks ahead for a prompt of ``cap_blocks`` (hit-able
        blocks) of which the shared store holds ``stored_blocks``.

        The term balances decode load. Where the store does not hold the prompt, a later move
        costs a recompute, so a placement holds for the session's life and the term looks far
        ahead. Where it does, a move costs a restore (~0.7 s for 100k tokens against ~25 s), so
        the next turn can rebalance as cheaply; the full horizon then moved turns off busy homes
        at every turn, each paying its restore in TTFT (docs/bench-history.md, "#18: where
        precise's p50 went"). With both horizons equal it is the same for every prompt."""
        if cap_blocks <= 0 or stored_blocks <= 0:
            return self.decode_horizon_steps
        share = min(stored_blocks, cap_blocks) / cap_blocks
        return self.decode_horizon_steps + (self.decode_horizon_steps_stored - self.decode_horizon_steps) * share

    def cliff(self, offload_enabled: bool, others_sessions: Any = 0.0) -> Any:
        """Whether displacement on an endpoint whose working set holds ``others_sessions`` other
        sessions is priced as the cliff (``displace_cliff``): a context an LRU GPU cache thrashes
        is recomputed only where no store holds it (with a 32M-token store, the cliff cost p90
        9.1 s against 10.5 s on the shared traces), and a cache loses whole contexts only when
        few share it (``displace_cliff_max_sessions``; docs/bench-history.md, "#18: the blocking
        term"). ``others_sessions`` may be a numpy column (``CandidateTable``): the answer is then
        a column too, or a bool where it does not depend on the sessions."""
        if not (self.displace_cliff and (not offload_enabled or self.displace_cliff_with_store)):
            return False
        k = self.displace_cliff_max_sessions
        return k <= 0 or others_sessions <= k

    def kv_wait_w(self, offload_enabled: bool) -> float:
        """The KV-space wait's weight: ``kv_wait_weight`` without an offload store,
        ``kv_wait_weight_with_store`` with one (docs/bench-history.md, "#18: the wait for KV space")."""
        return self.kv_wait_weight_with_store if offload_enabled else self.kv_wait_weight

    def blocking_w(self, offload_enabled: bool) -> float:
        """The blocking term's weight: ``blocking_weight`` without an offload store,
        ``blocking_weight_with_store`` with one. Both were measured on the shared traces
        (docs/bench-history.md, "#18: the blocking weight on three seeds"): without a store 0.14
        had the best hit rate over three seeds; with one it raised precise's p99."""
        return self.blocking_weight_with_store if offload_enabled else self.blocking_weight

    def prefill_cost(self, tokens: float, context: float) -> float:
        """Compute time of ``tokens`` new prompt tokens after ``context`` present ones."""
        if tokens <= 0:
            return 0.0
        return tokens * self.prefill_s_per_token + tokens * (context + tokens / 2.0) * self.attn_s_per_token_pair


SCORING_METADATA = {"flag_prefix": "", "group": "router scoring (kvmesh.routing.scoring: estimated TTFT per endpoint)",
                    "help": "latency figures and weights of the cost; defaults: kvmesh.perfmodel.H100"}
"""Field metadata of a nested ``ScoringConfig`` (kvmesh.config): the router, the cluster simulator and
``kvmesh simulate`` nest it the same way, so they take the same flags (the bare field names,
``--queue-weight``) and env names (``<PREFIX>SCORING_<FIELD>``)."""


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """vLLM never reports the prompt's last token as cached (it must compute one)."""
    return max(0, (num_tokens - 1) // block_size) if block_size > 0 else 0


@dataclass
class TierSplit:
    """Leading blocks of a prompt by the tier they would come from on one endpoint."""

    gpu: int            # engine cache, incl. speculative entries
    cpu: int            # restored from offload RAM beyond the GPU hit
    disk: int           # restored from offload disk beyond that
    speculative: int    # of ``gpu``, only known from the router's speculative entries
    pending: int = 0    # of ``cpu``, only there after a sibling's split prefill (TierMatch.pending)

    @property
    def offload(self) -> int:
        return self.cpu + self.disk

    @property
    def cached(self) -> int:
        return self.gpu + self.cpu + self.disk


def tier_split(match: TierMatch, store: TierMatch, cap_blocks: int, offload_enabled: bool = True) -> TierSplit:
    """Each leading block at the best tier that holds it (every count is a leading run)."""
    real_gpu = min(match.gpu, cap_blocks)
    gpu = min(max(match.gpu, match.speculative), cap_blocks)
    spec = gpu - real_gpu
    if not offload_enabled:
        return TierSplit(gpu, 0, 0, spec)
    real_cpu_end = max(gpu, min(max(match.cpu, store.cpu), cap_blocks))
    real_disk_end = min(max(match.disk, store.disk), cap_blocks)
    cpu_end = max(real_cpu_end, min(match.pending, cap_blocks))
    disk_end = max(cpu_end, real_disk_end)
    pending = max(0, cpu_end - max(real_cpu_end, real_disk_end))
    return TierSplit(gpu, cpu_end - gpu, disk_end - cpu_end, spec, pending)


@dataclass(frozen=True)
class ClusterState:
    """The figures of one decision that depend on every endpoint at once (see :func:`cluster_state`)."""

    best_own_s: float = 0.0     # the cheapest placement's own prefill + restore
    saturation: float = 0.0     # 0: some endpoint has no queued prefill; 1: the least loaded has saturation_s


def saturation(min_queued_tokens: float, cfg: ScoringConfig) -> float:
    """How saturated the cluster is, from the least-loaded endpoint's queued prefill (tokens)."""
    wait = min_queued_tokens * cfg.prefill_s_per_token
    if wait <= 0.0:
        return 0.0
    if cfg.saturation_s <= 0.0:
        return 1.0
    return min(1.0, wait / cfg.saturation_s)


def cluster_state(cands: list[Candidate], cfg: ScoringConfig) -> ClusterState:
    """Cluster-wide figures from every endpoint's evaluation (with or without a cluster state)."""
    if not cands:
        return ClusterState()
    return ClusterState(min(c.own_s for c in cands), saturation(min(c.prefill_tokens for c in cands), cfg))


def evaluate(endpoint_id: str, match: TierMatch, store: TierMatch, load: EffectiveLoad, num_tokens: int,
             block_size: int, cfg: ScoringConfig, offload_enabled: bool = True,
             shared_queued_tokens: int = 0, cluster: ClusterState | None = None,
             own_resident_tokens: int = 0, own_stored_tokens: int = 0,
             store_life_s: float = math.inf) -> Candidate:
    """Estimated seconds to first token of the request on one endpoint, plus what the placement
    costs the rest of the cluster (lower is better). ``cluster``: see :func:`cluster_state`;
    without it the cluster-work term is 0. ``own_resident_tokens``: the request's session's own
    context counted in the endpoint's working set (``LoadView.working_set``), which it reuses;
    ``own_stored_tokens``: the part of it the store held (``WorkingSet.home_stored``);
    ``store_life_s``: how long the store likely keeps the session's context (``LoadView.store_life_s``,
    used with ``store_keep``)."""
    cap = max_hit_blocks(num_tokens, block_size)
    split = tier_split(match, store, cap, offload_enabled)
    cached_tokens = split.cached * block_size
    uncached = max(0, num_tokens - cached_tokens)
    restore = 0.0
    if split.offload:
        restore = (cfg.restore_overhead_s + split.cpu * block_size * cfg.cpu_restore_s_per_token
                   + split.disk * block_size * cfg.disk_restore_s_per_token)
    queued = max(load.prefill_tokens - shared_queued_tokens, 0.0)
    wait = cfg.queue_weight * queued * queued_s_per_token(load.prefill_ctx_tokens, cfg)
    lost = 0.0
    if cfg.store_keep and offload_enabled and store_life_s != math.inf:
        # Restores the store must still hold when the turn is scheduled, after its wait here
        # (a sibling's pending prefill is stored later, so it is not at risk).
        at_risk = (split.offload - split.pending) * block_size
        kept = store_kept(wait, store_life_s)
        if at_risk > 0 and kept < 1.0:
            lost = (1.0 - kept) * at_risk
    if lost > 0.0:
        own = cfg.prefill_cost(uncached + lost, cached_tokens - lost) + (restore - lost * cfg.cpu_restore_s_per_token)
    else:
        own = cfg.prefill_cost(uncached, cached_tokens) + restore
    ctx = load.active_blocks * block_size + load.inflight_ctx_tokens
    horizon = cfg.decode_horizon(max(store.cpu, store.disk) if offload_enabled else 0, cap)
    decode = horizon * (load.queue * cfg.decode_s_per_seq + ctx * cfg.decode_s_per_ctx_token)
    work = displace = 0.0
    # The other sessions counted on the endpoint: what the cliff and the attention price of a
    # displaced token are judged by, and whose turns this request's prefill blocks.
    others_sessions = load.resident_sessions - (own_resident_tokens > 0)
    if cluster is not None:
        # Prefill beyond the cheapest placement's is work queued requests wait behind once
        # every endpoint is busy.
        work = cfg.cluster_work_weight * cluster.saturation * max(own - cluster.best_own_s, 0.0)
    if load.capacity_blocks > 0:
        # The whole prompt is on the GPU while it runs: what the others' recent contexts leave
        # must hold it, cached blocks included. What does not fit comes out of those contexts,
        # at most as much as the request allocates (blocks restored from the store count: they
        # take GPU blocks as much as recomputed ones). Their sessions' next turns recompute them,
        # or restore what the store holds (``displace_store_price``).
        fresh = -(-max(0, num_tokens - split.gpu * block_size) // block_size) * block_size
        room = load.capacity_blocks * block_size - (load.resident_tokens - own_resident_tokens)
        need = -(-num_tokens // block_size) * block_size
        others = load.resident_tokens - own_resident_tokens
        cliff = cfg.cliff(offload_enabled, others_sessions)
        if cliff:
            displaced = cliff_displaced(load.capacity_blocks * block_size, others, need)
        else:
            displaced = min(fresh, max(need - max(room, 0.0), 0.0))
        per_token = displaced_s_per_token(others, others_sessions, cfg)
        if cfg.displace_store_price and offload_enabled:
            stored = stored_displaced(load.capacity_blocks * block_size, others, load.stored_tokens - own_stored_tokens,
                                      min(max(store.cpu, store.disk), cap) * block_size, displaced, cliff)
            displace = cfg.displace_weight * ((displaced - stored) * per_token + stored * cfg.cpu_restore_s_per_token)
        else:
            displace = cfg.displace_weight * displaced * per_token
        if cfg.displace_free_at > 1.0 and not cliff:
            displace *= kept_share(load.capacity_blocks * block_size, load.resident_tokens - own_resident_tokens, cfg)
    blocking = blocking_s(own, others_sessions, cfg, offload_enabled)
    kv_wait = 0.0
    kw = cfg.kv_wait_w(offload_enabled)
    if load.capacity_blocks > 0 and load.residence_s > 0.0 and kw > 0.0:
        need = -(-num_tokens // block_size) * block_size - shared_queued_tokens
        # Requests ahead wait for compute and for space at once: the longer of the two is the wait.
        kv_wait = max(0.0, kv_wait_s(load.capacity_blocks * block_size, load.inflight_kv_tokens, need,
                                     load.residence_s, kw) - wait)
    evicted = 0.0
    if cfg.gpu_survival and not offload_enabled and load.capacity_blocks > 0:
        gone = gpu_lost_tokens(load.capacity_blocks * block_size, load.all_inflight_ctx_tokens, num_tokens,
                               split.gpu * block_size)
        if gone > 0.0:
            # Without a store ``own`` is the prefill after the predicted hit: no restore, no store loss.
            evicted = cfg.prefill_cost(uncached + gone, cached_tokens - gone) - own
    return Candidate(endpoint_id=endpoint_id,
                     cost=wait + own + decode + work + displace + blocking + evicted + kv_wait,
                     credit_blocks=float(split.cached),
                     gpu_blocks=split.gpu, offload_blocks=split.offload, speculative_blocks=split.speculative,
                     uncached_tokens=uncached, queue=load.queue, prefill_tokens=load.prefill_tokens,
                     wait_s=wait, own_s=own, decode_s=decode, work_s=work, displace_s=displace, blocking_s=blocking,
                     evicted_s=evicted, kv_wait_s=kv_wait,
                     store_blocks=min(max(store.cpu, store.disk), cap) if offload_enabled else 0,
                     pending_blocks=split.pending)


def kv_wait_s(capacity_tokens: float, inflight_kv_tokens: float, need_tokens: float, residence_s: float,
              weight: float) -> float:
    """The wait for KV space of a prompt that needs ``need_tokens`` of new KV on an endpoint whose
    router-sent requests in flight hold ``inflight_kv_tokens`` of KV (``kv_wait_weight``;
    :attr:`~kvmesh.routing.load.EffectiveLoad.inflight_kv_tokens`).

    vLLM's scheduler admits a waiting request only when the blocks it needs fit beside the running
    requests' (first come, first served), and a running request frees its blocks when it finishes
    decoding. The in-flight contexts plus this prompt beyond the capacity are what must be freed
    before it runs. While requests wait for space the cache is full of running ones, which finish
    spread over a residence (how long a request lately held its KV after its first token there), so
    the cache frees about ``capacity / residence`` tokens a second and the wait is the excess over
    that rate. The queued prefill (``wait``) prices the compute of those ahead, this the space they
    hold; the two overlap (a request waits for both at once), so the cost adds only what this one
    exceeds ``wait`` by.
    """
    over = inflight_kv_tokens + need_tokens - capacity_tokens
    if over <= 0.0 or capacity_tokens <= 0.0:
        return 0.0
    return weight * over / capacity_tokens * residence_s


def displaced_s_per_token(others_tokens: float, others_sessions: float, cfg: ScoringConfig) -> float:
    """What a displaced token costs its session's next turn, which recomputes it.

    With ``displace_attention``, the linear part plus the attention of a token in the middle of
    a context of the mean size of the other sessions' (``others_tokens`` over
    ``others_sessions``, at least one): evicting a slice of an 800k-token context costs about six
    times its linear part, of a 20k one about 1.1 times. The linear part alone underprices the
    largest contexts most, and those are the ones an LRU cache thrashes when two share a GPU.
    """
    if not cfg.displace_attention:
        return cfg.prefill_s_per_token
    mean_ctx = max(others_tokens, 0.0) / max(others_sessions, 1.0)
    return cfg.prefill_s_per_token + cfg.attn_s_per_token_pair * mean_ctx / 2.0


def blocking_s(own_s: float, others_sessions: float, cfg: ScoringConfig, offload_enabled: bool = False) -> float:
    """The waits this request's own prefill (``own_s``) adds to the other sessions homed on the
    endpoint, at ``ScoringConfig.blocking_w`` per second.

    vLLM's default scheduler runs a prefill it has started with the step's whole token budget,
    so a turn that arrives while it runs waits for the rest of it. A session turns about every
    ``turn_interval_s``: over ``own_s`` each of ``others_sessions`` arrives ``own_s /
    turn_interval_s`` times and waits ``own_s / 2`` on average. A short hit costs the others
    almost nothing; a long recompute placed among many sessions costs them most.
    """
    w = cfg.blocking_w(offload_enabled)
    if w <= 0.0 or cfg.turn_interval_s <= 0.0 or own_s <= 0.0 or others_sessions <= 0.0:
        return 0.0
    return w * others_sessions * own_s * own_s / (2.0 * cfg.turn_interval_s)


def queued_s_per_token(prefill_ctx_tokens: float, cfg: ScoringConfig) -> float:
    """Engine time of one queued prefill token (``queue_attention``: its attention to the mean context
    of the queued prefill, :attr:`EffectiveLoad.prefill_ctx_tokens`, as well as its linear part)."""
    if cfg.queue_attention:
        return cfg.prefill_s_per_token + cfg.attn_s_per_token_pair * prefill_ctx_tokens
    return cfg.prefill_s_per_token


def store_kept(wait_s: float, life_s: float) -> float:
    """Share of a context the offload store still holds after ``wait_s``, with ``life_s`` left (``store_keep``).

    An LRU store evicts a context's blocks once newer blocks fill it (:class:`~kvmesh.routing.load.
    StoreHorizon`), and evicts a context from its tail. A turn that restores from the store on an
    endpoint where it waits in a queue gets what the store still holds when it is scheduled (vLLM's
    offloading connector is asked then): all of it without a wait, nothing once the wait exceeds
    the context's remaining life, and linearly in between.
    """
    if wait_s <= 0.0 or life_s == math.inf:
        return 1.0
    if life_s <= 0.0:
        return 0.0
    return max(0.0, 1.0 - wait_s / life_s)


def gpu_lost_tokens(capacity_tokens: float, inflight_ctx_tokens: float, num_tokens: int, gpu_tokens: int) -> float:
    """Of a GPU hit of ``gpu_tokens``, the tokens the endpoint evicts before the turn runs (``gpu_survival``).

    vLLM evicts the least recently used free blocks, and a finished turn's blocks go free tail
    first. Every request the router has in flight on the endpoint (``inflight_ctx_tokens``: their
    whole contexts) touches its blocks before a turn queued now is scheduled, so those blocks are
    newer than the turn's cached prefix, which its session last touched at its previous turn. The
    prefix survives whole if they and the prompt fit in the cache; what they exceed it by comes off
    the prefix's tail, at most the whole hit. Contexts shared between in-flight requests count
    once per request, so this errs towards a loss; without a store nothing brings the tail back
    but a recompute.
    """
    return float(min(gpu_tokens, max(0.0, inflight_ctx_tokens + num_tokens - capacity_tokens)))


def cliff_displaced(capacity_tokens: float, others_tokens: float, need_tokens: float) -> float:
    """Reusable KV a placement costs an endpoint whose cache is an LRU under cyclic reuse (``displace_cliff``).

    Agents come back in turn and vLLM evicts the least recently used blocks; a waiting request pins
    nothing and the turn queued longest is the least recently used. So while the contexts of an
    endpoint's recent sessions fit its cache they all hit, and once they exceed it each returning
    turn finds its context evicted by the turns in between: a cliff, not a slope. Placing a prompt
    of ``need_tokens`` there costs nothing if it fits beside the others' working set; the others'
    whole working set and its own context if it pushes the endpoint over the cliff; and only its own
    context (it will not last to its next turn) if the others already exceed the cache.
    """
    if others_tokens + need_tokens <= capacity_tokens:
        return 0.0
    if others_tokens <= capacity_tokens:
        return others_tokens + need_tokens
    return need_tokens


def stored_displaced(capacity_tokens: float, others_tokens: float, others_stored_tokens: float,
                     own_stored_tokens: float, displaced_tokens: float, cliff: bool) -> float:
    """Of ``displaced_tokens``, those the offload store holds (``displace_store_price``).

    A session whose context is evicted from the GPU but kept by the store gets it back at its
    next turn by a host-to-device copy, not a recompute. What the store holds of each session
    in an endpoint's working set is what it held of that session's prompt when it was last
    routed (``others_stored_tokens`` in all); of the placed prompt, the store's leading match
    (``own_stored_tokens``). At the cliff (:func:`cliff_displaced`) the displaced tokens are
    whole contexts: the others' and the prompt's (pushed over), or the prompt's alone (already
    over). The overflow estimate displaces an unknown part of the others' contexts, so its
    stored part is the others' stored share.
    """
    if displaced_tokens <= 0.0:
        return 0.0
    if cliff:
        if others_tokens <= capacity_tokens:
            return others_stored_tokens + own_stored_tokens
        return own_stored_tokens
    if others_tokens <= 0.0:
        return 0.0
    return displaced_tokens * (others_stored_tokens / others_tokens)


def kept_share(capacity_tokens: float, others_tokens: float, cfg: ScoringConfig) -> float:
    """Share of the others' working set an endpoint's cache still gives back (``displace_free_at``).

    vLLM evicts the least recently used blocks, and agents come back in turn: once the contexts
    of an endpoint's recent sessions exceed its cache, each returning turn finds its context
    evicted by the turns in between, so there is less reusable KV left to displace. All of it
    while the working set fits, none once it is ``displace_free_at`` times the capacity.
    """
    over = (others_tokens - capacity_tokens) / ((cfg.displace_free_at - 1.0) * capacity_tokens)
    return min(1.0, max(0.0, 1.0 - over))


def split_extra_s(win: Candidate, num_tokens: int, block_size: int, prefill_queued_tokens: float,
                  cfg: ScoringConfig, remote_gpu_blocks: int = 0, local_lost_tokens: int = 0) -> float:
    """Estimated TTFT a P/D split adds over prefilling on the chosen endpoint (negative: it saves).

    Split: wait on the prefill endpoint, take what its own GPU cache holds
    (``remote_gpu_blocks``, leading), restore what the store holds beyond that, compute
    the rest, then the decode endpoint restores the whole prompt beyond its own GPU hit.
    For a long cached context that is two restores of it against none at home.
    ``local_lost_tokens``: the tail of the chosen endpoint's predicted hit its engine is likely
    not to find by the time the turn runs there (``kvmesh.routing.survival``), recomputed.
    """
    remote_cached = max(win.store_blocks, remote_gpu_blocks) * block_size
    restored = max(win.store_blocks - remote_gpu_blocks, 0) * block_size
    remote = (prefill_queued_tokens * cfg.queue_weight * cfg.prefill_s_per_token
              + cfg.prefill_cost(num_tokens - remote_cached, remote_cached)
              + _restore(restored, cfg) + _restore(num_tokens - win.gpu_blocks * block_size, cfg))
    local = win.wait_s + win.own_s
    if local_lost_tokens > 0:
        cached = num_tokens - win.uncached_tokens
        lost = min(local_lost_tokens, cached)
        local += cfg.prefill_cost(win.uncached_tokens + lost, cached - lost) - cfg.prefill_cost(win.uncached_tokens, cached)
    if win.pending_blocks:
        # Without a split, a sibling's pending prefix is not there yet: it is computed locally.
        p = win.pending_blocks * block_size
        rest = (win.gpu_blocks + win.offload_blocks) * block_size - p
        local += (cfg.prefill_cost(win.uncached_tokens + p, rest) - cfg.prefill_cost(win.uncached_tokens, rest + p)
                  - p * cfg.cpu_restore_s_per_token)
    return remote - local


def _restore(tokens: float, cfg: ScoringConfig) -> float:
    return cfg.restore_overhead_s + tokens * cfg.cpu_restore_s_per_token if tokens > 0 else 0.0


def mark_hot(cands: list[Candidate], loads: dict[str, EffectiveLoad], cap_blocks: int,
             cfg: ScoringConfig) -> None:
    """Flag overloaded endpoints and exclude them for requests with a small hit there; under
    saturation, exclude every endpoint but the prompt's holders (see :func:`holders`)."""
    if not cands:
        return
    min_q = min(c.queue for c in cands)
    held = holders([c.gpu_blocks + c.offload_blocks for c in cands], cap_blocks,
                   cluster_state(cands, cfg).saturation, cfg)
    for i, c in enumerate(cands):
        ld = loads[c.endpoint_id]
        c.hot = ((c.queue - min_q >= cfg.hot_abs and c.queue >= cfg.hot_rel * (min_q + 1))
                 or ld.kv_usage >= cfg.hot_kv_usage)
        if cfg.max_inflight and ld.inflight >= cfg.max_inflight:
            c.excluded = "max_inflight"
        elif held is not None and held[i]:
            continue   # a holder keeps its request even when hot: elsewhere it would be recomputed
        elif c.hot and ((c.gpu_blocks + c.offload_blocks) / cap_blocks if cap_blocks else 0.0) < cfg.hot_min_hit_ratio:
            c.excluded = "hot"
        elif held is not None:
            c.excluded = "held"


def holders(credit: Sequence[float], cap_blocks: int, saturation: float, cfg: ScoringConfig) -> list[bool] | None:
    """Which endpoints may take a request while the cluster is saturated (None: all of them).

    An endpoint holds the prompt when at least ``hold_min_ratio`` of its blocks are there
    (GPU cache, or restorable from the offload store: ``credit``). When every endpoint has
    prefill queued and some endpoint holds the prompt, only holders may take it. Sending it
    elsewhere recomputes the context into a cache that is full of other sessions' live
    contexts. That evicts the context of the next turn in that queue, whose recompute evicts
    the next one's: a wave that runs through the queue until a session leaves. Moved turns
    spread it from endpoint to endpoint until every endpoint thrashes (seed 1 of the shared
    traces: hit rate 0.1 on all eight workers for 80 minutes). The holder's queue is the
    price of containing it.
    """
    if cfg.hold_min_ratio <= 0 or cap_blocks <= 0 or saturation <= 0:
        return None
    need = cfg.hold_min_ratio * cap_blocks
    held = [c >= need for c in credit]
    return held if any(held) else None


def spread_key(req: RouteRequest) -> tuple[str, bool]:
    """What a tie is hashed on, and whether that hash outranks load.

    A session's turn: its session id, after load (new sessions spread over the least
    loaded). Without a session id: the prompt's first block key, *before* load —
    requests that share a prefix and are decided at the same moment (a burst, before
    any of it is recorded) meet on one endpoint even if a load report lands between
    their decisions. Neither: the request id.
    """
    if req.session_id:
        return "s:" + req.session_id, False
    if req.keys:
        return f"k:{req.keys[0]}", True
    return "r:" + req.request_id, False


def _rank(key: str, endpoint_id: str) -> int:
    """Stable per-(key, endpoint) rank (rendezvous hashing): the same in every process."""
    return zlib.crc32(f"{key}\x00{endpoint_id}".encode())


def pick(cands: list[Candidate], cfg: ScoringConfig, affinity: str = "",
         spread: tuple[str, bool] = ("", False)) -> tuple[Candidate, str]:
    """Lowest cost among non-excluded candidates.

    Costs within ``tie_epsilon_s`` tie; ties go to session affinity, then the most
    blocks already in the engine's cache (no restore traffic), then the least load,
    then a stable hash of ``spread`` (see :func:`spread_key`).
    """
    pool = [c for c in cands if not c.excluded] or list(cands)
    best_cost = min(c.cost for c in pool)
    tied = [c for c in pool if c.cost <= best_cost + cfg.tie_epsilon_s]
    key, hash_first = spread

    def order(c: Candidate) -> tuple:
        load = round(c.wait_s + c.decode_s, 4)
        h = _rank(key, c.endpoint_id)
        rest = (h, load) if hash_first else (load, h)
        return (c.endpoint_id != affinity, -c.gpu_blocks, *rest, c.endpoint_id)

    tied.sort(key=order)
    win = tied[0]
    by_affinity = len(tied) > 1 and bool(affinity) and win.endpoint_id == affinity
    return win, pick_reason(win, by_affinity, len(cands) - len(pool))


def pick_reason(win: Candidate, by_affinity: bool, skipped: int) -> str:
    """Why ``win`` was picked, for the decision's log and trace."""
    if by_affinity:
        why = "tie broken by session affinity"
    elif win.credit_blocks > 0:
        why = (f"least estimated TTFT {win.cost:.3f}s with {win.gpu_blocks} cached and "
               f"{win.offload_blocks} restorable blocks")
    else:
        why = f"no prefix anywhere; least estimated TTFT {win.cost:.3f}s"
    if skipped:
        why += f"; {skipped} overloaded endpoint(s) skipped"
    return why
