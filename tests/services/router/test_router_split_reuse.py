"""The router's hit-rate counters for a split whose decode endpoint recomputed part of the
prefill's KV (the store evicted it before the restore): that part is no reuse, even where the
prefill endpoint had found it cached (kvmesh.routing.split_reuse)."""

from __future__ import annotations

from types import SimpleNamespace

from kvmesh_api.common.v1 import common_pb2
from kvmesh_router import metrics
from kvmesh_router.service import RouterService


def _value(counter, **labels) -> float:
    return (counter.labels(**labels) if labels else counter)._value.get()


def _counts() -> tuple[float, ...]:
    return (_value(metrics.CACHED_TOKENS, tier="gpu"), _value(metrics.CACHED_TOKENS, tier="offload"),
            _value(metrics.TRANSFERRED_TOKENS), _value(metrics.SPLIT_LOST_TOKENS))


def _delta(before: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(a - b for a, b in zip(_counts(), before, strict=True))


def test_a_split_reuses_what_neither_engine_computed() -> None:
    p = SimpleNamespace(prefill_usage=common_pb2.Usage(cached_tokens=600, cached_tokens_gpu=400,
                                                       cached_tokens_offload=200))
    # The whole transfer arrived: reuse is the prefill endpoint's hit, the rest a transfer.
    before = _counts()
    assert RouterService.count_reuse(p, common_pb2.Usage(prompt_tokens=1000, cached_tokens=999), split=True) \
        == (600, 399)
    assert _delta(before) == (400, 200, 399, 0)
    # The store lost the prompt past token 500: the decode endpoint computed 100 of the prefill's hit again.
    before = _counts()
    assert RouterService.count_reuse(p, common_pb2.Usage(prompt_tokens=1000, cached_tokens=500), split=True) \
        == (500, 0)
    assert _delta(before) == (400, 100, 0, 100)


def test_without_a_split_the_engine_count_is_the_reuse() -> None:
    before = _counts()
    usage = common_pb2.Usage(prompt_tokens=1000, cached_tokens=700, cached_tokens_gpu=500, cached_tokens_offload=200)
    assert RouterService.count_reuse(SimpleNamespace(prefill_usage=None), usage, split=False) == (700, 0)
    assert _delta(before) == (500, 200, 0, 0)
