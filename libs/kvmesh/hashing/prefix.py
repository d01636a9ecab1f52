"""Common leading run of two block-key chains.

Block keys are chained hashes (each covers its parent), so two chains that agree
at block *i* agree on every block before it: the common prefix is found by
binary search. The router (prefix memory, load view) and the sim engine
(queued prefixes) both need it.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of two key chains (chained hashes: equality is monotone)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
