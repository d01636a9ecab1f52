"""The budget of hedged first tokens: at most a fraction of requests send a second copy.

Why it exists: a hedge (a second copy of a request sent to another endpoint when the first
has produced no token after a delay) cuts the tail a stalled or slow worker causes, but each
one costs a prefill elsewhere. Unbounded, a fleet-wide slowdown would make every request a
hedge and double the load that caused it. So hedges draw on a token bucket, as gRPC's retry
throttling does: every request adds ``fraction`` of a token, up to ``burst`` tokens, and a
hedge takes one. Over any stretch of traffic, hedges <= fraction x requests + burst.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HedgeBudget:
    fraction: float = 0.1   # long-run share of requests that may be hedged
    burst: float = 5.0      # hedges allowed at once after a quiet spell (the bucket's size)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"hedge budget fraction must be in [0, 1], got {self.fraction}")
        if self.burst < 0:
            raise ValueError(f"hedge burst must be >= 0, got {self.burst}")
        self.tokens = float(self.burst)

    def on_request(self) -> None:
        """A request arrived: it earns its share of a hedge."""
        self.tokens = min(self.burst, self.tokens + self.fraction)

    def take(self) -> bool:
        """Spend one hedge if the budget has it."""
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
