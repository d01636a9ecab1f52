"""Codec interop with vLLM's own msgspec structs, both directions, byte for byte."""

from __future__ import annotations

import random

import pytest

from kvmesh.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]


def _random_events(rng: random.Random) -> list:
    def h():
        return rng.choice([rng.randrange(2**64), rng.randbytes(32), rng.randbytes(16), 0])

    def opt(v):
        return v if rng.random() < 0.5 else None

    out = []
    for _ in range(rng.randrange(0, 6)):
        kind = rng.randrange(3)
        if kind == 0:
            n = rng.randrange(0, 4)
            out.append(
                BlockStored(
                    block_hashes=[h() for _ in range(n)],
                    parent_block_hash=opt(h()),
                    token_ids=[rng.randrange(200_000) for _ in range(n * 16)],
                    block_size=16,
                    lora_id=opt(rng.randrange(1, 9)),
                    medium=rng.choice(["GPU", "CPU", "STORAGE", None]),
                    lora_name=opt("adapter"),
                    extra_keys=opt([rng.choice([None, ("salt",), ("img", -3), ("lora", "salt")]) for _ in range(n)]),
                    group_idx=opt(rng.randrange(3)),
                    kv_cache_spec_kind=opt("full_attention"),
                    kv_cache_spec_sliding_window=opt(4096),
                    locality=opt("LOCAL"),
                    ownership=opt("tier-2"),
                    session_id=opt("sess"),
                )
            )
        elif kind == 1:
            out.append(BlockRemoved([h()], rng.choice(["GPU", None]), opt(0), opt("REMOTE"), opt("x")))
        else:
            out.append(AllBlocksCleared())
    return out


def _to_vllm(V, ev):
    if isinstance(ev, BlockStored):
        return V.BlockStored(**{f: getattr(ev, f) for f in BlockStored.REQUIRED + BlockStored.OPTIONAL})
    if isinstance(ev, BlockRemoved):
        return V.BlockRemoved(**{f: getattr(ev, f) for f in BlockRemoved.REQUIRED + BlockRemoved.OPTIONAL})
    return V.AllBlocksCleared()


def _from_vllm(V, ev):
    if isinstance(ev, V.BlockStored):
        return BlockStored(**{f: getattr(ev, f) for f in BlockStored.REQUIRED + BlockStored.OPTIONAL})
    if isinstance(ev, V.BlockRemoved):
        return BlockRemoved(**{f: getattr(ev, f) for f in BlockRemoved.REQUIRED + BlockRemoved.OPTIONAL})
    return AllBlocksCleared()


def test_both_directions_byte_identical() -> None:
    import msgspec
    from vllm.distributed import kv_events as V

    dec = msgspec.msgpack.Decoder(type=V.KVEventBatch)
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(5)
    for _ in range(300):
        ours = KVEventBatch(rng.uniform(0, 2e9), _random_events(rng), rng.choice([None, 0, 3]))
        theirs = V.KVEventBatch(
            ts=ours.ts, events=[_to_vllm(V, e) for e in ours.events], data_parallel_rank=ours.data_parallel_rank
        )
        payload = encode_batch(ours)
        assert payload == enc.encode(theirs)
        # kvmesh -> vLLM decoder
        back = dec.decode(payload)
        assert [_from_vllm(V, e) for e in back.events] == ours.events
        # vLLM encoder -> kvmesh decoder
        d = decode_batch(enc.encode(theirs))
        assert d.errors == [] and d.batch == ours


def test_vllm_decodes_our_legacy_tolerant_output() -> None:
    """What we decode from a legacy array-style batch re-encodes into something vLLM accepts."""
    import msgpack
    import msgspec
    from vllm.distributed import kv_events as V

    legacy = msgpack.packb([1.5, [["BlockStored", [1], None, [1, 2], 2, None], ["BlockRemoved", [1]]]])
    d = decode_batch(legacy)
    assert d.errors == []
    back = msgspec.msgpack.decode(encode_batch(d.batch), type=V.KVEventBatch)
    assert back.events[0].block_hashes == [1] and back.events[1].medium is None
