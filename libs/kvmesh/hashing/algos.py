"""The four prefix-caching hash algorithms of vLLM 0.32, as kvmesh names them.

vLLM hashes a Python object (``(parent, tokens, extra_keys)`` or the NONE_HASH seed
string) by serialising it (pickle protocol 5 or canonical CBOR) and digesting the
bytes (SHA-256 or XXH3-128). This module holds that generic, slow-but-obviously-right
path; :mod:`kvmesh.hashing.hasher` adds the fast block path and checks itself
against this one in tests.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import cbor2
import xxhash


class HashAlgo(StrEnum):
    """vLLM's ``--prefix-caching-hash-algo`` values."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"

    @classmethod
    def parse(cls, value: str | HashAlgo) -> HashAlgo:
        """Accept an enum or its string value; raise ValueError naming the choices."""
        if isinstance(value, HashAlgo):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(a.value for a in cls)
            raise ValueError(f"unknown hash algo {value!r}; expected one of: {choices}") from None

    @property
    def uses_cbor(self) -> bool:
        return self in (HashAlgo.SHA256_CBOR, HashAlgo.XXHASH_CBOR)

    @property
    def is_cryptographic(self) -> bool:
        """vLLM keeps a random NONE_HASH seed for the non-cryptographic ones."""
        return self in (HashAlgo.SHA256, HashAlgo.SHA256_CBOR)

    @property
    def digest_size(self) -> int:
        return 32 if self.is_cryptographic else 16


PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def serialize(algo: HashAlgo, obj: Any) -> bytes:
    """Serialise ``obj`` exactly as vLLM does before digesting it."""
    if algo.uses_cbor:
        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)


def digest_fn(algo: HashAlgo) -> Callable[[bytes], bytes]:
    """The raw byte digest (SHA-256 or XXH3-128) behind ``algo``."""
    if algo.is_cryptographic:
        return lambda data: hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest


def hash_object(algo: HashAlgo, obj: Any) -> bytes:
    """Reference implementation of ``vllm.utils.hashing.<algo>(obj)``."""
    return digest_fn(algo)(serialize(algo, obj))
