"""The synchronous ingest core: ordering, gaps, replay, restarts, bad input, outages."""

from __future__ import annotations

import pytest

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventError, KVEventBatch
from kvmesh.hashing import BlockHasher
from kvmesh.index.base import IndexUnavailable, Tier
from kvmesh.index.memory import MemoryIndex
from kvmesh_indexer.ingest import Ingestor
from kvmesh_indexer.keys import EngineHashing, ModelSpec

pytestmark = pytest.mark.timeout(30)

BS = 16
M = "m"
SPEC = ModelSpec(M, BS, "sha256_cbor")
KEYS = SPEC.hasher().block_keys(list(range(BS * 10)))


def store(i: int, j: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=KEYS[i:j], parent_block_hash=KEYS[i - 1] if i else None,
                       token_ids=list(range(i * BS, j * BS)), block_size=BS, medium=medium)


def batch(*events) -> KVEventBatch:  # noqa: ANN002
    return KVEventBatch(0.0, list(events))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        return lambda *a: self.calls.append((name, *a))


def make(**kw) -> tuple[Ingestor, MemoryIndex, Recorder]:  # noqa: ANN003
    idx = MemoryIndex()
    rec = Recorder()
    return Ingestor(idx, {M: SPEC}, rec, **kw), idx, rec


def combined(idx: MemoryIndex, ep: str = "e") -> int:
    m = idx.lookup(M, KEYS).matches.get(ep)
    return m.combined if m else 0


def test_in_order_batches_and_tiers() -> None:
    ing, idx, rec = make()
    ing.process("e", M, 0, batch(store(0, 3)))
    ing.process("e", M, 1, batch(store(3, 5), store(0, 2, "CPU"), BlockRemoved([KEYS[4]], "GPU")))
    m = idx.lookup(M, KEYS).matches["e"]
    assert m.tiers == {Tier.GPU: 4, Tier.CPU: 2} and m.combined == 4
    stored_events = sum(c[3] for c in rec.calls if c[:3] == ("on_events", "e", "stored"))
    assert stored_events == 3 and ("on_events", "e", "removed", 1) in rec.calls


def test_gap_filled_from_replay() -> None:
    ing, idx, rec = make()
    buffered = {0: batch(store(0, 2)), 1: batch(store(2, 4)), 2: batch(store(4, 6))}
    ing.process("e", M, 0, buffered[0])
    ing.process("e", M, 2, buffered[2], replay=lambda s: [(q, b) for q, b in buffered.items() if q >= s])
    assert combined(idx) == 6 and ing.endpoints["e"].last_seq == 2
    assert ("on_gap", "e", 1) in rec.calls and ("on_replay", "e", "complete") in rec.calls


def test_gap_not_covered_by_replay_clears_then_keeps_contiguous_tail() -> None:
    ing, idx, rec = make()
    ing.process("e", M, 0, batch(store(0, 2)))
    # The engine's buffer lost seq 1; it still holds 2 and 3.
    buf = {2: batch(store(6, 7)), 3: batch(store(7, 8))}
    ing.process("e", M, 4, batch(store(8, 9)), replay=lambda s: [(q, b) for q, b in buf.items() if q >= s])
    assert combined(idx) == 0
    assert idx.endpoint_blocks("e") == 3  # tail 2, 3 and the live batch 4
    assert ("on_clear", "e", "gap_unrepaired", 2) in rec.calls


def test_gap_without_replay_clears() -> None:
    ing, idx, rec = make()
    ing.process("e", M, 0, batch(store(0, 4)))
    ing.process("e", M, 5, batch(store(5, 6)))
    assert idx.endpoint_blocks("e") == 1 and ("on_clear", "e", "gap", 4) in rec.calls


def test_seq_reset_and_all_blocks_cleared() -> None:
    ing, idx, rec = make()
    ing.process("e", M, 0, batch(store(0, 4)))
    ing.process("e", M, 1, batch(store(4, 5)))
    ing.process("e", M, 0, batch(store(0, 1)))        # engine restarted
    assert idx.endpoint_blocks("e") == 1 and ("on_clear", "e", "seq_reset", 5) in rec.calls
    ing.process("e", M, 1, batch(store(1, 3), AllBlocksCleared(), store(0, 1)))
    assert idx.endpoint_blocks("e") == 1 and ("on_clear", "e", "all_blocks_cleared", 3) in rec.calls


def test_late_join_replays_from_zero() -> None:
    ing, idx, _ = make()
    buf = {0: batch(store(0, 3)), 1: batch(store(3, 4)), 2: batch(store(4, 5))}
    ing.process("e", M, 2, buf[2], replay=lambda s: [(q, b) for q, b in buf.items() if q >= s])
    assert combined(idx) == 5


def test_bad_events_skipped_rest_applied() -> None:
    ing, idx, rec = make(max_events_per_batch=5)
    bad_medium = store(2, 3, medium="TAPE")
    bad_hash = BlockStored(block_hashes=[-5], block_size=BS)
    res = ing.process("e", M, 0, batch(store(0, 2), bad_medium, bad_hash, store(2, 3)),
                      errors=[EventError(4, "unknown event type 'X'")])
    assert res.applied == 2 and res.rejected == 3 and combined(idx) == 3
    res = ing.process("e", M, 1, batch(*[store(0, 1)] * 6))
    assert not res.accepted and res.rejected == 6
    reasons = [c[2] for c in rec.calls if c[0] == "on_rejected"]
    assert reasons.count("bad_event") == 3 and "oversize_batch" in reasons


def test_unknown_model_is_an_error() -> None:
    ing, _, _ = make()
    with pytest.raises(ValueError, match="unknown model"):
        ing.process("e", "nope", 0, batch())


def test_derived_keys_through_ingest() -> None:
    engine = BlockHasher("sha256", BS)
    toks = list(range(BS * 10))
    eh = [int.from_bytes(d[-8:], "big") for d in engine.block_digests(toks)]
    ing, idx, _ = make()
    ev = BlockStored(block_hashes=eh[:3], parent_block_hash=None, token_ids=toks[:3 * BS], block_size=BS)
    ing.process("v", M, 0, batch(ev), engine=EngineHashing("sha256", BS))
    assert idx.lookup(M, KEYS).matches["v"].combined == 3
    ing.process("v", M, 1, batch(BlockRemoved([eh[1]], "GPU")))
    assert idx.lookup(M, KEYS).matches["v"].combined == 1


class FlakyIndex(MemoryIndex):
    down = False

    def add(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        if self.down:
            raise IndexUnavailable("down")
        return super().add(*a, **k)


def test_backend_outage_resyncs_by_replay_or_clear() -> None:
    idx = FlakyIndex()
    ing = Ingestor(idx, {M: SPEC})
    buf = {0: batch(store(0, 2)), 1: batch(store(2, 4))}
    ing.process("e", M, 0, buf[0])
    idx.down = True
    with pytest.raises(IndexUnavailable):
        ing.process("e", M, 1, buf[1])
    assert [s.endpoint for s in ing.pending_resync()] == ["e"]
    idx.down = False
    ing.resync("e", replay=lambda s: [(q, b) for q, b in buf.items() if q >= s])
    assert idx.lookup(M, KEYS).matches["e"].combined == 4 and not ing.pending_resync()
    # Without replay the endpoint is cleared instead.
    idx.down = True
    with pytest.raises(IndexUnavailable):
        ing.process("e", M, 2, batch(store(4, 5)))
    idx.down = False
    ing.resync("e", replay=None)
    assert idx.endpoint_blocks("e") == 0 and ing.endpoints["e"].last_seq == 2


# ---- tail probe: messages lost with nothing after them --------------------------------
def _buffer(buf: dict[int, KVEventBatch]):  # noqa: ANN202
    return lambda s: [(q, b) for q, b in sorted(buf.items()) if q >= s]


def test_probe_in_sync_changes_nothing() -> None:
    ing, idx, rec = make()
    buf = {0: batch(store(0, 2)), 1: batch(store(2, 4))}
    for q, b in buf.items():
        ing.process("e", M, q, b)
    assert ing.probe_tail("e", M, _buffer(buf)) == "in_sync"
    assert combined(idx) == 4 and not [c for c in rec.calls if c[0] in ("on_clear", "on_replay")]


def test_probe_applies_lost_tail_and_skips_its_late_live_copy() -> None:
    ing, idx, rec = make()
    buf = {0: batch(store(0, 2)), 1: batch(store(2, 4)), 2: batch(store(4, 6))}
    ing.process("e", M, 0, buf[0])
    # seq 1 and 2 never arrived and nothing followed them: no gap for the live rules to see.
    assert ing.probe_tail("e", M, _buffer(buf)) == "caught_up"
    assert combined(idx) == 6 and ing.endpoints["e"].last_seq == 2
    # The late live copy of seq 2 is a duplicate, not an engine restart.
    res = ing.process("e", M, 2, buf[2], replay=_buffer(buf))
    assert res.accepted and combined(idx) == 6
    assert not [c for c in rec.calls if c[0] == "on_clear"]
    ing.process("e", M, 3, batch(store(6, 7)), replay=_buffer(buf))
    assert combined(idx) == 7 and ing.endpoints["e"].probed is None


def test_probe_finds_a_restarted_engine_whose_first_batch_was_lost() -> None:
    ing, idx, rec = make()
    old = {0: batch(store(0, 2)), 1: batch(store(2, 5))}
    for q, b in old.items():
        ing.process("e", M, q, b)
    # A new process: its seq 0 and 1 were lost to the subscriber (slow joiner), nothing after.
    new = {0: batch(store(0, 1)), 1: batch(store(1, 3))}
    assert ing.probe_tail("e", M, _buffer(new)) == "restarted"
    assert combined(idx) == 3 and ing.endpoints["e"].last_seq == 1
    assert ("on_clear", "e", "probe_restart", 5) in rec.calls


def test_probe_finds_a_restart_that_already_passed_the_last_seq() -> None:
    ing, idx, _ = make()
    ing.process("e", M, 0, batch(store(0, 4)))
    # The new process published more batches than the old one: seq 0 exists but differs.
    new = {0: batch(store(0, 1)), 1: batch(store(1, 2))}
    assert ing.probe_tail("e", M, _buffer(new)) == "restarted"
    assert combined(idx) == 2


def test_probe_restart_then_live_reset_batch_with_a_probed_seq_is_not_skipped() -> None:
    ing, idx, _ = make()
    ing.process("e", M, 0, batch(store(0, 2)))
    buf = {0: batch(store(0, 2)), 1: batch(store(2, 4))}
    assert ing.probe_tail("e", M, _buffer(buf)) == "caught_up"
    # The engine then restarts: its new seq 1 carries other events and must count as a reset.
    new = {0: batch(store(0, 1)), 1: batch(store(5, 6))}
    ing.process("e", M, 1, new[1], replay=_buffer(new))
    assert ing.endpoints["e"].counters.get("seq_reset") == 1


def test_probe_late_join_and_unreachable() -> None:
    ing, idx, _ = make()
    buf = {0: batch(store(0, 2)), 1: batch(store(2, 3))}
    assert ing.probe_tail("e", M, _buffer(buf)) == "caught_up"   # never saw a message: all lost
    assert combined(idx) == 3

    def down(start: int):  # noqa: ANN202, ARG001
        raise TimeoutError("no answer")
    assert ing.probe_tail("e", M, down) == "unreachable" and combined(idx) == 3
    assert ing.probe_tail("e", M, None) == "skipped"


def test_probe_after_buffer_overflow_is_a_gap() -> None:
    ing, idx, rec = make()
    ing.process("e", M, 0, batch(store(0, 2)))
    buf = {5: batch(store(7, 8)), 6: batch(store(8, 9))}   # seq 1..4 fell out of the buffer
    assert ing.probe_tail("e", M, _buffer(buf)) == "caught_up"
    assert ("on_clear", "e", "probe_gap_unrepaired", 2) in rec.calls
    assert ing.endpoints["e"].last_seq == 6
