"""A worker's mirror of its own engine's prefix cache, kept from the engine's KV events.

Why it exists: the router explains a missed prediction by comparing it with the engine's
cache when the request arrived (``CacheTruth``, ``kvmesh.routing.fidelity``). vLLM keeps its
cache in its engine-core process and offers no query for it (vLLM 0.32 reports a request's
``num_cached_tokens`` only once it is scheduled, which is the *actual* hit, not the cache at
arrival). It does publish every change as KV events. Subscribed on loopback, with no network
or indexer in between, this mirror is the engine's GPU cache as of the latest delivered
batch, and it counts batches the way the indexer does (last sequence number + 1), so the
router can tell index lag from a view bug.

A gap in sequence numbers (a subscription that started late, a dropped batch) is filled from
the engine's replay socket, as the indexer does. When it cannot be (no replay endpoint, the
batches left the engine's buffer), or on an overflow, the mirror says "unknown" (``truth``
returns None) until the engine clears its cache or restarts: a wrong truth would turn
eviction into a false view bug.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvmesh.events.codec import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    decode_message,
)
from kvmesh.hashing import BlockHasher, ExtraKeys, event_key

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_CHUNK_BLOCKS = 64     # hash the prompt this many blocks at a time; stop at the first miss
_END = REPLAY_END_SEQ.to_bytes(8, "big")


def _key(h: int | bytes) -> int:
    return event_key(bytes(h)) if isinstance(h, bytes | bytearray) else int(h) & _MASK64


class CacheMirror:
    """The block keys the engine holds in its own (GPU) cache, from its KV events.

    Keys are counted by copy: vLLM's block pool may hold two blocks with one hash (a fully
    cached prompt's last block is computed again into a new block) and announces each store
    and each eviction, so a key is held until its last copy is removed."""

    def __init__(self, endpoint: str, topic: str, hasher: BlockHasher, max_blocks: int,
                 replay_endpoint: str = "", replay_timeout_s: float = 2.0) -> None:
        # The engine binds (tcp://*:PORT); the mirror connects on loopback.
        self.endpoint = endpoint.replace("*", "127.0.0.1")
        self.replay_endpoint = replay_endpoint.replace("*", "127.0.0.1")
        self.replay_timeout_s = replay_timeout_s
        self.topic = topic
        self.hasher = hasher
        self.max_blocks = max(1, max_blocks)
        self._blocks: dict[int, int] = {}   # key -> copies
        self._lock = threading.Lock()
        self._next_seq = 0         # batches applied (the indexer's "applied" count)
        self._sure = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # -- the subscriber ------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvmesh-cache-mirror", daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)   # never drop: a dropped batch makes the mirror unsure
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                try:
                    msg = decode_message(frames)
                except DecodeError as exc:
                    self._unsure(f"undecodable KV-event batch: {exc}")
                    continue
                if msg.errors:
                    self._unsure(f"undecodable KV events: {msg.errors[0]}")
                if msg.seq > self._next_seq and self.replay_endpoint:
                    self._fill(ctx, msg.seq)
                self.apply(msg.seq, msg.batch.events)
        finally:
            sock.close(0)

    def _fill(self, ctx: Any, upto: int) -> None:
        """Apply the missed batches [next, upto) from the engine's replay buffer (vLLM's protocol:
        ``[b"", start_seq]`` in, ``[b"", topic, seq, payload]`` per batch out, then an end marker)."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A DEALER with no live pipe blocks in send: bound it like the wait for the reply.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.replay_timeout_s * 1000)))
        try:
            sock.connect(self.replay_endpoint)
            try:
                sock.send_multipart([b"", self._next_seq.to_bytes(8, "big")])
            except zmq.Again:
                return
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return
                _, _, seq_b, payload = frames
                if seq_b == _END:
                    return
                seq = int.from_bytes(seq_b, "big")
                if self._next_seq <= seq < upto:
                    try:
                        self.apply(seq, decode_batch(payload).batch.events)
                    except DecodeError:
                        return
        finally:
            sock.close(0)

    # -- state -----------------------------------------------------------------------
    def apply(self, seq: int, events: Sequence[Any]) -> None:
        """Apply one batch (in order); a gap makes the mirror unsure."""
        with self._lock:
            if seq < self._next_seq:
                # Sequence numbers went back: the engine restarted with an empty cache.
                self._blocks.clear()
                self._sure = True
            elif seq != self._next_seq:
                self._unsure_locked(f"missed KV-event batches {self._next_seq}..{seq - 1}")
            self._next_seq = seq + 1
            for ev in events:
                if isinstance(ev, BlockStored):
                    if ev.medium in (None, "", "GPU"):
                        blocks = self._blocks
                        for h in ev.block_hashes:
                            k = _key(h)
                            blocks[k] = blocks.get(k, 0) + 1
                elif isinstance(ev, BlockRemoved):
                    if ev.medium in (None, "", "GPU"):
                        blocks = self._blocks
                        for h in ev.block_hashes:
                            k = _key(h)
                            n = blocks.get(k, 0)
                            if n > 1:
                                blocks[k] = n - 1
                            elif n:
                                del blocks[k]
                elif isinstance(ev, AllBlocksCleared):
                    self._blocks.clear()
                    self._sure = True   # a known state again
            if len(self._blocks) > self.max_blocks:
                # More than the engine can hold: removals were lost.
                self._blocks.clear()
                self._unsure_locked(f"over {self.max_blocks} blocks")

    def _unsure(self, why: str) -> None:
        with self._lock:
            self._unsure_locked(why)

    def _unsure_locked(self, why: str) -> None:
        if self._sure:
            log.warning("engine cache mirror lost track; cache at arrival reported unknown", extra={"why": why})
        self._sure = False

    # -- the answer --------------------------------------------------------------------
    def truth_of_keys(self, keys: Sequence[int]) -> tuple[int, int] | None:
        """As ``truth``, for a prompt whose block keys are already hashed."""
        with self._lock:
            if not self._sure:
                return None
            hit = 0
            for k in keys:
                if k not in self._blocks:
                    break
                hit += 1
            return hit * self.hasher.block_size, self._next_seq

    def truth(self, tokens: Sequence[int], extra: ExtraKeys | None = None) -> tuple[int, int] | None:
        """(leading prompt tokens the engine holds, batches that view rests on), or None when unsure."""
        with self._lock:
            if not self._sure:
                return None
            blocks = self._blocks
            through = self._next_seq
            bs = self.hasher.block_size
            n_full = len(tokens) // bs
            parent: bytes | None = None
            hit = 0
            while hit < n_full:
                end = min(n_full, hit + _CHUNK_BLOCKS)
                digests = self.hasher.block_digests(tokens[hit * bs:end * bs], extra, parent, hit)
                for d in digests:
                    if event_key(d) not in blocks:
                        return hit * bs, through
                    hit += 1
                    parent = d
            return hit * bs, through
