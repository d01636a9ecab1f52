"""``kvmesh.index.packed``: the packed chain is the Redis layouts' 8-byte big-endian key form."""

from __future__ import annotations

import random
import struct

import pytest

from kvmesh.index.packed import PackedKeys, pack_keys, packed_blob


def test_round_trip_and_sequence_behaviour() -> None:
    rng = random.Random(3)
    keys = [0, 1, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(500))]
    blob = pack_keys(keys)
    assert blob == struct.pack(f">{len(keys)}Q", *keys)
    p = PackedKeys(blob)
    assert len(p) == len(keys) and list(p) == keys and p.tolist() == keys
    assert p[0] == 0 and p[2] == (1 << 64) - 1 and p[-1] == keys[-1] and p[10:20] == keys[10:20]
    assert packed_blob(p) is blob and packed_blob(keys) == blob
    with pytest.raises(IndexError):
        p[len(keys)]
    assert not PackedKeys(b"") and pack_keys([]) == b""


def test_a_blob_of_partial_words_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        PackedKeys(b"\0" * 9)


def test_out_of_range_keys_are_refused() -> None:
    with pytest.raises(OverflowError):
        pack_keys([1 << 64])
