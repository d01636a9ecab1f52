"""Async front of the ingest core: one ordered queue and worker per endpoint.

Why: events of one endpoint must be applied in order, while endpoints must
not wait for each other (a slow replay or a Redis hiccup on one engine cannot
stall the rest). Each endpoint gets its own bounded queue and task; work that
may block (Redis calls, replay requests) runs in a worker thread. The queue is
bounded in messages *and in payload bytes* (a flood of 12 MB messages must not
queue gigabytes): a message past either bound is dropped, counted, and the
endpoint is marked for re-sync, which replays the lost batches (or clears the
endpoint) once its queue has drained -- memory stays bounded under overload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvmesh.events.codec import DecodeError, EventError, KVEventBatch, decode_batch
from kvmesh.index.base import IndexUnavailable
from kvmesh_indexer.ingest import BatchResult, Ingestor
from kvmesh_indexer.keys import EngineHashing
from kvmesh_indexer.replay_client import ReplayError, fetch_replay

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.indexer.ingest")


@dataclass
class EndpointSource:
    """What the pump knows about one endpoint's publisher."""

    endpoint: str
    model: str
    engine: EngineHashing | None = None
    replay_endpoint: str | None = None


@dataclass
class _Item:
    seq: int | None
    payload: bytes | None
    batch: KVEventBatch | None
    future: asyncio.Future | None
    model: str | None = None
    resync: bool = False
    probe: bool = False


class IngestPump:
    def __init__(self, ingestor: Ingestor, replay_timeout_s: float = 2.0, queue_size: int = 10_000,
                 max_payload_bytes: int = 16 * 1024 * 1024, on_drop: Callable[[str], None] | None = None,
                 resync_interval_s: float = 0.5, queue_bytes: int = 64 * 1024 * 1024,
                 tail_probe_s: float = 5.0, max_probes_in_flight: int = 2) -> None:
        self.ingestor = ingestor
        self.replay_timeout_s = replay_timeout_s
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self._bytes: dict[str, int] = {}   # payload bytes waiting per endpoint
        # endpoint id -> CURVE client settings for its event and replay sockets (None = plaintext)
        self.curve_for: Callable[[str], Any] = lambda endpoint: None
        self.max_payload_bytes = max_payload_bytes
        self.on_drop = on_drop
        self.resync_interval_s = resync_interval_s
        # Tail probes: a quiet endpoint's replay buffer is checked every ``tail_probe_s`` (0 = off),
        # backing off while it does not answer, with few in flight so a fleet of dead engines
        # cannot tie up the worker threads that ingest runs on.
        self.tail_probe_s = tail_probe_s
        self.max_probes_in_flight = max_probes_in_flight
        self._last_msg: dict[str, float] = {}
        self._next_probe: dict[str, float] = {}
        self._probe_backoff: dict[str, float] = {}
        self._probing: set[str] = set()
        self.sources: dict[str, EndpointSource] = {}
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._resync_task: asyncio.Task | None = None
        self._run_id: str | None = None
        self._closed = False

    async def start(self) -> None:
        """Remember the backend's identity (to notice a restart that lost data) and start re-sync."""
        run_id_fn = getattr(self.ingestor.index, "run_id", None)
        if run_id_fn is not None:
            self._run_id = await asyncio.to_thread(run_id_fn)
        if self._resync_task is None:
            self._resync_task = asyncio.create_task(self._resync_loop(), name="ingest-resync")

    # ---- configuration ---------------------------------------------------------------
    def configure(self, source: EndpointSource) -> None:
        self.sources[source.endpoint] = source

    def replay_fn(self, endpoint: str) -> Callable[[int], list[tuple[int, KVEventBatch]]] | None:
        src = self.sources.get(endpoint)
        if src is None or not src.replay_endpoint:
            return None
        addr = src.replay_endpoint
        curve = self.curve_for(endpoint)

        def replay(start: int) -> list[tuple[int, KVEventBatch]]:
            try:
                raw = fetch_replay(addr, start, timeout_s=self.replay_timeout_s,
                                   max_message_bytes=self.max_payload_bytes, curve=curve)
            except ReplayError as exc:
                # Raised, not []: "no answer" must not read as "the engine has nothing" (ingest
                # treats a failed replay as empty when filling a gap, and as unknown when checking).
                log.warning("replay request failed", extra={"endpoint": endpoint, "error": str(exc)})
                raise
            out = []
            for seq, payload in raw:
                try:
                    out.append((seq, decode_batch(payload, self.max_payload_bytes).batch))
                except DecodeError as exc:
                    log.warning("bad replayed batch", extra={"endpoint": endpoint, "seq": seq, "error": str(exc)})
            return out

        return replay

    # ---- intake ----------------------------------------------------------------------
    def submit_nowait(self, endpoint: str, seq: int | None, payload: bytes | None = None,
                      batch: KVEventBatch | None = None, model: str | None = None) -> bool:
        """Queue a message (ZMQ path); False when the endpoint's queue is full (dropped)."""
        q = self._queue(endpoint)
        size = len(payload) if payload is not None else 0
        if self._bytes.get(endpoint, 0) + size > self.queue_bytes or q.full():
            self.dropped(endpoint)
            return False
        q.put_nowait(_Item(seq, payload, batch, None, model))
        self._bytes[endpoint] = self._bytes.get(endpoint, 0) + size
        self._last_msg[endpoint] = time.monotonic()
        return True

    def dropped(self, endpoint: str) -> None:
        """A message was lost here: count it, and have the endpoint re-synced (replay) once drained."""
        if self.on_drop:
            self.on_drop(endpoint)
        st = self.ingestor.endpoints.get(endpoint)
        if st is not None:
            st.bump("dropped")
            st.needs_resync = True

    def queued_bytes(self, endpoint: str) -> int:
        return self._bytes.get(endpoint, 0)

    async def submit(self, endpoint: str, seq: int | None, payload: bytes | None = None,
                     batch: KVEventBatch | None = None, model: str | None = None) -> BatchResult:
        """Queue a message and wait until it is applied (gRPC path, with back-pressure)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        size = len(payload) if payload is not None else 0
        # Back-pressure in bytes too: wait for room rather than queue past the bound.
        while self._bytes.get(endpoint, 0) and self._bytes.get(endpoint, 0) + size > self.queue_bytes:
            await asyncio.sleep(0.01)
        await self._queue(endpoint).put(_Item(seq, payload, batch, fut, model))
        self._bytes[endpoint] = self._bytes.get(endpoint, 0) + size
        self._last_msg[endpoint] = time.monotonic()
        return await fut

    def _queue(self, endpoint: str) -> asyncio.Queue[_Item]:
        q = self._queues.get(endpoint)
        if q is None:
            q = self._queues[endpoint] = asyncio.Queue(self.queue_size)
            self._tasks[endpoint] = asyncio.create_task(self._worker(endpoint, q), name=f"ingest-{endpoint}")
        if self._resync_task is None and not self._closed:
            self._resync_task = asyncio.create_task(self._resync_loop(), name="ingest-resync")
        return q

    async def drain(self, endpoint: str | None = None) -> None:
        """Wait until queued messages (of one endpoint or all) are processed."""
        qs = [self._queues[endpoint]] if endpoint in self._queues else list(self._queues.values())
        if endpoint is not None and endpoint not in self._queues:
            return
        for q in qs:
            await q.join()

    # ---- workers ---------------------------------------------------------------------
    async def _worker(self, endpoint: str, q: asyncio.Queue[_Item]) -> None:
        while True:
            item = await q.get()
            if item.payload is not None:
                self._bytes[endpoint] = max(0, self._bytes.get(endpoint, 0) - len(item.payload))
            try:
                res = await self._handle(endpoint, item)
                if item.future is not None and not item.future.done():
                    item.future.set_result(res)
            except Exception as exc:  # noqa: BLE001 - one bad message never kills the endpoint's worker
                if item.future is not None and not item.future.done():
                    item.future.set_exception(exc)
                if not isinstance(exc, IndexUnavailable):
                    log.exception("ingest failed", extra={"endpoint": endpoint})
                else:
                    log.warning("index unavailable; endpoint will re-sync", extra={"endpoint": endpoint,
                                                                                    "error": str(exc)})
            finally:
                q.task_done()

    async def _handle(self, endpoint: str, item: _Item) -> BatchResult:
        src = self.sources.get(endpoint)
        if item.resync:
            await self._run(self.ingestor.resync, endpoint, self.replay_fn(endpoint))
            return BatchResult()
        if item.probe:
            await self._probe(endpoint, src)
            return BatchResult()
        model = item.model or (src.model if src else None)
        if not model:
            self.ingestor.observer.on_rejected(endpoint, "unknown_endpoint", 1)
            raise ValueError(f"endpoint {endpoint!r} has no model (not configured or registered)")
        batch = item.batch
        errors: list[EventError] = []
        malformed = False
        if batch is None and item.payload is not None:
            try:
                decoded = decode_batch(item.payload, self.max_payload_bytes)
                batch, errors = decoded.batch, decoded.errors
            except DecodeError as exc:
                malformed = True
                self.ingestor.observer.on_rejected(endpoint, "malformed_payload", 1)
                log.warning("malformed kv-event payload", extra={"endpoint": endpoint, "seq": item.seq,
                                                                 "error": str(exc)})
        n_events = len(batch.events) if batch is not None else 0
        with _tracer.start_as_current_span("indexer.ingest_batch", attributes={
            "kvmesh.endpoint": endpoint, "kvmesh.model": model, "kvmesh.seq": -1 if item.seq is None else item.seq,
            "kvmesh.events": n_events,
        }) as span:
            res = await self._run(self.ingestor.process, endpoint, model, item.seq, batch, errors,
                                  self.replay_fn(endpoint), src.engine if src else None)
            if malformed:
                res.rejected += 1
            span.set_attribute("kvmesh.applied", res.applied)
            span.set_attribute("kvmesh.rejected", res.rejected)
            return res

    async def _probe(self, endpoint: str, src: EndpointSource | None) -> None:
        try:
            if src is None:
                return
            try:
                outcome = await self._run(self.ingestor.probe_tail, endpoint, src.model,
                                          self.replay_fn(endpoint), src.engine)
            except ValueError:   # a model this indexer does not serve: ingest refuses it anyway
                outcome = "unreachable"
            if outcome == "unreachable":
                back = min(max(self._probe_backoff.get(endpoint, 0.0) * 2, self.tail_probe_s), 12 * self.tail_probe_s)
                self._probe_backoff[endpoint] = back
            else:
                self._probe_backoff.pop(endpoint, None)
                back = self.tail_probe_s
                if outcome != "in_sync":
                    log.warning("tail probe repaired the endpoint", extra={"endpoint": endpoint, "outcome": outcome})
            self._next_probe[endpoint] = time.monotonic() + back
        finally:
            self._probing.discard(endpoint)

    def _schedule_probes(self) -> None:
        """Queue a tail probe for each quiet endpoint that has a replay socket and is due."""
        if self.tail_probe_s <= 0 or self._closed:
            return
        now = time.monotonic()
        for endpoint, src in list(self.sources.items()):
            if len(self._probing) >= self.max_probes_in_flight:
                return
            if not src.replay_endpoint or endpoint in self._probing:
                continue
            if now - self._last_msg.get(endpoint, 0.0) < self.tail_probe_s:
                continue
            due = self._next_probe.setdefault(endpoint, now + self.tail_probe_s)
            if now < due:
                continue
            q = self._queue(endpoint)
            if not q.empty():
                continue
            self._probing.add(endpoint)
            q.put_nowait(_Item(None, None, None, None, probe=True))

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Replay requests and Redis calls block; keep them off the event loop.
        return await asyncio.to_thread(fn, *args)

    async def _resync_loop(self) -> None:
        index = self.ingestor.index
        while not self._closed:
            await asyncio.sleep(self.resync_interval_s)
            try:
                run_id_fn = getattr(index, "run_id", None)
                if run_id_fn is not None:
                    rid = await asyncio.to_thread(run_id_fn)
                    if rid is None:
                        continue  # backend still down
                    if self._run_id is not None and rid != self._run_id:
                        log.warning("index backend restarted (lost its data); re-syncing all endpoints")
                        self.ingestor.backend_reset()
                    self._run_id = rid
                for st in self.ingestor.pending_resync():
                    q = self._queues.get(st.endpoint)
                    if q is not None and q.empty():
                        # Through the endpoint's own queue, so it stays ordered with live batches.
                        q.put_nowait(_Item(None, None, None, None, resync=True))
                self._schedule_probes()
            except IndexUnavailable:
                continue
            except Exception:  # noqa: BLE001
                log.exception("resync loop error")

    async def forget(self, endpoint: str) -> int:
        """Stop ingesting an endpoint and purge its entries."""
        task = self._tasks.pop(endpoint, None)
        q = self._queues.pop(endpoint, None)
        self._bytes.pop(endpoint, None)
        for d in (self._last_msg, self._next_probe, self._probe_backoff):
            d.pop(endpoint, None)
        self._probing.discard(endpoint)
        while q is not None and not q.empty():
            item = q.get_nowait()
            if item.future is not None and not item.future.done():
                item.future.set_exception(ValueError(f"endpoint {endpoint!r} was purged"))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.sources.pop(endpoint, None)
        return int(await self._run(self.ingestor.forget_endpoint, endpoint))

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values()) + ([self._resync_task] if self._resync_task else [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._queues.clear()
        self._bytes.clear()
