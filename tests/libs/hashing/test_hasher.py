"""BlockHasher against the slow reference path (serialise exactly like vLLM, then digest)."""

from __future__ import annotations

import pickle
import random

import cbor2
import numpy as np
import pytest

from kvmesh.hashing import BlockHasher, ExtraKeys, HashAlgo, MMRange, cbor_fast, event_key, hash_object
from kvmesh.hashing.extra_keys import block_extra_keys, to_event_extra_keys

pytestmark = pytest.mark.timeout(60)

ALGOS = [a.value for a in HashAlgo]
SEED = "test-seed"
EDGE_TOKENS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40, 31999, 151000]


def reference_chain(algo: str, seed: str, tokens: list[int], bs: int, extra: ExtraKeys | None) -> list[bytes]:
    """Straight transcription of vLLM's request_block_hasher on plain objects."""
    a = HashAlgo(algo)
    prev = hash_object(a, seed)
    out = []
    mm_idx = 0
    for i in range(len(tokens) // bs):
        keys, mm_idx = block_extra_keys(extra, i * bs, (i + 1) * bs, mm_idx)
        prev = hash_object(a, (prev, tuple(tokens[i * bs : (i + 1) * bs]), keys))
        out.append(prev)
    return out


@pytest.fixture(autouse=True)
def _no_env_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("bs", [1, 16, 32, 64])
def test_matches_reference(algo: str, bs: int) -> None:
    rng = random.Random(bs)
    tokens = [rng.choice(EDGE_TOKENS) if rng.random() < 0.2 else rng.randrange(200_000) for _ in range(bs * 9 + 5)]
    h = BlockHasher(algo, bs, seed=SEED)
    assert h.block_digests(tokens) == reference_chain(algo, SEED, tokens, bs, None)
    extra = ExtraKeys(cache_salt="salt", lora_name="ad", lora_path="/lora/ad")
    assert h.block_digests(tokens, extra) == reference_chain(algo, SEED, tokens, bs, extra)


def test_cbor_fast_is_byte_identical_to_cbor2() -> None:
    parents = [b"\x01" * 32, b"\x02" * 16, b"", b"x" * 300]
    extras = [None, (("cache_salt", "s"),), (("lora", "a", None), ("mm", "abc", -3)), (("mm", "é", 2**40),)]
    for p in parents:
        for extra in extras:
            for toks in ([], EDGE_TOKENS, list(range(30)), [-1, -24, -25, -300, -(2**33)]):
                assert cbor_fast.encode_block(p, toks, extra) == cbor2.dumps((p, tuple(toks), extra), canonical=True)


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_seed_resolution(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a = HashAlgo(algo)
    if a.is_cryptographic:
        h = BlockHasher(algo, 16)
        assert h.seed == "vllm-none-hash" and not h.seed_is_random
        assert h.none_hash == hash_object(a, "vllm-none-hash")
    else:
        # vLLM keeps the xxhash seed secret (random per process) unless PYTHONHASHSEED is set.
        h1, h2 = BlockHasher(algo, 16), BlockHasher(algo, 16)
        assert h1.seed_is_random and h1.none_hash != h2.none_hash
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    h = BlockHasher(algo, 16)
    assert h.seed == "99" and h.none_hash == hash_object(a, "99")
    assert BlockHasher(algo, 16, seed="explicit").none_hash == hash_object(a, "explicit")
    monkeypatch.setenv("PYTHONHASHSEED", "")
    assert BlockHasher(algo, 16).none_hash == hash_object(a, "")


@pytest.mark.parametrize("algo", ALGOS)
def test_cache_salt_only_on_first_block(algo: str) -> None:
    h = BlockHasher(algo, 4, seed=SEED)
    toks = list(range(12))
    salted = h.block_digests(toks, ExtraKeys(cache_salt="t1"))
    assert salted[0] == h.hash_block(None, toks[:4], (("cache_salt", "t1"),))
    assert salted[1] == h.hash_block(salted[0], toks[4:8], None)
    assert salted[2] == h.hash_block(salted[1], toks[8:12], None)
    assert salted[0] != h.block_digests(toks)[0]
    # An empty salt is no salt, as in vLLM (`if request.cache_salt`).
    assert h.block_digests(toks, ExtraKeys(cache_salt="")) == h.block_digests(toks)


def test_lora_keys_on_every_block_and_before_salt() -> None:
    h = BlockHasher("sha256_cbor", 4, seed=SEED)
    toks = list(range(8))
    ex = ExtraKeys(cache_salt="s", lora_name="sql", lora_path="/a/sql")
    d = h.block_digests(toks, ex)
    assert d[0] == h.hash_block(None, toks[:4], (("lora", "sql", "/a/sql"), ("cache_salt", "s")))
    assert d[1] == h.hash_block(d[0], toks[4:], (("lora", "sql", "/a/sql"),))
    assert to_event_extra_keys((("lora", "sql", "/a/sql"), ("cache_salt", "s"))) == ("sql", "s")
    # no path given: vLLM's LoRARequest.lora_path defaults to ""
    d2 = h.block_digests(toks, ExtraKeys(lora_name="sql"))
    assert d2[0] == h.hash_block(None, toks[:4], (("lora", "sql", ""),))


def test_mm_keys_follow_vllm_block_walk() -> None:
    ex = ExtraKeys(mm=(MMRange("img0", 3, 6), MMRange("img1", 9, 2), MMRange("img2", 20, 4)))
    got = []
    idx = 0
    for b in range(6):
        keys, idx = block_extra_keys(ex, b * 4, b * 4 + 4, idx)
        got.append(keys)
    assert got == [
        (("mm", "img0", 3),),  # [0,4): img0 starts at 3
        (("mm", "img0", -1),),  # [4,8): inside img0, offset relative to block start
        (("mm", "img0", -5), ("mm", "img1", 1)),  # [8,12): img0 ends at 9, img1 at 9..11
        None,
        None,
        (("mm", "img2", 0),),
    ]
    assert to_event_extra_keys(got[2]) == (("img0", -5), ("img1", 1))
    h = BlockHasher("sha256", 4, seed=SEED)
    toks = list(range(24))
    assert h.block_digests(toks, ex) == reference_chain("sha256", SEED, toks, 4, ex)


def test_extra_keys_validation() -> None:
    with pytest.raises(ValueError):
        ExtraKeys(mm=(MMRange("a", 5, 5), MMRange("b", 6, 1)))
    with pytest.raises(ValueError):
        ExtraKeys(lora_path="/x")
    with pytest.raises(ValueError):
        ExtraKeys(mm=(MMRange("a", 0, 0),))


@pytest.mark.parametrize("algo", ALGOS)
def test_numpy_and_other_int_types(algo: str) -> None:
    h = BlockHasher(algo, 16, seed=SEED)
    toks = list(range(1000, 1100))
    want = h.block_digests(toks)
    assert h.block_digests(np.array(toks, dtype=np.int64)) == want
    assert h.block_digests(np.array(toks, dtype=np.uint32)) == want
    assert h.block_digests([np.int32(t) for t in toks]) == want
    assert h.block_digests(tuple(toks)) == want
    assert h.block_digests(iter(toks)) == want
    assert h.hash_block(None, np.array(toks[:16]), None) == want[0]
    with pytest.raises(TypeError, match="position 3"):
        h.block_digests([1, 2, 3, 4.0] + toks)
    with pytest.raises(TypeError):
        h.block_digests(np.array(toks, dtype=np.float32))
    with pytest.raises(TypeError):
        h.block_digests([1, "2"] * 20)


@pytest.mark.parametrize("algo", ALGOS)
def test_incremental_resume_equals_full_chain(algo: str) -> None:
    rng = random.Random(7)
    bs = 8
    toks = [rng.randrange(50_000) for _ in range(bs * 20 + 3)]
    ex = ExtraKeys(cache_salt="s", lora_name="l", lora_path="p", mm=(MMRange("m0", 5, 30), MMRange("m1", 60, 9)))
    h = BlockHasher(algo, bs, seed=SEED)
    full = h.block_digests(toks, ex)
    for split in (1, 2, 3, 5, 7, 8, 12, 19):
        head = h.block_digests(toks[: split * bs], ex)
        tail = h.block_digests(toks[split * bs :], ex, parent=head[-1], first_block_index=split)
        assert head + tail == full, split
    # chunked in uneven pieces, always resuming at the last full block
    done: list[bytes] = []
    pos = 0
    while pos < len(toks):
        step = rng.randrange(1, 40)
        upto = min(len(toks), pos + step)
        n_done = len(done)
        new = h.block_digests(toks[n_done * bs : upto], ex, parent=done[-1] if done else None, first_block_index=n_done)
        done.extend(new)
        pos = upto
    assert done == full
    with pytest.raises(ValueError):
        h.block_digests(toks, ex, first_block_index=2)


def test_event_key_is_low_64_bits_big_endian() -> None:
    d = bytes(range(32))
    assert event_key(d) == int.from_bytes(d[-8:], "big")
    h = BlockHasher("sha256_cbor", 4, seed=SEED)
    toks = list(range(9))
    assert h.block_keys(toks) == [event_key(x) for x in h.block_digests(toks)]
    assert all(0 <= k < 2**64 for k in h.block_keys(toks))


def test_partial_blocks_and_bad_arguments() -> None:
    h = BlockHasher("sha256", 16, seed=SEED)
    assert h.block_digests([]) == []
    assert h.block_digests(list(range(15))) == []
    assert len(h.block_digests(list(range(33)))) == 2
    assert h.hash_block(b"", [1], None) == h.hash_block(None, [1], None)  # vLLM: `if not parent`
    with pytest.raises(ValueError, match="unknown hash algo"):
        BlockHasher("md5", 16)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            BlockHasher("sha256", bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockHasher("sha256", 16, seed=5)  # type: ignore[arg-type]
    assert HashAlgo.parse(" SHA256_CBOR ") is HashAlgo.SHA256_CBOR


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("bs", [4, 16, 64])
@pytest.mark.parametrize("wide", [False, True])
def test_fast_paths_serialise_byte_identically(algo: str, bs: int, wide: bool) -> None:
    """Every byte string the (vectorised) paths digest equals vLLM's pickle/cbor2 serialisation."""
    a = HashAlgo(algo)
    rng = random.Random(bs)
    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1, 151_000]
    if wide:  # outside uint32: the CBOR path falls back to per-block encoding
        edges += [2**32, 2**63 - 1] + ([] if a.uses_cbor else [-1, -(2**31), -(2**40)])
    n_blocks = 60  # above the numpy threshold
    tokens = [rng.choice(edges) if rng.random() < 0.5 else rng.randrange(100_000) for _ in range(bs * n_blocks + 3)]
    h = BlockHasher(algo, bs, seed=SEED)
    seen: list[bytes] = []
    real = h._digest
    h._digest = lambda data: (seen.append(data), real(data))[1]  # type: ignore[method-assign]
    ex = ExtraKeys(cache_salt="salt", lora_name="l", lora_path="l")  # one interned str twice: memo refs
    for extra in (None, ex):
        for form in (tokens, np.array(tokens, dtype=np.int64 if wide else np.uint32)):
            seen.clear()
            digests = h.block_digests(form, extra)
            prev = h.none_hash
            for i, data in enumerate(seen):
                keys, _ = block_extra_keys(extra, i * bs, (i + 1) * bs, 0)
                obj = (prev, tuple(tokens[i * bs : (i + 1) * bs]), keys)
                want = cbor2.dumps(obj, canonical=True) if a.uses_cbor else pickle.dumps(obj, protocol=5)
                assert data == want, i
                prev = digests[i]
            assert len(seen) == n_blocks


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("parent", [b"abc", b"\x07" * 300, None])
def test_vectorised_path_with_odd_parent_and_keys(algo: str, parent: bytes | None) -> None:
    h = BlockHasher(algo, 16, seed=SEED)
    rng = random.Random(3)
    tokens = [rng.randrange(200_000) for _ in range(16 * 60)]
    for extra in (None, ExtraKeys(cache_salt="s", lora_name="l", lora_path="/p")):
        keys = h._keys(extra, 0, 60)
        want = h._generic(list(tokens), keys, parent or h.none_hash, 60)
        assert h.block_digests(tokens, extra, parent=parent) == want
