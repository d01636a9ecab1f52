"""Engine-hash -> kvmesh-key translation (fast path and derived keys)."""

from __future__ import annotations

import pytest

from kvmesh.events.codec import BlockStored
from kvmesh.hashing import BlockHasher, ExtraKeys, event_key, to_event_extra_keys
from kvmesh.hashing.extra_keys import block_extra_keys
from kvmesh_indexer.keys import EngineHashing, KeyError_, KeyMapper, ModelSpec, check_block_size

pytestmark = pytest.mark.timeout(30)

BS = 16
SPEC = ModelSpec("m", BS, "sha256_cbor")
TOKS = [(i * 7919) % 32000 for i in range(BS * 6)]


def engine_event(hasher: BlockHasher, toks: list[int], first: int, n: int, extra: ExtraKeys | None = None,
                 raw_bytes: bool = False) -> tuple[BlockStored, list]:
    digests = hasher.block_digests(toks[: (first + n) * BS], extra)
    conv = (lambda d: d) if raw_bytes else event_key
    hashes = [conv(d) for d in digests]
    untagged = None
    if extra is not None:
        untagged = [to_event_extra_keys(block_extra_keys(extra, i * BS, (i + 1) * BS, 0)[0])
                    for i in range(first, first + n)]
    ev = BlockStored(block_hashes=hashes[first:first + n], parent_block_hash=hashes[first - 1] if first else None,
                     token_ids=toks[first * BS:(first + n) * BS], block_size=BS, extra_keys=untagged)
    return ev, hashes


def test_fast_path_uses_engine_hashes_and_reduces_raw_digests() -> None:
    mapper = KeyMapper(SPEC)
    assert mapper.mode == "fast"
    ev, hashes = engine_event(SPEC.hasher(), TOKS, 0, 6, raw_bytes=True)
    assert mapper.stored_keys(ev) == SPEC.hasher().block_keys(TOKS)
    assert mapper.removed_keys([hashes[2]]) == ([event_key(hashes[2])], 0)
    tail, _ = engine_event(SPEC.hasher(), TOKS, 4, 2, raw_bytes=True)
    assert mapper.parent_key(tail) == event_key(hashes[3])


@pytest.mark.parametrize("engine_algo", ["sha256", "xxhash_cbor"])
def test_derived_keys_match_kvmesh_hashing_across_events(engine_algo: str) -> None:
    engine_hasher = BlockHasher(engine_algo, BS, seed="engine-seed")
    mapper = KeyMapper(SPEC, EngineHashing(engine_algo, BS, seed_matches=False))
    assert mapper.mode == "derived"
    want = SPEC.hasher().block_keys(TOKS)
    ev1, _ = engine_event(engine_hasher, TOKS, 0, 2)
    ev2, hashes = engine_event(engine_hasher, TOKS, 2, 4)  # continues from the parent of event 1
    assert mapper.stored_keys(ev1) + mapper.stored_keys(ev2) == want
    # Parent links for the index come out in kvmesh keys too.
    assert mapper.parent_key(ev1) is None and mapper.parent_key(ev2) == want[1]
    assert hashes[0] != want[0]
    keys, unknown = mapper.removed_keys([hashes[5], 0xDEAD])
    assert keys == [want[5]] and unknown == 1
    assert len(mapper) == 5


def test_derived_keys_with_cache_salt() -> None:
    extra = ExtraKeys(cache_salt="tenant-a")
    engine_hasher = BlockHasher("sha256", BS)
    mapper = KeyMapper(SPEC, EngineHashing("sha256", BS, seed_matches=True))
    ev, _ = engine_event(engine_hasher, TOKS, 0, 3, extra)
    assert mapper.stored_keys(ev) == SPEC.hasher().block_keys(TOKS[: 3 * BS], extra)


def test_derived_keys_reject_unknown_parent_and_bad_sizes() -> None:
    engine_hasher = BlockHasher("sha256", BS)
    mapper = KeyMapper(SPEC, EngineHashing("sha256"))
    ev, _ = engine_event(engine_hasher, TOKS, 2, 1)
    with pytest.raises(KeyError_, match="parent block"):
        mapper.stored_keys(ev)
    ev, _ = engine_event(engine_hasher, TOKS, 0, 2)
    ev.token_ids = ev.token_ids[:-1]
    with pytest.raises(KeyError_, match="token_ids"):
        mapper.stored_keys(ev)
    ev.block_size = 32
    with pytest.raises(KeyError_, match="block_size"):
        mapper.stored_keys(ev)
    with pytest.raises(KeyError_, match="uint64"):
        KeyMapper(SPEC).stored_keys(BlockStored(block_hashes=[-1], block_size=BS))


def test_block_size_mismatch_is_rejected_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="--block-size 16"):
        check_block_size("e0", SPEC, EngineHashing(block_size=32))
    check_block_size("e0", SPEC, EngineHashing(block_size=16))
