"""A split's reuse: the prompt tokens neither of its engines computed (kvmesh.routing.split_reuse)."""

from __future__ import annotations

import pytest

from kvmesh.routing.split_reuse import SplitReuse, split_reuse


def test_a_whole_transfer_is_no_reuse_but_the_prefill_hit_is() -> None:
    # The prefill endpoint found 600 tokens (400 on its GPU, 200 in the store) of a 1,000-token
    # prompt and computed the rest; the decode endpoint restored all 999 it could.
    assert split_reuse(400, 200, 999) == SplitReuse(gpu=400, offload=200, transferred=399, lost=0)


def test_what_the_store_lost_before_the_restore_is_no_reuse() -> None:
    # The store evicted the prompt's tail after block 500: the decode endpoint computed tokens
    # 500-999 again, 100 of which the prefill endpoint had found in the store.
    assert split_reuse(400, 200, 500) == SplitReuse(gpu=400, offload=100, transferred=0, lost=100)
    # Everything lost: the decode endpoint recomputed the whole prompt; the GPU hit goes too.
    assert split_reuse(400, 200, 0) == SplitReuse(gpu=0, offload=0, transferred=0, lost=600)
    # Cut inside the GPU part: the store's part goes first (the GPU hit is the leading run).
    assert split_reuse(400, 200, 300) == SplitReuse(gpu=300, offload=0, transferred=0, lost=300)


@pytest.mark.parametrize("gpu,offload,decode", [(0, 0, 0), (0, 0, 1000), (10, 0, 5), (0, 64, 64), (-1, -5, -3)])
def test_the_parts_add_up(gpu: int, offload: int, decode: int) -> None:
    r = split_reuse(gpu, offload, decode)
    assert min(r) >= 0
    assert r.gpu + r.offload + r.lost == max(0, gpu) + max(0, offload)
    assert r.gpu + r.offload + r.transferred == max(0, decode)
