"""How much of a predicted hit each endpoint's engine still found when the request ran.

A prediction is a picture of the caches at decision time. Where a worker's GPU cache holds
about one agent context and its queue is minutes long, the picture is gone by the time the
turn is scheduled: the contexts ahead of it in the queue evict it, and the store has churned
too. On the live-sized set-up of #18 (4 decode workers of 114,688 tokens, a 512k-token store,
32 sessions starting together) precise predicted 0.92 of its local turns' prompts cached in
the congested first 40 minutes and the engines found 0.26 (docs/bench-history.md, session 60).
The split rule read the prediction, saw almost nothing uncached, and kept those turns on the
decode queue that was evicting them, where a prefill endpoint with a short queue would have
restored them from the store at once.

This table learns the engines' answer instead of modelling the eviction: per endpoint, a
token-weighted moving ratio of the cached tokens the engine reported to those the router
predicted, over the requests that ran there without a split. Where a cache keeps what it
shows (the 8 × 1M-token regimes, 0.997 of predicted tokens found) the ratio stays near 1 and
nothing changes; :meth:`HitSurvival.expected_loss` is 0 above ``floor``, so one unlucky
request does not move decisions.
"""

from __future__ import annotations


class HitSurvival:
    """Per endpoint: engine-reported cached tokens over predicted cached tokens, decayed per request."""

    def __init__(self, decay: float = 0.95, floor: float = 0.9) -> None:
        self.decay, self.floor = decay, floor   # pd_split.SplitConfig.survival_decay / survival_floor
        self._sums: dict[str, tuple[float, float]] = {}   # endpoint -> (found, predicted)

    def observe(self, endpoint_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        """One request that ran on ``endpoint_id`` without a split. A request predicted to hit
        nothing says nothing about survival; a hit beyond the prediction counts as found in full,
        not more (a sibling's prefill that landed first is luck, not a sign the cache keeps)."""
        if predicted_tokens <= 0:
            return
        d = self.decay
        found, predicted = self._sums.get(endpoint_id, (0.0, 0.0))
        self._sums[endpoint_id] = (found * d + min(max(actual_tokens, 0), predicted_tokens),
                                   predicted * d + predicted_tokens)

    def rate(self, endpoint_id: str) -> float:
        """The share of predicted cached tokens the endpoint's engine found (1 before any report)."""
        found, predicted = self._sums.get(endpoint_id, (0.0, 0.0))
        return found / predicted if predicted > 0 else 1.0

    def expected_loss(self, endpoint_id: str, predicted_tokens: int) -> int:
        """Tokens of a predicted hit of ``predicted_tokens`` on ``endpoint_id`` the engine is
        likely not to find: 0 while its survival ratio is at least ``floor``
        (``floor`` 0: never)."""
        r = self.rate(endpoint_id)
        if predicted_tokens <= 0 or r >= self.floor:
            return 0
        return int((1.0 - r) * predicted_tokens)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left (or restarted with an empty cache)."""
        self._sums.pop(endpoint_id, None)
