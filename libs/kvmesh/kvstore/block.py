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
    data: bytes | None = None
    crc32c: int = 0
    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    depth: int = 0
    session: str = ""


class CapacityError(Exception):
    """A tier cannot make room (the block is bigger than the tier, or eviction is disabled)."""


def block_key(bid: Hashable) -> int:
    return bid[1]  # type: ignore[index]
