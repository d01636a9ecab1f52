"""The prediction-fidelity classifier: one constructed case per class, and the live join."""

from __future__ import annotations

import pytest

from kvmesh.routing.fidelity import (
    CLASSES,
    RouterSide,
    ViewAtDecision,
    classify,
    count,
    live_view,
    split_predicted_blocks,
)


def _view(**kw) -> ViewAtDecision:
    base = dict(predicted=10, truth=10, engine_gpu=10, index_gpu=10, speculative=0, lag=False)
    base.update(kw)
    return ViewAtDecision(**base)


@pytest.mark.parametrize(("view", "actual", "kw", "want"), [
    (_view(), 10, {}, ""),                                                    # exact
    (_view(), 4, {}, "evicted"),                                              # right then, gone by schedule
    (_view(predicted=0, truth=0, engine_gpu=0, index_gpu=0), 6, {}, "filled"),   # a sibling computed it meanwhile
    (_view(predicted=4, truth=10, index_gpu=4, lag=True), 10, {}, "lag"),     # events not yet in the index
    (_view(predicted=10, truth=4, engine_gpu=4, index_gpu=4, speculative=6), 4, {}, "speculative"),
    (_view(predicted=3, truth=10, index_gpu=-1, lookup_timed_out=True), 10, {}, "lookup_timeout"),
    (_view(predicted=12, truth=10), 10, {}, "view_bug"),                      # up-to-date index, still wrong
    (_view(predicted=4, truth=10, index_gpu=4), 10, {}, "view_bug"),          # index disagrees, no pending event
    (_view(), 4, {"uses_index": False}, "no_index"),
    (_view(), 4, {"split": True}, "split"),
    (_view(truth=-1, engine_gpu=-1), 4, {}, "unknown"),                      # the engine could not say
])
def test_each_class(view: ViewAtDecision, actual: int, kw: dict, want: str) -> None:
    assert classify(view, actual, uses_index=kw.get("uses_index", True), split=kw.get("split", False)) == want


def test_every_class_has_a_case() -> None:
    # The parametrized cases above cover every class the classifier can return.
    cases = test_each_class.pytestmark[0].args[1]   # type: ignore[attr-defined]
    assert {c[3] for c in cases} - {""} == set(CLASSES)


def test_count_sums_the_classes() -> None:
    c = count(["", "evicted", "lag", "lag", "view_bug", ""])
    assert c["requests"] == 4 and c["lag"] == 2 and set(CLASSES) <= set(c)


def _side(**kw) -> RouterSide:
    base = dict(predicted=10, index_gpu=10, speculative=0, index_applied=7)
    base.update(kw)
    return RouterSide(**base)


def test_live_view_lag_is_an_index_behind_the_engine_events() -> None:
    # The engine's cache at arrival was described by 8 event batches; the index had applied 7.
    v = live_view(_side(predicted=4, index_gpu=4), known=True, gpu_blocks=10, store_blocks=0, events_through=8)
    assert v.lag and classify(v, 10, uses_index=True, split=False) == "lag"
    # The index had applied all of them and still said 4: the router's view is wrong.
    v = live_view(_side(predicted=4, index_gpu=4, index_applied=8), known=True, gpu_blocks=10, store_blocks=0,
                  events_through=8)
    assert not v.lag and classify(v, 10, uses_index=True, split=False) == "view_bug"


def test_a_store_behind_its_index_is_lag_not_a_view_bug() -> None:
    # The engine's GPU part matched the index; the index still showed 42 store blocks the store
    # had partly evicted (its removal events not yet applied).
    v = live_view(_side(predicted=42, index_gpu=3, index_store=42, index_applied=8), known=True, gpu_blocks=3,
                  store_blocks=40, events_through=8)
    assert classify(v, 40, uses_index=True, split=False) == "lag"
    # The same miss with the store's part right is a view bug.
    v = live_view(_side(predicted=42, index_gpu=3, index_store=40, index_applied=8), known=True, gpu_blocks=3,
                  store_blocks=40, events_through=8)
    assert classify(v, 40, uses_index=True, split=False) == "view_bug"


def test_live_view_truth_is_the_better_of_gpu_and_store() -> None:
    v = live_view(_side(predicted=9, index_gpu=2), known=True, gpu_blocks=2, store_blocks=9, events_through=7)
    assert v.truth == 9 and classify(v, 5, uses_index=True, split=False) == "evicted"


def test_live_view_without_a_report_is_unknown_unless_the_lookup_failed() -> None:
    v = live_view(_side(), known=False, gpu_blocks=0, store_blocks=0, events_through=0)
    assert classify(v, 3, uses_index=True, split=False) == "unknown"
    v = live_view(_side(index_gpu=-1, lookup_timed_out=True), known=False, gpu_blocks=0, store_blocks=0,
                  events_through=0)
    assert classify(v, 3, uses_index=True, split=False) == "lookup_timeout"


def test_a_split_predicts_the_decode_endpoint_after_the_transfer() -> None:
    # 1,000 tokens of 64: 15 full blocks; the last token is always computed, so 15 reusable.
    assert split_predicted_blocks(1000, 64, decode_blocks=0) == 15
    # 1,024 tokens: 16 full blocks, but the last block holds the token vLLM computes.
    assert split_predicted_blocks(1024, 64, decode_blocks=3) == 15
    # A handle naming fewer blocks (the prefill endpoint saved less) limits it...
    assert split_predicted_blocks(1000, 64, decode_blocks=2, handle_blocks=9) == 9
    # ...unless the decode endpoint's own cache already holds more.
    assert split_predicted_blocks(1000, 64, decode_blocks=12, handle_blocks=9) == 12
    assert split_predicted_blocks(10, 64, decode_blocks=0) == 0


def test_a_split_that_delivered_what_was_planned_is_exact_and_one_that_did_not_is_split() -> None:
    planned = split_predicted_blocks(1000, 64, decode_blocks=2)
    view = _view(predicted=planned, truth=2, engine_gpu=2, index_gpu=2)
    assert classify(view, planned, uses_index=True, split=True) == ""
    assert classify(view, planned - 4, uses_index=True, split=True) == "split"
