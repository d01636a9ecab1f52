"""Turn an engine's block hashes into kvmesh's block keys.

Why: routers hash prompts with kvmesh's configured algorithm/seed/block size.
When an engine hashes identically, its event hashes *are* kvmesh keys (fast
path). When it does not (e.g. vLLM's default pickle ``sha256`` while kvmesh
runs ``sha256_cbor``, or another NONE_HASH seed), the indexer re-derives
kvmesh's key of every stored block from the token ids in ``BlockStored`` and
the parent's kvmesh digest, and keeps an engine-hash -> kvmesh-digest map so
later children and ``BlockRemoved`` events can be translated.

Block sizes must match: a block of another size is a different unit of KV,
so a mismatch is rejected at start-up (``check_block_size``) and per event.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.events.codec import BlockStored
from kvmesh.hashing import BlockHasher, HashAlgo, event_key

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


class KeyError_(ValueError):
    """An event whose keys cannot be derived; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """How kvmesh hashes blocks of one model (must match the router's config)."""

    name: str
    block_size: int = 128             # 0 = any (shared offload-store namespace; fast path only)
    hash_algo: str = "sha256_cbor"
    seed: str | None = None           # None = vLLM's default NONE_HASH seed resolution
    lora_paths: Mapping[str, str] = field(default_factory=dict)

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.hash_algo, self.block_size, self.seed)


@dataclass(frozen=True)
class EngineHashing:
    """How one engine hashes; defaults mean "exactly like the model spec"."""

    hash_algo: str | None = None
    block_size: int | None = None
    seed_matches: bool = True


def check_block_size(endpoint: str, model: ModelSpec, engine: EngineHashing) -> None:
    """Reject an engine whose block size differs from the model's (clear start-up error)."""
    if engine.block_size is not None and engine.block_size != model.block_size:
        raise ValueError(
            f"engine {endpoint!r} runs block_size {engine.block_size} but model {model.name!r} is indexed with "
            f"block_size {model.block_size}; kvmesh does not map between block sizes -- start the engine with "
            f"--block-size {model.block_size} or configure the model with block_size {engine.block_size}")


def normalize_hash(h: int | bytes) -> int:
    """An engine hash as vLLM's 64-bit event form (raw digests are reduced like vLLM does)."""
    if isinstance(h, bool):
        raise KeyError_(f"block hash is a bool: {h!r}")
    if isinstance(h, int):
        if h < 0 or h > _MASK64:
            raise KeyError_(f"block hash {h} outside uint64")
        return h
    if isinstance(h, bytes | bytearray):
        if len(h) == 0:
            raise KeyError_("empty block hash")
        return event_key(bytes(h))
    raise KeyError_(f"block hash of type {type(h).__name__}")


def normalize_hashes(hashes: Sequence[int | bytes]) -> list[int]:
    """``normalize_hash`` of every hash. A batch of plain uint64 ints (vLLM's default event form)
    is checked in C (the types in one pass, the range by ``array('Q')``): hash by hash in Python it
    was ingest's largest client-side share (~0.15 ms a 256-block batch). Anything else goes hash
    by hash, with the same errors."""
    if set(map(type, hashes)) == {int}:   # type, not isinstance: a bool is not a hash
        try:
            array("Q", hashes)
            return list(hashes)
        except OverflowError:
            pass   # negative or wider than 64 bits: the slow path names it
    return [normalize_hash(h) for h in hashes]


def tag_extra_keys(untagged: Sequence[Any] | None, lora_name: str | None, first_block: bool,
                   lora_paths: Mapping[str, str]) -> tuple[Any, ...] | None:
    """Rebuild vLLM's tagged per-block extra keys from the untagged event form.

    Events publish ``lora name``, ``(mm_id, offset)`` pairs, ``cache_salt`` and
    prompt-embeds digests untagged, in that order; the LoRA path (which enters
    the hash) is not published, so it comes from the model's ``lora_paths``.
    """
    if not untagged:
        return None
    out: list[Any] = []
    items = list(untagged)
    if lora_name and items and items[0] == lora_name:
        if lora_name not in lora_paths:
            raise KeyError_(f"LoRA {lora_name!r} has no path in the model's lora_paths; cannot derive keys")
        out.append(("lora", lora_name, lora_paths[lora_name]))
        items = items[1:]
    for it in items:
        if isinstance(it, tuple | list):
            out.append(("mm", *it))
        elif isinstance(it, str):
            if not first_block:
                raise KeyError_(f"string extra key {it!r} on a non-first block (cache_salt is first-block only)")
            out.append(("cache_salt", it))
        elif isinstance(it, bytes | bytearray):
            out.append(("prompt_embeds", bytes(it)))
        else:
            raise KeyError_(f"unsupported extra key {it!r}")
    return tuple(out) or None


class KeyMapper:
    """Per-endpoint translation of engine hashes to kvmesh keys."""

    def __init__(self, model: ModelSpec, engine: EngineHashing | None = None, max_map_entries: int = 4_000_000,
                 hasher: BlockHasher | None = None) -> None:
        engine = engine or EngineHashing()
        self.model = model
        self.engine = engine
        algo_same = engine.hash_algo is None or HashAlgo.parse(engine.hash_algo) == HashAlgo.parse(model.hash_algo)
        # A block-size-0 namespace cannot hash, so it always takes engine hashes as keys.
        self.fast = (algo_same and engine.seed_matches) or model.block_size == 0
        self.max_map_entries = max_map_entries
        self._hasher = hasher or (None if self.fast else model.hasher())
        # engine 64-bit hash -> [kvmesh digest, stores minus removes]
        self._map: dict[int, list[Any]] = {}

    @property
    def mode(self) -> str:
        return "fast" if self.fast else "derived"

    def reset(self) -> None:
        self._map.clear()

    def __len__(self) -> int:
        return len(self._map)

    def stored_keys(self, ev: BlockStored) -> list[int]:
        """kvmesh keys of the blocks of one ``BlockStored`` (raises ``KeyError_``)."""
        if self.model.block_size and ev.block_size and ev.block_size != self.model.block_size:
            raise KeyError_(f"event block_size {ev.block_size} != model {self.model.name!r} block_size "
                            f"{self.model.block_size}")
        engine_keys = normalize_hashes(ev.block_hashes)
        if self.fast:
            return engine_keys
        assert self._hasher is not None
        bs = self.model.block_size
        if len(ev.token_ids) != bs * len(engine_keys):
            raise KeyError_(f"token_ids has {len(ev.token_ids)} ids for {len(engine_keys)} blocks of {bs}")
        parent = self._parent_digest(ev)
        extras = ev.extra_keys or []
        if extras and len(extras) != len(engine_keys):
            raise KeyError_(f"extra_keys has {len(extras)} entries for {len(engine_keys)} blocks")
        out: list[int] = []
        tokens = ev.token_ids
        for i, ek in enumerate(engine_keys):
            extra = tag_extra_keys(extras[i] if extras else None, ev.lora_name,
                                   parent is None and i == 0, self.model.lora_paths)
            digest = self._hasher.hash_block(parent, tokens[i * bs:(i + 1) * bs], extra)
            slot = self._map.get(ek)
            if slot is None:
                self._map[ek] = [digest, 1]
            else:
                slot[0] = digest
                slot[1] += 1
            parent = digest
            out.append(event_key(digest))
        if len(self._map) > self.max_map_entries:
            # The map mirrors the engine's cache; overflowing means removals were lost.
            drop = len(self._map) - self.max_map_entries
            for k in list(self._map)[:drop]:
                del self._map[k]
            log.warning("engine key map over budget; dropped oldest", extra={"dropped": drop})
        return out

    def parent_key(self, ev: BlockStored) -> int | None:
        """kvmesh key of the parent of an event's first block (None: a first block).

        Call after ``stored_keys`` accepted the event, so a derived parent is mapped.
        """
        if self.fast:
            return None if ev.parent_block_hash is None else normalize_hash(ev.parent_block_hash)
        digest = self._parent_digest(ev)
        return None if digest is None else event_key(digest)

    def _parent_digest(self, ev: BlockStored) -> bytes | None:
        """Derived mode: the kvmesh digest of the event's parent block (None: a first block)."""
        if ev.parent_block_hash is None:
            return None
        got = self._map.get(normalize_hash(ev.parent_block_hash))
        if got is None:
            raise KeyError_(f"parent block {normalize_hash(ev.parent_block_hash):#x} unknown (missed its event)")
        return got[0]

    def removed_keys(self, hashes: Sequence[int | bytes]) -> tuple[list[int], int]:
        """(kvmesh keys, count of unknown hashes) for a ``BlockRemoved``."""
        keys = normalize_hashes(hashes)
        if self.fast:
            return keys, 0
        out: list[int] = []
        unknown = 0
        for ek in keys:
            slot = self._map.get(ek)
            if slot is None:
                unknown += 1
                continue
            out.append(event_key(slot[0]))
            slot[1] -= 1
            if slot[1] <= 0:
                del self._map[ek]
        return out, unknown
