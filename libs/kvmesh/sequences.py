"""The common leading run of two sequences, at C speed: shared by every "what did the next turn
keep of the last one" question (token ids in the trace models, text in incremental tokenization)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


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


class IdArray(Sequence[int]):
    """Token ids kept in an ``array('I')``, read like a list: slices are lists, items ints.

    A 200k-token prompt as a Python list is 200k int objects; making one (``array.tolist``) costs
    3 ms on a quiet core and 15-25 ms on a busy one, on every request of an agent turn. The router
    reads prompt ids in slices of a block (hashing, prefix checks), so slicing out lists is as
    fast and whole-prompt lists are never made. Equal to any sequence with the same ids.
    """

    __slots__ = ("array",)

    def __init__(self, ids: Any) -> None:
        self.array = ids

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.array[i].tolist()
        return self.array[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.array)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdArray):
            return self.array == other.array
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self.array) and self.array.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"IdArray({len(self.array)} ids)"
