"""Plain data passed between the routing pieces (no behaviour, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.routing.endpoint_columns import EndpointColumns

ROLE_DECODE = "decode"
ROLE_PREFILL = "prefill"
ROLE_BOTH = "both"
ROLE_STORE = "store"


@dataclass
class EndpointView:
    """One worker as the router knows it."""

    endpoint_id: str
    address: str = ""
    model: str = ""
    role: str = ROLE_DECODE
    block_size: int = 0
    alive: bool = True
    source: str = "static"   # static | registry

    @property
    def decodes(self) -> bool:
        return self.role in (ROLE_DECODE, ROLE_BOTH)

    @property
    def prefills(self) -> bool:
        return self.role in (ROLE_PREFILL, ROLE_BOTH)


@dataclass
class TierMatch:
    """Leading matched blocks of one chain on one endpoint, per tier.

    Each count is a leading (prefix) length, so block ``i`` is available in a tier
    exactly when ``i < count``.
    """

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    speculative: int = 0
    # Blocks a sibling's split prefill is computing for this decode endpoint: here only once
    # that prefill is done and restored, so they are worth a restore, and only with a split.
    pending: int = 0

    def merged(self, other: TierMatch) -> TierMatch:
        return TierMatch(max(self.gpu, other.gpu), max(self.cpu, other.cpu), max(self.disk, other.disk),
                         max(self.speculative, other.speculative), max(self.pending, other.pending))

    @property
    def any(self) -> int:
        return max(self.gpu, self.cpu, self.disk, self.speculative, self.pending)


@dataclass
class Matches:
    """What the index knows about a chain: per-endpoint matches plus the shared store's."""

    per_endpoint: dict[str, TierMatch] = field(default_factory=dict)
    # Blocks restorable from the shared offload store by any decode endpoint.
    store: TierMatch = field(default_factory=TierMatch)
    source: str = "indexer"   # indexer | approx | none
    # The per-endpoint matches as arrays instead of ``per_endpoint`` (the simulator's index
    # answers this way; see kvmesh.routing.endpoint_columns).
    columns: EndpointColumns | None = None
    # Endpoint id -> KV-event batches of it the index had applied when it answered (None: not
    # told); with the worker's own count it tells index lag from a view bug (routing.fidelity).
    applied: dict[str, int] | None = None

    def get(self, endpoint_id: str) -> TierMatch:
        if self.columns is not None:
            return self.columns.get(endpoint_id)
        return self.per_endpoint.get(endpoint_id) or TierMatch()


@dataclass
class RouteRequest:
    """The routing-relevant view of one request (already tokenized and hashed)."""

    request_id: str
    model: str
    keys: list[int]              # event-form block keys of the prompt's full blocks
    num_tokens: int
    block_size: int
    session_id: str = ""
    tenant: str = ""


COST_TERMS = ("wait_s", "own_s", "decode_s", "work_s", "displace_s", "blocking_s", "evicted_s", "kv_wait_s")
"""The ``Candidate`` fields whose sum is its cost under the placement cost (kvmesh.routing.scoring)."""


@dataclass
class Candidate:
    """One endpoint's evaluation; kept on the decision for traces and debugging."""

    endpoint_id: str
    cost: float                  # estimated seconds to first token there (see routing.scoring)
    credit_blocks: float         # leading blocks cached or restorable there
    gpu_blocks: int
    offload_blocks: int
    speculative_blocks: int
    uncached_tokens: int
    queue: float
    prefill_tokens: float
    wait_s: float = 0.0          # queued prefill ahead of it (minus what it shares)
    own_s: float = 0.0           # its own uncached prefill + restore
    decode_s: float = 0.0        # decode load it would run alongside
    work_s: float = 0.0          # price of the prefill it adds beyond the cheapest placement's (saturated)
    displace_s: float = 0.0      # price of the cached KV its new blocks would evict there
    blocking_s: float = 0.0      # price of the waits its own prefill adds to the sessions homed there
    evicted_s: float = 0.0       # recompute of the hit's tail evicted before it runs (ScoringConfig.gpu_survival)
    kv_wait_s: float = 0.0       # wait for KV space beside the running requests there (ScoringConfig.kv_wait_weight)
    store_blocks: int = 0        # leading blocks any endpoint could restore from the offload store
    pending_blocks: int = 0      # of offload_blocks, only there after a sibling's split prefill
    hot: bool = False
    excluded: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class Decision:
    """The outcome of one routing decision (mirrors the proto RoutingDecision)."""

    endpoint_id: str
    policy: str
    predicted_cached_tokens_gpu: int = 0
    predicted_cached_tokens_offload: int = 0
    uncached_tokens: int = 0
    score: float = 0.0
    reason: str = ""
    fallback: str = ""           # non-empty when a policy fell back (e.g. "indexer unavailable")
    candidates: list[Candidate] = field(default_factory=list)
    # The live router's view behind the prediction (kvmesh.routing.fidelity.RouterSide), kept
    # until the engine's final report so a miss can be classified; None elsewhere.
    view: Any = None
    # Non-empty: admission control holds the request at the router (kvmesh.routing.admission);
    # the caller decides again after ``ScoringConfig.admit_recheck_s`` instead of sending it.
    hold: str = ""
    # Set when the request is sent: its session's previous turn went to another endpoint
    # (kvmesh.routing.moves).
    moved: bool = False
    # Cached tokens the policy's view predicted on the session's previous endpoint when it chose
    # another one (0 otherwise): with the prediction here, what the move gave up (given_up_tokens).
    previous_cached_tokens: int = 0
    # For a policy that predicts nothing: the chosen endpoint's cached tokens as the index showed
    # them to the split rule (RouterCore.decide_split; -1: not looked up).
    split_view_cached_tokens: int = -1

    @property
    def predicted_cached_tokens(self) -> int:
        return self.predicted_cached_tokens_gpu + self.predicted_cached_tokens_offload

    @property
    def survival_predicted_tokens(self) -> int:
        """The prediction the split's survival rule (kvmesh.routing.survival) learns from once the
        engine reports: the policy's own, or the index's view the split rule read in its place."""
        return self.split_view_cached_tokens if self.split_view_cached_tokens >= 0 else self.predicted_cached_tokens

    @property
    def given_up_tokens(self) -> int:
        """Of a moved turn, the cached tokens its previous endpoint was predicted to hold beyond
        the chosen one's prediction: the reuse the move gave up, as the policy saw it."""
        if not self.moved:
            return 0
        return max(0, self.previous_cached_tokens - self.predicted_cached_tokens)

    def chosen(self) -> Candidate | None:
        """The chosen endpoint's evaluation among ``candidates`` (None: not reported)."""
        return next((c for c in self.candidates if c.endpoint_id == self.endpoint_id), None)
