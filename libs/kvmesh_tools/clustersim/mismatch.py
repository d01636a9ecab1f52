"""Why a request's predicted cached tokens differ from what the engine actually reused.

The router predicts, at decision time, how much of the prompt the chosen endpoint
will not have to compute. In the simulator the truth is at hand: what the engine
(GPU cache) and the shared store held at that moment, what the index said, which
part of the prediction came from the router's own speculative entries, and what
the engine reused when it scheduled the request. So every miss is explained:

- ``evicted``: the view was right at decision time; blocks left the GPU cache (or
  the store) before the request was scheduled.
- ``filled``: the view was right at decision time; more was cached by the time the
  request was scheduled (a sibling computed the prefix in between).
- ``lag``: the index had not yet applied the engine's latest KV events.
- ``speculative``: the prediction counted blocks from the router's own speculative
  (or pending split) entries that the engine did not hold.
- ``view_bug``: none of those explains it — the router's view disagreed with an
  up-to-date index and engine. A defect; its count must be 0.
- ``no_index``: the policy does not read the index (its prediction is its own
  estimate, by design: session, approx, least_load, ...).
- ``split``: a P/D split; the prediction is for the decode endpoint and the prompt
  was computed on a prefill endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

CLASSES = ("evicted", "filled", "lag", "speculative", "view_bug", "no_index", "split")


@dataclass(slots=True)
class ViewAtDecision:
    """What was true when the router decided (all in blocks, capped at what vLLM can reuse)."""

    predicted: int          # the decision's predicted cached blocks (GPU + restorable)
    truth: int              # what the engine would have reused had it scheduled the request then
    engine_gpu: int         # the chosen engine's own leading GPU-cached blocks
    index_gpu: int          # the index's leading GPU blocks for that endpoint (-1: not asked)
    speculative: int        # of ``predicted``, blocks only the router's speculative/pending entries claimed
    lag: bool               # the engine had KV events the index had not applied yet


def classify(view: ViewAtDecision, actual: int, *, uses_index: bool, split: bool) -> str:
    """The class of a request whose engine reused ``actual`` blocks ("" when the prediction was exact)."""
    if view.predicted == actual:
        return ""
    if split:
        return "split"
    if not uses_index:
        return "no_index"
    if view.predicted == view.truth:
        return "evicted" if actual < view.truth else "filled"
    if view.speculative and view.predicted > view.truth:
        return "speculative"
    if view.lag and view.index_gpu != view.engine_gpu:
        return "lag"
    return "view_bug"


def count(classes: list[str]) -> dict[str, int]:
    """Per class, how many requests; ``requests`` is all mispredicted ones."""
    out = {c: 0 for c in CLASSES}
    for c in classes:
        if c:
            out[c] += 1
    out["requests"] = sum(out.values())
    return out
