"""Best achievable prefix hit rates for a request sequence.

Why it exists: a hit rate means little without the ceiling it is measured
against. ``ceiling_infinite`` is what an infinite cache shared by everything
would hit; ``ceiling_pooled`` is one pooled LRU of a fixed total capacity (the
cluster's GPU + offload tokens), i.e. the best any routing could do if all
workers were one big cache. Both count prompt tokens served from cache, with
the engine's rule that the prompt's last token is always computed, and insert
a request's blocks after it is served (its own blocks can't hit itself).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import islice, takewhile

from kvmesh_tools.traffic.model import Request


def _cap(req: Request) -> int:
    return min(len(req.hash_ids), max(0, (req.input_tokens - 1) // req.block_size))


def _leading(keys: list[int], cap: int, cached: Callable[[int], bool]) -> int:
    """Leading keys (at most ``cap``) that ``cached`` holds, scanned in C (a fleet-scale trace
    has about 10^8 blocks)."""
    return len(list(takewhile(cached, islice(keys, cap))))


def ceiling_infinite(requests: Iterable[Request]) -> float:
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        keys = r.keys
        hit += _leading(keys, _cap(r), seen.__contains__) * r.block_size
        total += r.input_tokens
        seen.update(keys)
    return hit / total if total else 0.0


def ceiling_pooled(requests: Iterable[Request], capacity_tokens: int) -> float:
    """One LRU of ``capacity_tokens``; a request's blocks are touched head last (tail evicted first)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    cap_blocks: int | None = None
    for r in requests:
        if cap_blocks is None:
            cap_blocks = max(0, capacity_tokens // r.block_size)
        keys = r.keys
        hit += _leading(keys, _cap(r), lru.__contains__) * r.block_size
        total += r.input_tokens
        if cap_blocks == 0:
            continue
        move = lru.move_to_end
        for k in reversed(keys[-cap_blocks:]):
            if k in lru:
                move(k)
            else:
                lru[k] = None
        while len(lru) > cap_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0
