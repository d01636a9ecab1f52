"""The common leading run of two sequences, at C speed: shared by every "what did the next turn
keep of the last one" question (token ids in the trace models, text in incremental tokenization)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the common leading run of ``a`` and ``b`` (lists or strings).

    Slice comparisons run in C, so a binary search over them beats a Python loop by far on the
    200k-element sequences of agent turns.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1          # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
