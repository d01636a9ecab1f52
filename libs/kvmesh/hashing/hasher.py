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
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from kvmesh.hashing import cbor_fast
from kvmesh.hashing.algos import PICKLE_PROTOCOL, HashAlgo, hash_object
from kvmesh.hashing.extra_keys import ExtraKeys, block_extra_keys, mm_start_index

log = logging.getLogger(__name__)

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


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
    if type(token_ids) is list and set(map(type, token_ids)) <= {int}:
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None and getattr(token_ids, "dtype", None) is not None:
        if token_ids.dtype.kind not in "iu":  # type: ignore[attr-defined]
            raise TypeError(f"token ids must be integers, got array of {token_ids.dtype}")  # type: ignore[attr-defined]
        return tolist()
    out: list[int] = []
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"token id at position {i} is {type(t).__name__} {t!r}, not an integer")
        out.append(t.__index__())
    return out


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
        tokens = as_token_list(token_ids)
        bs = self.block_size
        n_blocks = len(tokens) // bs
        if n_blocks == 0:
            return []
        if extra is not None and extra.is_empty:
            extra = None
        prev = parent or self._none_hash
        digest = self._digest
        out: list[bytes] = []
        append = out.append
        base = first_block_index * bs

        if extra is None or not extra.mm:
            # Extra keys are constant except cache_salt on global block 0.
            keys_rest, _ = block_extra_keys(extra, bs, 2 * bs, 0) if extra else (None, 0)
            keys_first, _ = block_extra_keys(extra, 0, bs, 0) if extra else (None, 0)
            keys_iter: Iterable[tuple[Any, ...] | None] = (
                keys_first if (base + i * bs) == 0 else keys_rest for i in range(n_blocks)
            )
        else:
            keys_iter = self._mm_keys(extra, base, n_blocks)

        if self._cbor:
            enc_tok = cbor_fast.TOKEN_ENC.__getitem__
            enc_extra = cbor_fast.encode_extra
            head_arr = cbor_fast.head(4, bs)
            dsize = self.algo.digest_size
            head_digest = cbor_fast.head(2, dsize)
            tuple3 = cbor_fast.TUPLE3
            join = b"".join
            for i, keys in enumerate(keys_iter):
                s = i * bs
                hp = head_digest if len(prev) == dsize else cbor_fast.head(2, len(prev))
                data = join((tuple3, hp, prev, head_arr, join(map(enc_tok, tokens[s : s + bs])), enc_extra(keys)))
                prev = digest(data)
                append(prev)
        else:
            dumps = pickle.dumps
            proto = PICKLE_PROTOCOL
            for i, keys in enumerate(keys_iter):
                s = i * bs
                prev = digest(dumps((prev, tuple(tokens[s : s + bs]), keys), protocol=proto))
                append(prev)
        return out

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
