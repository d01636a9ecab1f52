"""Why a request's predicted cached tokens differ from what the engine actually reused.

The router predicts, at decision time, how much of the prompt the chosen endpoint
will not have to compute. Both the live router and the cluster simulator explain
every miss with the same classifier, so a class means the same thing in
``kvmesh simulate``, ``replay``/``demo``/``soak`` reports and the router's
``kvmesh_router_mispredictions_total{cause}``:

- ``evicted``: the view was right (equal to the engine's cache when the request
  arrived); blocks left the GPU cache (or the store) before it was scheduled.
- ``filled``: the view was right; more was cached by the time the request was
  scheduled (a sibling computed the prefix in between).
- ``lag``: the index had not yet applied the engine's latest KV events (or, live, the
  offload store's: the engine's part of the view was right and the store's was not).
- ``speculative``: the prediction counted blocks from the router's own
  speculative (or pending split) entries that the engine did not hold.
- ``lookup_timeout``: the index did not answer in time (or at all), so the
  prediction is the router's own approximation.
- ``view_bug``: none of those explains it -- the router's view disagreed with an
  up-to-date index and engine. A defect; its count must be 0.
- ``no_index``: the policy does not read the index (its prediction is its own
  estimate, by design: session, approx, least_load, ...).
- ``split``: a P/D split whose KV transfer did not deliver what was planned. A
  split's prediction is what the decode endpoint holds once the prefill endpoint's KV
  has arrived (``split_predicted_blocks``: every full block of the prompt the handle
  covers, or more when the decode endpoint's own cache already holds more); a miss
  means the prefill endpoint saved less, or the decode endpoint restored less.
- ``unknown``: the engine did not report its cache at arrival, or its report was older
  than the index's view (vLLM's comes from the worker's mirror of the engine's KV events,
  ``kvmesh.worker.engine.cache_mirror``), so the miss cannot be told apart.

Where the truth comes from: the simulator holds every engine and the index in
memory. Live, the worker reports a ``CacheTruth`` with its final message: its
leading GPU-cached and store-restorable prompt tokens when the request arrived,
and how many KV-event batches describe that cache; the indexer's ``Lookup``
says how many batches of that endpoint it had applied. Fewer applied than
described means the index lagged.
"""

from __future__ import annotations

from dataclasses import dataclass

CLASSES = ("evicted", "filled", "lag", "speculative", "lookup_timeout", "view_bug", "no_index", "split",
           "unknown")


@dataclass(slots=True)
class ViewAtDecision:
    """What was true when the router decided (all in blocks, capped at what vLLM can reuse)."""

    predicted: int          # the decision's predicted cached blocks (GPU + restorable)
    truth: int              # what the engine would have reused had it scheduled the request then (-1: unknown)
    engine_gpu: int         # the chosen engine's own leading GPU-cached blocks (-1: unknown)
    index_gpu: int          # the index's leading GPU blocks for that endpoint (-1: not asked / no answer)
    speculative: int        # of ``predicted``, blocks only the router's speculative/pending entries claimed
    lag: bool               # the engine had KV events the index had not applied yet
    lookup_timed_out: bool = False   # the index was asked and did not answer in time
    index_store: int = -1   # the index's leading store blocks (-1: not known; the simulator leaves it)
    engine_store: int = -1  # the store's leading blocks when the request arrived (-1: not known)


def classify(view: ViewAtDecision, actual: int, *, uses_index: bool, split: bool) -> str:
    """The class of a request whose engine reused ``actual`` blocks ("" when the prediction was exact)."""
    if view.predicted == actual:
        return ""
    if split:
        return "split"
    if not uses_index:
        return "no_index"
    if view.lookup_timed_out:
        return "lookup_timeout"
    if view.truth < 0:
        return "unknown"
    if view.predicted == view.truth:
        return "evicted" if actual < view.truth else "filled"
    if view.speculative and view.predicted > view.truth:
        return "speculative"
    if view.lag and view.index_gpu != view.engine_gpu:
        return "lag"
    if (view.index_gpu == view.engine_gpu and view.index_store >= 0 and view.engine_store >= 0
            and view.index_store != view.engine_store):
        # The engine's part was right; the store's was not: the store's KV events (saves,
        # evictions) had not reached the index. Not checked by sequence numbers as the engine's are.
        return "lag"
    return "view_bug"


@dataclass(slots=True)
class RouterSide:
    """The router's half of a live ``ViewAtDecision``, kept from the decision until the final message."""

    predicted: int = 0          # blocks
    index_gpu: int = -1         # the index's leading GPU blocks on the chosen endpoint (-1: no answer)
    speculative: int = 0        # blocks only speculative/pending entries claimed
    index_applied: int = -1     # KV-event batches of the chosen endpoint the index had applied (-1: not told)
    index_store: int = -1       # the index's leading store blocks (-1: no answer)
    lookup_timed_out: bool = False
    uses_index: bool = True


def live_view(side: RouterSide, *, known: bool, gpu_blocks: int, store_blocks: int,
              events_through: int) -> ViewAtDecision:
    """Join the router's half with the worker's report of its cache at arrival."""
    if side.index_applied > events_through >= 0 and known:
        # The index had applied batches the worker's report did not rest on: the report is the
        # older view (vLLM's comes from the worker's own mirror of the engine's events, which
        # can trail the indexer by a batch), so it cannot judge the prediction.
        known = False
    if not known:
        return ViewAtDecision(side.predicted, -1, -1, side.index_gpu, side.speculative, False,
                              side.lookup_timed_out)
    lag = side.index_applied < 0 or side.index_applied < events_through
    return ViewAtDecision(side.predicted, max(gpu_blocks, store_blocks), gpu_blocks, side.index_gpu,
                          side.speculative, lag, side.lookup_timed_out, side.index_store, store_blocks)


def split_predicted_blocks(num_tokens: int, block_size: int, decode_blocks: int,
                           handle_blocks: int | None = None) -> int:
    """What a split request's decode endpoint reuses: the prefill endpoint's KV (all of the
    prompt's reusable blocks, or those ``handle_blocks`` the handle names) once transferred,
    or its own ``decode_blocks`` when it already holds more. vLLM always computes the
    prompt's last token, so the prompt's last (partial or full) block is not reusable."""
    cap = max(0, (num_tokens - 1) // block_size) if block_size > 0 else 0
    sent = cap if handle_blocks is None else min(max(handle_blocks, 0), cap)
    return max(sent, min(max(decode_blocks, 0), cap))


def count(classes: list[str]) -> dict[str, int]:
    """Per class, how many requests; ``requests`` is all mispredicted ones."""
    out = {c: 0 for c in CLASSES}
    for c in classes:
        if c:
            out[c] += 1
    out["requests"] = sum(out.values())
    return out
