"""The worker's mirror of its engine's cache (``kvmesh.worker.engine.cache_mirror``).

Fed by a real ZMQ publisher with vLLM's wire format and replay protocol: it must answer the
leading cached tokens of a prompt and the batches its view rests on, fill a gap from the
replay socket, and say "unknown" rather than guess when it cannot.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.events.publisher import KvEventPublisher
from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.worker.engine.cache_mirror import CacheMirror

BS = 16
TOPIC = "kv@w1@m"


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def _stored(hasher: BlockHasher, tokens: list[int], extra: ExtraKeys | None = None) -> BlockStored:
    keys = hasher.block_keys(tokens, extra)
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=tokens[:len(keys) * BS],
                       block_size=BS, medium="GPU")


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_leading_hit_batches_and_removals() -> None:
    h = BlockHasher("sha256_cbor", BS)
    m = CacheMirror("tcp://127.0.0.1:1", TOPIC, h, max_blocks=1000)   # fed directly, not started
    p = _prompt(1, 5 * BS + 3)
    assert m.truth(p) == (0, 0)
    m.apply(0, [_stored(h, p[:4 * BS])])
    assert m.truth(p) == (4 * BS, 1)
    assert m.truth(p, ExtraKeys(cache_salt="other")) == (0, 1)   # salted: another chain
    third = h.block_keys(p[:3 * BS])[2]
    m.apply(1, [BlockRemoved(block_hashes=[third], medium="GPU")])
    assert m.truth(p) == (2 * BS, 2)
    m.apply(2, [BlockStored(block_hashes=h.block_keys(p)[2:5], parent_block_hash=None,
                            token_ids=p[2 * BS:5 * BS], block_size=BS, medium="CPU")])
    assert m.truth(p) == (2 * BS, 3)   # another medium is not the engine's own cache
    assert m.truth_of_keys(h.block_keys(p)) == (2 * BS, 3)


def test_a_block_is_held_until_the_engines_last_copy_is_removed() -> None:
    # Two copies of each block (a block computed again while cached): vLLM announces both stores
    # and removes the copies one at a time.
    h = BlockHasher("sha256_cbor", BS)
    m = CacheMirror("tcp://127.0.0.1:1", TOPIC, h, max_blocks=1000)
    p = _prompt(4, 3 * BS)
    keys = h.block_keys(p)
    m.apply(0, [_stored(h, p), _stored(h, p)])
    m.apply(1, [BlockRemoved(block_hashes=keys[::-1], medium="GPU")])
    assert m.truth(p) == (3 * BS, 2)
    m.apply(2, [BlockRemoved(block_hashes=keys[::-1], medium="GPU")])
    assert m.truth(p) == (0, 3)


def test_a_gap_without_replay_is_unknown_until_the_cache_is_cleared() -> None:
    h = BlockHasher("sha256_cbor", BS)
    m = CacheMirror("tcp://127.0.0.1:1", TOPIC, h, max_blocks=1000)
    p = _prompt(2, 3 * BS)
    m.apply(0, [_stored(h, p)])
    m.apply(2, [])            # batch 1 was missed
    assert m.truth(p) is None
    m.apply(3, [AllBlocksCleared()])
    assert m.truth(p) == (0, 4)
    m.apply(0, [_stored(h, p)])   # sequence numbers restarted: a restarted engine
    assert m.truth(p) == (3 * BS, 1)


def test_more_blocks_than_the_engine_holds_is_unknown() -> None:
    h = BlockHasher("sha256_cbor", BS)
    m = CacheMirror("tcp://127.0.0.1:1", TOPIC, h, max_blocks=4)
    p = _prompt(3, 6 * BS)
    m.apply(0, [_stored(h, p)])
    assert m.truth(p) is None


def test_a_late_subscriber_fills_the_gap_from_replay() -> None:
    h = BlockHasher("sha256_cbor", BS)
    a, b = _prompt(4, 3 * BS), _prompt(5, 2 * BS)
    with KvEventPublisher("tcp://*:0", topic=TOPIC, replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish([_stored(h, a)])   # before anyone subscribed: only replay has it
        m = CacheMirror(pub.endpoint, TOPIC, h, max_blocks=1000, replay_endpoint=pub.replay_endpoint or "")
        m.start()
        try:
            # Published until the subscription is live (a SUB joins late); each is a new batch.
            deadline = time.monotonic() + 10
            while m.truth(b) in (None, (0, 0)) and time.monotonic() < deadline:
                pub.publish([_stored(h, b)])
                time.sleep(0.05)
            _wait(lambda: m.truth(b) is not None and m.truth(b)[1] == pub.next_seq, "the mirror to catch up")
            assert m.truth(a) == (3 * BS, pub.next_seq)   # from the replayed batch 0
            assert m.truth(b)[0] == 2 * BS
        finally:
            m.stop()
