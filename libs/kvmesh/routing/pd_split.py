"""Whether to run a request's prefill on a separate prefill endpoint.

Disaggregation only pays when the decode endpoint would otherwise spend a long
time prefilling (many uncached tokens) and a prefill endpoint can start soon.
Short or mostly-cached prompts stay local: the KV transfer through the
offload store would cost more than it saves. Given an estimate of the TTFT the
split adds (``kvmesh.routing.scoring.split_extra_s``: the prefill endpoint's
queue and the restores of a long cached context, against the chosen endpoint's
queue), a split that would delay the first token by more than
``max_extra_ttft_s`` stays local too — a split buys decode endpoints a
prefill-free batch, not at any price. The decision and every input go
on the response and the trace so a wrong split can be explained.
"""

from __future__ import annotations

from collections.abc import Callable
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
    max_extra_ttft_s: float = field(default=1.0, metadata={
        "help": "do not split when it is estimated to delay the first token by more than this"})


@dataclass
class SplitDecision:
    split: bool
    prefill_endpoint: str = ""
    reason: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)


def decide_split(uncached_tokens: int, prompt_tokens: int, prefill_endpoints: list[EndpointView],
                 loads: dict[str, EffectiveLoad], cfg: SplitConfig,
                 extra_s: Callable[[EffectiveLoad], float] | None = None) -> SplitDecision:
    """Split iff enabled, ``uncached_tokens >= threshold``, some prefill endpoint has room and
    (given ``extra_s``, the TTFT the split adds with that endpoint's load) it delays the
    first token by at most ``max_extra_ttft_s``."""
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
    if extra_s is not None:
        extra = extra_s(loads.get(chosen) or EffectiveLoad())
        inputs["split_extra_ttft_s"] = round(extra, 4)
        if extra > cfg.max_extra_ttft_s:
            return SplitDecision(False, reason=f"split would add {extra:.2f}s to TTFT "
                                               f"(> {cfg.max_extra_ttft_s:g}s; long cached context)", inputs=inputs)
    return SplitDecision(True, prefill_endpoint=chosen,
                         reason=f"uncached {uncached_tokens} >= threshold {cfg.threshold_tokens}", inputs=inputs)
