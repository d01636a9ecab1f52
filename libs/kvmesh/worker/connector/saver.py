"""Background writer that moves copied KV blocks to the offload store.

Why a thread: the connector's ``wait_for_save`` runs inside the engine step.
It only copies the blocks out of the paged cache (a memcpy) and hands them
here; the network write happens off the step, so a slow or dead store never
stalls generation. The queue is bounded in bytes: when the store cannot keep
up, new saves are dropped (and counted) instead of growing memory, since an
offloaded block is a cache, never the only copy of anything.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
    namespace: str
    keys: list[int]
    payloads: list[bytes]
    token_ids: list[list[int]]
    parent: int | None
    block_size: int
    session_id: str = ""

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


@dataclass
class SaverStats:
    jobs: int = 0
    blocks_stored: int = 0
    blocks_already_present: int = 0
    bytes_stored: int = 0
    dropped_jobs: int = 0
    failed_jobs: int = 0
    extra: dict = field(default_factory=dict)


class BlockSaver:
    """One daemon thread draining a byte-bounded queue of ``SaveJob`` into the store."""

    def __init__(self, client, max_pending_bytes: int = 256 << 20) -> None:
        self._client = client
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._q: queue.Queue[SaveJob | None] = queue.Queue()
        self.stats = SaverStats()
        self._last_warn = 0.0
        self._thread = threading.Thread(target=self._run, name="kvmesh-kv-saver", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job``; False (and counted) when the byte budget is exhausted."""
        n = job.nbytes
        with self._lock:
            if self._pending_bytes + n > self._max_pending:
                self.stats.dropped_jobs += 1
                return False
            self._pending_bytes += n
        self._q.put(job)
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued job is written (or failed); True if drained in time."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending_bytes > 0 or not self._q.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._q.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as exc:  # the store's errors are many; none may kill the thread
                self.stats.failed_jobs += 1
                now = time.monotonic()
                if now - self._last_warn > 5.0:
                    self._last_warn = now
                    logger.warning("offloading KV blocks failed; continuing without them",
                                   extra={"error": str(exc), "blocks": len(job.keys)})
            finally:
                with self._idle:
                    self._pending_bytes -= job.nbytes
                    self._idle.notify_all()

    def _write(self, job: SaveJob) -> None:
        # Skip the leading blocks the store already has (shared prefixes are common).
        present = self._client.contains(job.namespace, job.keys)
        if present >= len(job.keys):
            self.stats.blocks_already_present += present
            return
        parent = job.keys[present - 1] if present else job.parent
        res = self._client.put(
            job.namespace, list(zip(job.keys[present:], job.payloads[present:], strict=True)),
            token_ids=job.token_ids[present:], parent=parent, block_size=job.block_size,
            session_id=job.session_id)
        self.stats.jobs += 1
        self.stats.blocks_stored += res.stored
        self.stats.blocks_already_present += present + res.already_present
        self.stats.bytes_stored += res.bytes
