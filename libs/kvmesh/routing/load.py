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

    @property
    def queue(self) -> float:
        return self.running + self.waiting


@dataclass
class _InFlight:
    endpoint_id: str
    sent_at: float
    prefill_tokens: int
    prefilling: bool = True


@dataclass
class LoadView:
    """Per-endpoint load with a staleness bound and optimistic in-flight counting."""

    staleness_s: float = 2.0
    reports: dict[str, LoadReport] = field(default_factory=dict)
    _inflight: dict[str, _InFlight] = field(default_factory=dict)

    def update(self, endpoint_id: str, report: LoadReport) -> None:
        self.reports[endpoint_id] = report

    def forget(self, endpoint_id: str) -> None:
        self.reports.pop(endpoint_id, None)

    def on_sent(self, endpoint_id: str, request_id: str, prefill_tokens: int, now: float) -> None:
        self._inflight[request_id] = _InFlight(endpoint_id, now, max(0, int(prefill_tokens)))

    def on_first_token(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is not None:
            f.prefilling = False

    def on_finished(self, request_id: str) -> None:
        self._inflight.pop(request_id, None)

    def inflight_count(self, endpoint_id: str) -> int:
        return sum(1 for f in self._inflight.values() if f.endpoint_id == endpoint_id)

    def effective(self, endpoint_id: str, now: float) -> EffectiveLoad:
        rep = self.reports.get(endpoint_id)
        fresh = rep is not None and (now - rep.received_at) <= self.staleness_s
        since = rep.received_at if fresh and rep is not None else float("-inf")
        extra_req = 0
        extra_prefill = 0
        total = 0
        for f in self._inflight.values():
            if f.endpoint_id != endpoint_id:
                continue
            total += 1
            # Requests sent before the report are assumed to be included in it.
            if f.sent_at > since:
                extra_req += 1
                if f.prefilling:
                    extra_prefill += f.prefill_tokens
        if fresh and rep is not None:
            return EffectiveLoad(running=rep.running, waiting=rep.waiting + extra_req,
                                 prefill_tokens=rep.waiting_prefill_tokens + extra_prefill,
                                 kv_usage=rep.kv_usage, inflight=total, stale=False)
        return EffectiveLoad(running=0, waiting=extra_req, prefill_tokens=extra_prefill, inflight=total, stale=True)
