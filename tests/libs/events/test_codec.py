"""KV-event codec: round trips, tolerance rules, typed errors, fuzzing."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventBatch,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    is_replay_end,
    make_topic,
    parse_topic,
)

pytestmark = pytest.mark.timeout(120)


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=1764470000.25,
        events=[
            BlockStored(
                block_hashes=[1, 2**64 - 1],
                parent_block_hash=None,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("salt",), None],
                group_idx=0,
            ),
            BlockStored([b"\x00" * 32], b"\x01" * 32, list(range(32)), 32, 3, "CPU", "sql", session_id="s1"),
            BlockRemoved([2**64 - 1], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_round_trip_batch_and_message() -> None:
    b = sample_batch()
    d = decode_batch(encode_batch(b))
    assert d.errors == [] and d.batch == b
    frames = encode_message("kv@ep1@m", 7, b)
    assert frames[0] == b"kv@ep1@m" and frames[1] == (7).to_bytes(8, "big") and len(frames) == 3
    m = decode_message(frames)
    assert (m.topic, m.seq, m.batch, m.errors) == ("kv@ep1@m", 7, b, [])


def test_encode_rejects_non_events() -> None:
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch(KVEventBatch(1.0, [object()]))  # type: ignore[list-item]
    # int ts is written as a float, as vLLM's float field would be
    assert msgpack.unpackb(encode_batch(KVEventBatch(5, [])))[0] == 5.0


def test_wire_shape_matches_vllm_msgspec_settings() -> None:
    raw = msgpack.unpackb(encode_batch(sample_batch()), raw=False)
    assert isinstance(raw, list) and len(raw) == 3  # array_like batch
    first = raw[1][0]
    assert list(first)[:8] == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    ]  # fmt: skip
    assert first["type"] == "BlockStored" and first["parent_block_hash"] is None  # required fields kept when None
    assert "session_id" not in first and first["group_idx"] == 0  # omit_defaults
    assert raw[1][3] == {"type": "AllBlocksCleared"}
    # msgspec writes a None data_parallel_rank as nil even with omit_defaults (array_like)
    no_rank = msgpack.unpackb(encode_batch(KVEventBatch(1.0, [], None)), raw=False)
    assert no_rank == [1.0, [], None]


def test_legacy_array_events_and_tolerance() -> None:
    payload = msgpack.packb(
        [
            5,  # int ts is accepted
            [
                ["BlockStored", [10, 11], None, list(range(8)), 4, None],  # old: no medium/lora_name
                ["BlockRemoved", [10]],
                ["AllBlocksCleared"],
                {"type": "BlockStored", "block_hashes": [3], "token_ids": [1, 2], "block_size": 2, "future": {"x": 1}},
                {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU", "new_field": 1},
            ],
        ],
        use_bin_type=True,
    )
    d = decode_batch(payload)
    assert d.errors == []
    ev = d.batch.events
    assert ev[0] == BlockStored([10, 11], None, list(range(8)), 4)
    assert ev[1] == BlockRemoved([10], None)
    assert isinstance(ev[2], AllBlocksCleared)
    assert ev[3] == BlockStored([3], None, [1, 2], 2)
    assert ev[4] == BlockRemoved([3], "CPU")
    assert d.batch.ts == 5.0 and d.batch.data_parallel_rank is None


def test_bad_event_is_reported_and_others_kept() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    payload = msgpack.packb(
        [
            1.0,
            [
                good,
                {"type": "Nope"},
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [1]},  # no block_size
                {"type": "BlockStored", "block_hashes": ["x"], "token_ids": [], "block_size": 1},
                {"type": "BlockRemoved", "block_hashes": [True]},
                {"type": "BlockStored", "block_hashes": [], "token_ids": [1.5], "block_size": 1},
                42,
                {"no": "type"},
                [],
                good,
            ],
        ]
    )
    d = decode_batch(payload)
    assert len(d.batch.events) == 2
    assert [e.index for e in d.errors] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "unknown event type 'Nope'" in d.errors[0].message
    assert "block_size" in d.errors[1].message


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"", "empty"),
        (b"\xc1", "invalid msgpack"),
        (msgpack.packb({"a": 1}), "array"),
        (msgpack.packb([1.0]), "at least"),
        (msgpack.packb(["x", []]), "ts"),
        (msgpack.packb([float("nan"), []]), "finite"),
        (msgpack.packb([1.0, {}]), "events"),
        (msgpack.packb([1.0, [], "r"]), "data_parallel_rank"),
        (msgpack.packb([1.0, []]) + b"\x00", "invalid msgpack"),  # trailing bytes
    ],
)
def test_malformed_payload_raises_decode_error(payload: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_batch(payload)


def test_malformed_frames() -> None:
    ok = encode_message("t", 1, KVEventBatch(1.0, []))
    for frames, match in [
        (ok[:2], "3 frames"),
        ([*ok, b""], "3 frames"),
        ([ok[0], b"\x00" * 7, ok[2]], "8 bytes"),
        ([b"\xff\xfe", ok[1], ok[2]], "UTF-8"),
        ([ok[0], ok[1], b""], "empty"),
        ("abc", "list"),
        ([1, ok[1], ok[2]], "topic"),
    ]:
        with pytest.raises(DecodeError, match=match):
            decode_message(frames)  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="exceeds"):
        decode_batch(ok[2], max_bytes=3)
    assert is_replay_end([b"", REPLAY_END_SEQ.to_bytes(8, "big"), b""])
    assert not is_replay_end(ok)


def test_topics() -> None:
    t = make_topic("engine-1", "org/model@v2")
    assert t == "kv@engine-1@org/model@v2"
    assert parse_topic(t) == ("engine-1", "org/model@v2")
    assert parse_topic(t.encode()) == ("engine-1", "org/model@v2")
    for bad in ("", "kv@x", "kv@@m", "xx@a@b", b"\xff"):
        with pytest.raises(ValueError):
            parse_topic(bad)
    with pytest.raises(ValueError):
        make_topic("a@b", "m")


# ----------------------------------------------------------------------------- fuzzing

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
)
_msgpack_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=20), st.sampled_from(list(BlockStored.REQUIRED) + ["type"])), inner, max_size=6),
    ),
    max_leaves=30,
)


def _only_decode_error(fn, *args) -> None:
    try:
        fn(*args)
    except DecodeError:
        pass


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    _only_decode_error(decode_batch, data)


@settings(max_examples=200, deadline=None)
@given(_msgpack_values)
def test_fuzz_random_structures(value) -> None:
    _only_decode_error(decode_batch, msgpack.packb(value, use_bin_type=True))
    _only_decode_error(decode_batch, msgpack.packb([1.0, [value], 0], use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_valid_payloads(data) -> None:
    payload = bytearray(encode_batch(sample_batch()))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if op == "flip" and payload:
            payload[pos] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del payload[pos:]
        else:
            payload[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
    _only_decode_error(decode_batch, bytes(payload))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=12), st.integers(), st.none()), max_size=5))
def test_fuzz_frames(frames) -> None:
    _only_decode_error(decode_message, frames)


_hash_st = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.binary(min_size=16, max_size=32))
_opt_str = st.one_of(st.none(), st.text(max_size=6))
_opt_int = st.one_of(st.none(), st.integers(min_value=0, max_value=2**31))
_stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(_hash_st, max_size=3),
    parent_block_hash=st.one_of(st.none(), _hash_st),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**32), max_size=20),
    block_size=st.integers(min_value=1, max_value=128),
    lora_id=_opt_int,
    medium=st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    lora_name=_opt_str,
    extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=4)), st.tuples(st.text(max_size=4), st.integers(-64, 64))), max_size=3)),
    group_idx=_opt_int,
    kv_cache_spec_kind=_opt_str,
    kv_cache_spec_sliding_window=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
    session_id=_opt_str,
)
_removed_st = st.builds(BlockRemoved, st.lists(_hash_st, max_size=2), st.sampled_from([None, "GPU"]), _opt_int, _opt_str, _opt_str)
_event_st = st.one_of(_stored_st, _removed_st, st.just(AllBlocksCleared()))


@settings(max_examples=200, deadline=None)
@given(st.lists(_event_st, max_size=6), st.floats(0, 2e9), st.one_of(st.none(), st.integers(0, 8)))
def test_fast_and_tolerant_paths_agree(events, ts, rank) -> None:
    from kvmesh.events import codec

    batch = KVEventBatch(ts, events, rank)
    payload = encode_batch(batch)
    assert payload == codec._encode_plain(batch)  # msgspec-struct encoder == dict encoder
    fast = codec._decode_fast(payload)
    tolerant = codec._decode_obj(msgpack.unpackb(payload, raw=False, strict_map_key=False))
    assert fast is not None and fast.errors == [] and tolerant.errors == []
    assert fast.batch == tolerant.batch == batch
