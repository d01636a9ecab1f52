"""vLLM-exact prefix-cache block hashing (vLLM 0.32), fast enough for 200k-token prompts.

The router and indexer must compute the very same block hashes the engines compute, or
prefix matching silently finds nothing. vLLM chains full blocks only:
``h_i = H((h_{i-1} or NONE_HASH, tuple(block_i tokens), extra_keys_i or None))`` with
``NONE_HASH = H(seed)``; the seed is ``$PYTHONHASHSEED`` when set, else the fixed
``"vllm-none-hash"`` for the SHA-256 algos and a random per-process value for xxhash.
KV events carry the low 64 bits of each digest (:func:`event_key`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvmesh.hashing import cbor_fast, token_stream
from kvmesh.hashing.algos import PICKLE_PROTOCOL, HashAlgo, hash_object
from kvmesh.hashing.extra_keys import ExtraKeys, block_extra_keys, mm_start_index

log = logging.getLogger(__name__)

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
# Below this many blocks numpy's fixed per-call cost outweighs vectorising the CBOR encoding.
_NUMPY_MIN_BLOCKS = 48


def event_key(digest: bytes) -> int:
    """vLLM's KV-event form of a block hash: the low 64 bits, big-endian, unsigned.

    Same as ``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``
    (the default).
    """
    return int.from_bytes(digest, "big") & _MASK64


def resolve_seed(algo: HashAlgo, seed: str | None = None) -> tuple[str, bool]:
    """The NONE_HASH seed and whether it is random, as ``resolve_none_hash_seed`` decides."""
    if seed is not None:
        if not isinstance(seed, str):
            raise TypeError(f"seed must be a str, got {type(seed).__name__}")
        return seed, False
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env, False
    if not algo.is_cryptographic:
        return os.urandom(32).hex(), True
    return DEFAULT_NONE_HASH_SEED, False


def as_token_list(token_ids: Iterable[Any]) -> list[int]:
    """Plain Python ints (numpy ints would pickle differently from vLLM's ints).

    Raises TypeError for anything that is not an integer (floats, strings, None).
    """
    if type(token_ids) is tuple:
        token_ids = list(token_ids)
    if type(token_ids) is list:
        # One C-speed pass: the sum of plain ints is a plain int; any float, numpy int or
        # other number makes it something else, and non-numbers raise. (bools pass as
        # ints, which no tokenizer produces.)
        try:
            if type(sum(token_ids)) is int:
                return token_ids
        except TypeError:
            pass
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None and getattr(token_ids, "dtype", None) is not None:
        if token_ids.dtype.kind not in "iu" or getattr(token_ids, "ndim", 1) != 1:  # type: ignore[attr-defined]
            raise TypeError(
                f"token ids must be a 1-D integer array, got {token_ids.dtype} "  # type: ignore[attr-defined]
                f"with shape {getattr(token_ids, 'shape', '?')}"
            )
        return tolist()
    out: list[int] = []
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"token id at position {i} is {type(t).__name__} {t!r}, not an integer")
        out.append(t.__index__())
    return out


def _as_array(token_ids: Any) -> np.ndarray | None:
    """Tokens as a 1-D integer array, or None (then the generic path validates them)."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, list | tuple):
        # array('q') converts a list of ints ~2x faster than np.asarray and rejects floats.
        try:
            arr = np.frombuffer(array("q", token_ids), dtype=np.int64)
        except (TypeError, OverflowError):
            return None
    else:
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        return None
    return arr


class BlockHasher:
    """Computes a request's block-hash chain exactly as a vLLM 0.32 engine does.

    ``seed=None`` resolves the NONE_HASH seed like vLLM (see :func:`resolve_seed`); for
    xxhash without ``PYTHONHASHSEED`` that is random, so hashes won't match any engine
    (``seed_is_random`` tells you).
    """

    def __init__(self, algo: HashAlgo | str, block_size: int, seed: str | None = None) -> None:
        self.algo = HashAlgo.parse(algo)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.seed, self.seed_is_random = resolve_seed(self.algo, seed)
        if self.seed_is_random:
            log.warning(
                "random NONE_HASH seed for %s (PYTHONHASHSEED unset), as vLLM does; "
                "hashes will not match any engine",
                self.algo.value,
            )
        self._none_hash = hash_object(self.algo, self.seed)
        self._digest = (lambda b: hashlib.sha256(b).digest()) if self.algo.is_cryptographic else xxhash.xxh3_128_digest
        self._cbor = self.algo.uses_cbor

    @property
    def none_hash(self) -> bytes:
        """Digest standing in for the parent of block 0 (vLLM's NONE_HASH)."""
        return self._none_hash

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self.algo.value!r}, block_size={self.block_size}, seed={self.seed!r})"

    def hash_block(
        self, parent: bytes | None, block_tokens: Sequence[int], extra: tuple[Any, ...] | None = None
    ) -> bytes:
        """One block: ``vllm...hash_block_tokens(hash_fn, parent, tokens, extra_keys)``.

        ``extra`` is vLLM's tagged tuple (e.g. ``(("cache_salt", "s"),)``) or None.
        """
        parent_b = parent or self._none_hash
        tokens = as_token_list(block_tokens)
        if self._cbor:
            return self._digest(cbor_fast.encode_block(parent_b, tokens, extra))
        return self._digest(pickle.dumps((parent_b, tuple(tokens), extra), protocol=PICKLE_PROTOCOL))

    def block_digests(
        self,
        token_ids: Iterable[int],
        extra: ExtraKeys | None = None,
        parent: bytes | None = None,
        first_block_index: int = 0,
    ) -> list[bytes]:
        """Digests of every full block of ``token_ids``.

        To extend a chain incrementally, pass the last digest as ``parent``, the tokens
        after the already-hashed blocks, and ``first_block_index`` = number of blocks
        already hashed: cache_salt applies only to global block 0 and mm offsets are
        global token positions, exactly as if the whole sequence was hashed at once.
        """
        if first_block_index < 0:
            raise ValueError("first_block_index must be >= 0")
        if first_block_index > 0 and not parent:
            raise ValueError("resuming at first_block_index > 0 needs the parent digest")
        bs = self.block_size
        if not hasattr(token_ids, "__len__"):
            token_ids = as_token_list(token_ids)
        n_blocks = len(token_ids) // bs  # type: ignore[arg-type]
        if n_blocks == 0:
            return []
        if extra is not None and extra.is_empty:
            extra = None
        keys = self._keys(extra, first_block_index * bs, n_blocks)
        prev = parent or self._none_hash

        # CBOR: encode all tokens at once with numpy, then slice per block (the per-token
        # Python work dominates otherwise). Pickle: the C pickler already beats any
        # hand-assembly, so it is used directly. Small inputs skip numpy's fixed cost.
        fast = None
        if self._cbor and n_blocks >= _NUMPY_MIN_BLOCKS:
            arr = _as_array(token_ids)
            if arr is not None:
                fast = token_stream.encode(arr, bs, n_blocks)
        if fast is None:
            return self._generic(as_token_list(token_ids), keys, prev, n_blocks)
        stream, bounds = fast
        digest = self._digest
        join = b"".join
        enc_extra = cbor_fast.encode_extra
        head_arr = cbor_fast.head(4, bs)
        # Block 0's parent may be a caller-supplied digest of another length; after it
        # every parent is one of ours, so the tuple/bytes header is a constant prefix.
        out = [digest(join((cbor_fast.TUPLE3, cbor_fast.encode_parent(prev), head_arr,
                            stream[bounds[0] : bounds[1]], enc_extra(keys[0] if keys else None))))]  # fmt: skip
        prev = out[0]
        append = out.append
        pre = cbor_fast.TUPLE3 + cbor_fast.head(2, len(prev))
        if keys is None:
            none_enc = cbor_fast.NONE_ENC
            for i in range(1, n_blocks):
                prev = digest(join((pre, prev, head_arr, stream[bounds[i] : bounds[i + 1]], none_enc)))
                append(prev)
        else:
            for i in range(1, n_blocks):
                prev = digest(join((pre, prev, head_arr, stream[bounds[i] : bounds[i + 1]], enc_extra(keys[i]))))
                append(prev)
        return out

    def _generic(
        self, tokens: list[int], keys: list[tuple[Any, ...] | None] | None, prev: bytes, n_blocks: int
    ) -> list[bytes]:
        """Per-block serialisation, as vLLM does it (C pickler, or memoised CBOR pieces)."""
        bs = self.block_size
        digest = self._digest
        out: list[bytes] = []
        append = out.append
        if self._cbor:
            encode_block = cbor_fast.encode_block
            for i in range(n_blocks):
                prev = digest(encode_block(prev, tokens[i * bs : (i + 1) * bs], keys[i] if keys else None))
                append(prev)
            return out
        dumps = pickle.dumps
        proto = PICKLE_PROTOCOL
        if keys is None:
            for i in range(n_blocks):
                prev = digest(dumps((prev, tuple(tokens[i * bs : (i + 1) * bs]), None), protocol=proto))
                append(prev)
        else:
            for i in range(n_blocks):
                prev = digest(dumps((prev, tuple(tokens[i * bs : (i + 1) * bs]), keys[i]), protocol=proto))
                append(prev)
        return out

    def _keys(self, extra: ExtraKeys | None, base: int, n_blocks: int) -> list[tuple[Any, ...] | None] | None:
        """Per-block tagged extra keys, or None when no block has any."""
        if extra is None:
            return None
        bs = self.block_size
        if not extra.mm:
            rest, _ = block_extra_keys(extra, bs, 2 * bs, 0)
            keys = [rest] * n_blocks
            if base == 0:
                keys[0], _ = block_extra_keys(extra, 0, bs, 0)
            return keys
        return list(self._mm_keys(extra, base, n_blocks))

    def _mm_keys(self, extra: ExtraKeys, base: int, n_blocks: int) -> Iterable[tuple[Any, ...] | None]:
        bs = self.block_size
        mm_idx = mm_start_index(extra.mm, base, bs)
        for i in range(n_blocks):
            start = base + i * bs
            keys, mm_idx = block_extra_keys(extra, start, start + bs, mm_idx)
            yield keys

    def block_keys(
        self,
        token_ids: Iterable[int],
        extra: ExtraKeys | None = None,
        parent: bytes | None = None,
        first_block_index: int = 0,
    ) -> list[int]:
        """Event-form (64-bit) keys of every full block; see :meth:`block_digests`."""
        return [event_key(d) for d in self.block_digests(token_ids, extra, parent, first_block_index)]
