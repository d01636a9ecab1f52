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


def common_prefix_near(a: Sequence[int], b: Sequence[int], guess: int, alt: int = -1) -> int:
    """:func:`common_prefix`, tried first at ``guess`` and then at ``alt``: two comparisons
    for each.

    Many remembered chains leave one prompt at one of a few depths (the end of the system
    prompt every session shares, the end of this session's shared context), so the last
    two answers are good guesses for the next chain.
    """
    n = min(len(a), len(b))
    for g in (guess, alt):
        if 0 <= g <= n and (g == 0 or a[g - 1] == b[g - 1]) and (g == n or a[g] != b[g]):
            return g
    return common_prefix(a, b)


def extends(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether chain ``b`` starts with all of chain ``a`` (``common_prefix(a, b) == len(a)``):
    with chained keys, one comparison of ``a``'s last key."""
    return len(a) <= len(b) and (not a or a[-1] == b[len(a) - 1])
