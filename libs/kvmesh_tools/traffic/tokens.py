"""Hash ids → token ids, deterministically.

Why it exists: traces carry block ids, engines need tokens. Each (namespace, id)
becomes one block of ``block_size`` token ids drawn from a generator seeded by
the pair, so two requests share a token prefix exactly when they share a leading
run of ids. The prefix structure therefore survives any engine block size (a
64-token trace block becomes 64 token ids, which a 16-token engine sees as four
blocks). Tokens beyond the last full trace block are unique to the request.
Ids are drawn from ``[reserved_low, vocab_size)`` so they are valid for the
model and avoid its special tokens.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np

from kvmesh_tools.traffic.model import Request, namespace_seed


class TokenSynthesizer:
    """Builds prompt token ids for trace requests, with a bounded block cache."""

    def __init__(self, vocab_size: int, reserved_low: int = 16, cache_blocks: int = 65536, salt: str = "") -> None:
        if vocab_size <= reserved_low + 1:
            raise ValueError(f"vocab_size {vocab_size} too small (must exceed reserved_low={reserved_low} + 1)")
        self.vocab_size = vocab_size
        self.low = reserved_low
        self._cache: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._cap = cache_blocks
        # A salt gives a fresh, equally structured token space (e.g. one per policy in a fair comparison).
        self._salt = zlib.crc32(salt.encode()) if salt else 0

    def _draw(self, seed: list[int], n: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
        return rng.integers(self.low, self.vocab_size, size=n, dtype=np.int64)

    def block(self, namespace: str, hash_id: int, block_size: int) -> np.ndarray:
        """The token ids of one trace block."""
        key = (namespace_seed(namespace) ^ self._salt, hash_id, block_size)
        arr = self._cache.get(key)
        if arr is not None:
            self._cache.move_to_end(key)
            return arr
        # SeedSequence wants non-negative words; split the id into 32-bit parts.
        hid = hash_id & ((1 << 64) - 1)
        arr = self._draw([key[0], hid & 0xFFFFFFFF, hid >> 32, block_size], block_size)
        self._cache[key] = arr
        if len(self._cache) > self._cap:
            self._cache.popitem(last=False)
        return arr

    def prompt(self, req: Request) -> list[int]:
        """All ``req.input_tokens`` prompt token ids."""
        bs = req.block_size
        parts = [self.block(req.namespace, hid, bs) for hid in req.hash_ids]
        covered = len(req.hash_ids) * bs
        if covered < req.input_tokens:
            tail_seed = zlib.crc32(req.uid.encode())
            parts.append(self._draw([tail_seed, self._salt, req.input_tokens], req.input_tokens - covered))
        if not parts:
            return []
        out = np.concatenate(parts)[: req.input_tokens]
        return out.tolist()
