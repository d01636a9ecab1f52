"""What the store keeps per block, shared by the tiers and the store core."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

# (namespace, block key): blocks are content-addressed per model/KV-layout namespace.
BlockId = tuple[str, int]


@dataclass(slots=True)
class StoredBlock:
    """One block. ``data`` is None in metadata-only mode (the cluster simulator),
    where ``size`` is whatever unit the capacity is counted in (bytes, blocks or tokens)."""

    size: int
    data: object = None             # bytes, memoryview or an arena Slot (see buffer_of)
    checksum: int = 0             # XXH3-64 of the bytes (kvstore.checksum)
    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    depth: int = 0
    session: str = ""

    @classmethod
    def metadata(cls, size: int, depth: int, session: str) -> StoredBlock:
        """A metadata-only block: what the cluster simulator stores, millions per run. Positional,
        as a keyword call of the generated ``__init__`` costs about three times as much."""
        return cls(size, None, 0, None, (), 0, depth, session)


class CapacityError(Exception):
    """A tier cannot make room (the block is bigger than the tier, or eviction is disabled)."""


def block_key(bid: Hashable) -> int:
    return bid[1]  # type: ignore[index]


def buffer_of(data: object) -> bytes | memoryview:
    """The bytes-like payload of a block's ``data`` (unwrapping an arena ``Slot``)."""
    if data is None:
        return b""
    view = getattr(data, "view", None)
    return view if view is not None else data  # type: ignore[return-value]
