"""A chain of block keys as 8-byte big-endian words: the compact form of ``BlockChain.keys_be64``.

Why: a 200k-token agent turn is a chain of ~3,400 keys. As a protobuf ``repeated uint64`` the
router builds ~3,400 Python ints into the message and the indexer turns them back into a list
and then into the binary blob its Redis scripts read (measured: ~0.25 ms to build, ~0.2 ms to
read and repack, per lookup, on an idle core). As bytes in the backends' own layout (8-byte
big-endian, the Redis layouts' block-key form) the router packs them in one C call and the
indexer hands the bytes to Redis untouched. ``PackedKeys`` is that blob as a read-only sequence
of ints, so backends that walk keys (memory) still can.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import overload

_BIG = sys.byteorder == "big"


def pack_keys(keys: Sequence[int]) -> bytes:
    """``keys`` (uint64) as 8-byte big-endian words."""
    a = array("Q", keys)
    if not _BIG:
        a.byteswap()
    return a.tobytes()


class PackedKeys(Sequence[int]):
    """Read-only view of a packed chain; ``blob`` is the packed bytes (length a multiple of 8)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        if len(blob) % 8:
            raise ValueError(f"packed keys of {len(blob)} bytes: not a multiple of 8")
        self.blob = blob

    def __len__(self) -> int:
        return len(self.blob) // 8

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.tolist()[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("packed key index out of range")
        return struct.unpack_from(">Q", self.blob, 8 * i)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        return list(struct.unpack(f">{len(self)}Q", self.blob))


def packed_blob(keys: Sequence[int]) -> bytes:
    """The packed form of ``keys``, without repacking keys that arrived packed."""
    return keys.blob if isinstance(keys, PackedKeys) else pack_keys(keys)
