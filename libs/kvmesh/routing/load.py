"""The router's view of each endpoint's load: last reported values plus its own in-flight requests.

Workers report load (``GetLoad``) every few hundred milliseconds, but a burst of
sibling requests arrives within milliseconds. Without counting what the router
itself just sent, every request of a burst would see the same stale "idle"
endpoint and pile onto it. So the view is: the last report, if it is younger
than the staleness bound, plus the router's requests sent after that report
(optimistically assumed queued there). A report older than the bound is
ignored and only the router's own in-flight requests count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.hashing.prefix import common_prefix


@dataclass
class LoadReport:
    """One ``GetLoad`` answer; ``received_at`` is on the router's clock."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    waiting_prefill_tokens: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    received_at: float = 0.0


@dataclass
class EffectiveLoad:
    """Load used for scoring: report (if fresh) + optimistic in-flight."""

    running: float = 0.0
    waiting: float = 0.0
    prefill_tokens: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0
    stale: bool = True
    # KV the running requests hold (vLLM's usage x blocks at the last report, in blocks) plus the
    # context tokens of the router's requests sent since: what every decode step must read there.
    active_blocks: float = 0.0
    inflight_ctx_tokens: float = 0.0

    @property
    def queue(self) -> float:
        return self.running + self.waiting


@dataclass
class _InFlight:
    endpoint_id: str
    sent_at: float
    prefill_tokens: int
    prefilling: bool = True
    keys: list[int] | None = None     # the prompt's block keys (what its prefill computes)
    num_tokens: int = 0
    cached_tokens: int = 0            # predicted cached at send: its prefill starts there


@dataclass
class LoadView:
    """Per-endpoint load with a staleness bound and optimistic in-flight counting."""

    staleness_s: float = 2.0
    reports: dict[str, LoadReport] = field(default_factory=dict)
    _inflight: dict[str, _InFlight] = field(default_factory=dict)
    # The same requests by endpoint: scoring reads every endpoint's load per decision, and a
    # scan of all in-flight requests per endpoint would cost endpoints x requests at fleet scale.
    _by_endpoint: dict[str, dict[str, _InFlight]] = field(default_factory=dict)

    def update(self, endpoint_id: str, report: LoadReport) -> None:
        self.reports[endpoint_id] = report

    def forget(self, endpoint_id: str) -> None:
        self.reports.pop(endpoint_id, None)

    def on_sent(self, endpoint_id: str, request_id: str, prefill_tokens: int, now: float,
                keys: list[int] | None = None, num_tokens: int = 0, cached_tokens: int = 0) -> None:
        self.on_finished(request_id)
        f = _InFlight(endpoint_id, now, max(0, int(prefill_tokens)), True, keys, max(0, int(num_tokens)),
                      max(0, int(cached_tokens)))
        self._inflight[request_id] = f
        self._by_endpoint.setdefault(endpoint_id, {})[request_id] = f

    def pending_overlap(self, keys: list[int], block_size: int) -> dict[str, int]:
        """Per endpoint: queued prefill tokens (of the router's in-flight requests) that compute
        leading blocks of ``keys``.

        A sibling sub-agent sent right after the first one of its burst shares its prefix. The
        first one's prefill, still queued where it went, computes exactly what the sibling will
        reuse there: waiting for it is no extra delay compared with recomputing it elsewhere.
        """
        out: dict[str, int] = {}
        if not keys or block_size <= 0:
            return out
        head = keys[0]
        for f in self._inflight.values():
            if not f.prefilling or not f.keys or f.keys[0] != head or f.prefill_tokens <= 0:
                continue
            shared = min(common_prefix(f.keys, keys) * block_size, f.num_tokens or 1 << 62)
            n = min(max(0, shared - f.cached_tokens), f.prefill_tokens)
            if n > out.get(f.endpoint_id, 0):
                out[f.endpoint_id] = n
        return out

    def on_first_token(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is None:
            return
        f.prefilling = False
        # A report taken since the request was sent still counts its prefill as queued; left
        # as it is, the endpoint would look busy with work that is done until the next poll,
        # and a burst's late siblings would leave the endpoint that holds their prefix.
        rep = self.reports.get(f.endpoint_id)
        if rep is not None and rep.received_at >= f.sent_at and f.prefill_tokens:
            rep.waiting_prefill_tokens = max(0, rep.waiting_prefill_tokens - f.prefill_tokens)

    def on_finished(self, request_id: str) -> None:
        f = self._inflight.pop(request_id, None)
        if f is not None:
            mine = self._by_endpoint.get(f.endpoint_id)
            if mine is not None:
                mine.pop(request_id, None)
                if not mine:
                    del self._by_endpoint[f.endpoint_id]

    def inflight_count(self, endpoint_id: str) -> int:
        return len(self._by_endpoint.get(endpoint_id, ()))

    def effective(self, endpoint_id: str, now: float) -> EffectiveLoad:
        rep = self.reports.get(endpoint_id)
        fresh = rep is not None and (now - rep.received_at) <= self.staleness_s
        since = rep.received_at if fresh and rep is not None else float("-inf")
        extra_req = 0
        extra_prefill = 0
        extra_ctx = 0
        total = 0
        for f in self._by_endpoint.get(endpoint_id, {}).values():
            total += 1
            # Requests sent before the report are assumed to be included in it.
            if f.sent_at > since:
                extra_req += 1
                extra_ctx += f.num_tokens
                if f.prefilling:
                    extra_prefill += f.prefill_tokens
        if fresh and rep is not None:
            return EffectiveLoad(running=rep.running, waiting=rep.waiting + extra_req,
                                 prefill_tokens=rep.waiting_prefill_tokens + extra_prefill,
                                 kv_usage=rep.kv_usage, inflight=total, stale=False,
                                 active_blocks=rep.kv_usage * max(rep.num_blocks, 0), inflight_ctx_tokens=extra_ctx)
        return EffectiveLoad(running=0, waiting=extra_req, prefill_tokens=extra_prefill, inflight=total, stale=True,
                             inflight_ctx_tokens=extra_ctx)
