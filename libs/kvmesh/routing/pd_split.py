"""Whether to run a request's prefill on a separate prefill endpoint.

Disaggregation only pays when the decode endpoint would otherwise spend a long
time prefilling (many uncached tokens) and a prefill endpoint can start soon.
Short or mostly-cached prompts stay local: the KV transfer through the
offload store would cost more than it saves. Given an estimate of the TTFT the
split adds (``kvmesh.routing.scoring.split_extra_s``: the prefill endpoint's
queue, what it already caches, and the restores of a long cached context,
against the chosen endpoint's queue), a split that would delay the first token
by more than ``max_extra_ttft_s`` stays local too — a split buys decode
endpoints a prefill-free batch, not at any price. Among prefill endpoints with
room the one with the least added TTFT wins, so a prefix that survives only in
one prefill endpoint's cache is reused there (as Dynamo's KV-aware prefill
router does) instead of recomputed. The decision and every input go on the
response and the trace so a wrong split can be explained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
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
    read_index: bool = field(default=True, metadata={
        "help": "for a policy that predicts no cached tokens (session, round_robin, random, least_load), decide "
                "the split from the index's matches for the decode endpoint it chose, so a prompt that endpoint "
                "holds stays there (false: such a policy splits every prompt of --split-threshold-tokens or more)"})
    survival_floor: float = field(default=0.9, metadata={
        "help": "when the chosen endpoint's engine has lately found less than this share of the cached tokens "
                "the router predicted there, count the share it is likely to miss as uncached: recomputed behind "
                "that endpoint's queue, or restored at once on a prefill endpoint (kvmesh.routing.survival; "
                "0 = off)"})
    survival_decay: float = field(default=0.95, metadata={
        "help": "weight of the past in that share, per request observed on the endpoint (0.95: about the "
                "last 20)"})


# The split's fields, for the services' and the simulator's flags that set them (one help text).
SPLIT_FIELDS = {f.name: f for f in fields(SplitConfig)}


def survival_problem(floor: float, decay: float) -> str:
    """What is wrong with the survival rule's settings ('' when nothing): both are shares."""
    if not 0.0 <= floor <= 1.0:
        return f"setting 'split_survival_floor' must be in [0, 1], got {floor}"
    if not 0.0 <= decay < 1.0:
        return f"setting 'split_survival_decay' must be in [0, 1), got {decay}"
    return ""


@dataclass
class SplitDecision:
    split: bool
    prefill_endpoint: str = ""
    prefill_uncached_tokens: int = 0   # what the prefill endpoint computes (its cache and the store counted)
    reason: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)


def decide_split(uncached_tokens: int, prompt_tokens: int, prefill_endpoints: list[EndpointView],
                 loads: dict[str, EffectiveLoad], cfg: SplitConfig,
                 extra_s: Callable[[str, EffectiveLoad], float] | None = None,
                 remote_uncached: Callable[[str], int] | None = None) -> SplitDecision:
    """Split iff enabled, ``uncached_tokens >= threshold``, some prefill endpoint has room and
    (given ``extra_s``, the TTFT the split adds on that endpoint with its load) it delays the
    first token by at most ``max_extra_ttft_s``.

    ``remote_uncached`` gives the tokens a prefill endpoint would compute (its own cache
    and the store counted); without it, the decode endpoint's ``uncached_tokens``.
    """
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
        need = remote_uncached(e.endpoint_id) if remote_uncached is not None else uncached_tokens
        if ld.queue < cfg.prefill_max_queue and ld.prefill_tokens + need <= cfg.prefill_max_tokens:
            extra = extra_s(e.endpoint_id, ld) if extra_s is not None else 0.0
            roomy.append((extra, ld.prefill_tokens, ld.queue, need, e.endpoint_id))
    inputs["prefill_with_room"] = len(roomy)
    if not roomy:
        return SplitDecision(False, reason="no prefill endpoint has room", inputs=inputs)
    roomy.sort()
    extra, queued, queue, need, chosen = roomy[0]
    inputs["prefill_queue"] = queue
    inputs["prefill_queued_tokens"] = queued
    inputs["prefill_uncached_tokens"] = need
    if extra_s is not None:
        inputs["split_extra_ttft_s"] = round(extra, 4)
        if extra > cfg.max_extra_ttft_s:
            return SplitDecision(False, reason=f"split would add {extra:.2f}s to TTFT "
                                               f"(> {cfg.max_extra_ttft_s:g}s; long cached context)", inputs=inputs)
    return SplitDecision(True, prefill_endpoint=chosen, prefill_uncached_tokens=need,
                         reason=f"uncached {uncached_tokens} >= threshold {cfg.threshold_tokens}", inputs=inputs)
