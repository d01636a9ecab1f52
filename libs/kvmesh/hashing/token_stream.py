"""Vectorised canonical-CBOR encoding of a whole token sequence, sliced per block afterwards.

Per-token Python work is what makes ``sha256_cbor``/``xxhash_cbor`` block hashing slow
(a 200k-token prompt is 200k lookups). CBOR encodes each unsigned int in a
self-delimiting, context-free way (major type 0, minimal length), so the encodings of all
tokens can be produced at once with numpy and concatenated; a block's encoded tokens are
then a single slice of that byte string. (For the pickle algos the C pickler is already
faster than any hand-assembly, so they do not use this.)

Returns None when a token is outside uint32: callers then take the generic path.
"""

from __future__ import annotations

import numpy as np

_COLS = np.arange(5, dtype=np.int8)
_CBOR_LENS = np.array([1, 2, 3, 5], dtype=np.int8)


def encode(arr: np.ndarray, block_size: int, n_blocks: int) -> tuple[bytes, list[int]] | None:
    """(stream, bounds): block i's encoded tokens are ``stream[bounds[i]:bounds[i+1]]``.

    Each token becomes a row of up to 5 bytes (head + 4 value bytes); a per-row length
    mask then selects the bytes that belong to the encoding, and boolean indexing
    flattens the rows in order into one stream.
    """
    n = n_blocks * block_size
    if n == 0:
        return b"", [0]
    a = np.asarray(arr[:n])
    lo, hi = int(a.min()), int(a.max())
    rows = np.empty((n, 5), dtype=np.uint8)
    if lo < 0 or hi >= (1 << 32):
        return None
    v = a.astype(np.uint32)
    # Right-aligned rows: [.., head, big-endian value bytes]; lengths 1, 2, 3 or 5.
    rows[:, 1:] = v.astype(">u4").view(np.uint8).reshape(n, 4)
    ge24, ge256, ge64k = v >= 24, v >= 0x100, v >= 0x10000
    lens = _CBOR_LENS[ge24.view(np.int8) + ge256.view(np.int8) + ge64k.view(np.int8)]
    rows[:, 0] = 0x1A
    rows[:, 2] = np.where(ge64k, rows[:, 2], 0x19)
    rows[:, 3] = np.where(ge256, rows[:, 3], 0x18)
    mask = _COLS >= (5 - lens)[:, None]
    stream = rows[mask].tobytes()
    ends = np.cumsum(lens, dtype=np.int64)
    bounds = np.empty(n_blocks + 1, dtype=np.int64)
    bounds[0] = 0
    bounds[1:] = ends[block_size - 1 :: block_size][:n_blocks]
    return stream, bounds.tolist()
