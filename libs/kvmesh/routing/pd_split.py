"""Whether to run a request's prefill on a separate prefill endpoint.

Disaggregation only pays when the decode endpoint would otherwise spend a long
time prefilling (many uncached tokens) and a prefill endpoint can start soon.
Short or mostly-cached prompts stay local: the KV transfer through the
offload store would cost more than it saves. The decision and every input go
on the response and the trace so a wrong split can be explained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.routing.load import EffectiveLoad
from kvmesh.routing.types import EndpointView


@dataclass
class SplitConfig:
    enabled: bool = field(default=False, metadata={"help": "allow the prefill/decode split"})
    threshold_tokens: int = field(default=2048, metadata={"help": "split when uncached tokens on decode >= this"})
    prefill_max_queue: int = field(default=4, metadata={"help": "a prefill endpoint has room below this queue"})
    prefill_max_tokens: int = field(default=262_144,
                                    metadata={"help": "... and below this many queued prefill tokens"})


@dataclass
class SplitDecision:
    split: bool
    prefill_endpoint: str = ""
    reason: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)


def decide_split(uncached_tokens: int, prompt_tokens: int, prefill_endpoints: list[EndpointView],
                 loads: dict[str, EffectiveLoad], cfg: SplitConfig) -> SplitDecision:
    """Split iff enabled, ``uncached_tokens >= threshold`` and some prefill endpoint has room."""
    inputs: dict[str, Any] = {"uncached_tokens": uncached_tokens, "prompt_tokens": prompt_tokens,
                              "threshold_tokens": cfg.threshold_tokens,
                              "prefill_endpoints": len(prefill_endpoints)}
    if not cfg.enabled:
        return SplitDecision(False, reason="split disabled", inputs=inputs)
    if uncached_tokens < cfg.threshold_tokens:
        return SplitDecision(False, reason=f"uncached {uncached_tokens} < threshold {cfg.threshold_tokens}",
                             inputs=inputs)
    roomy = []
    for e in prefill_endpoints:
        ld = loads.get(e.endpoint_id) or EffectiveLoad()
        if ld.queue < cfg.prefill_max_queue and ld.prefill_tokens + uncached_tokens <= cfg.prefill_max_tokens:
            roomy.append((ld.prefill_tokens, ld.queue, e.endpoint_id))
    inputs["prefill_with_room"] = len(roomy)
    if not roomy:
        return SplitDecision(False, reason="no prefill endpoint has room", inputs=inputs)
    roomy.sort()
    chosen = roomy[0][2]
    inputs["prefill_queue"] = roomy[0][1]
    inputs["prefill_queued_tokens"] = roomy[0][0]
    return SplitDecision(True, prefill_endpoint=chosen,
                         reason=f"uncached {uncached_tokens} >= threshold {cfg.threshold_tokens}", inputs=inputs)
