"""The offload store core: RAM tier over an optional disk tier, content-addressed by (namespace, key).

Synchronous and thread-safe (one lock), so the gRPC service wraps it with
``asyncio.to_thread`` and the virtual-time cluster simulator drives it directly.
In metadata-only mode blocks carry no bytes and sizes are whatever unit the
capacities are counted in; the lower tier is then a second ``RamTier``.

Invariants:
- A Put is all-or-nothing: it is validated and room is made before any block
  becomes visible; if room cannot be made, nothing changes (``StoreFullError``).
- Get returns the *leading* present blocks only, stopping at the first miss; a
  block that fails its checksum on disk is a miss.
- Tiers are inclusive: a block promoted from disk to RAM keeps its disk copy,
  so a later RAM eviction of it costs no write.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.kvstore.block import BlockId, CapacityError, StoredBlock
from kvmesh.kvstore.eviction import EvictionPolicy
from kvmesh.kvstore.eviction_registry import make_eviction_policy
from kvmesh.kvstore.ram_tier import RamTier
from kvmesh_offload.disk_tier import DiskTier

log = logging.getLogger(__name__)

CPU = "CPU"
DISK = "DISK"


def _compact(token_ids: Sequence[int]) -> Sequence[int]:
    """A block's token ids as 4 bytes each: a tuple of Python ints costs ~36 bytes a token, ~2.3 KiB
    for a 64-token block, which on a tier of small blocks (the sim's 32 KiB) was 7 % of the tier
    again in RSS, outside its budget. Ids that do not fit a u32 (never from the wire) stay a tuple."""
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        return tuple(token_ids)


class StoreFullError(Exception):
    """The store cannot make room for a Put (RESOURCE_EXHAUSTED)."""


class BadBlockError(ValueError):
    """A Put carries an invalid block (INVALID_ARGUMENT)."""


@dataclass
class StoreEvent:
    """A KV event in store terms; the service turns it into vLLM wire events."""

    kind: str                       # "stored" | "removed" | "cleared"
    namespace: str = ""
    keys: list[int] = field(default_factory=list)
    medium: str = CPU
    parent: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0


@dataclass
class BlockIn:
    key: int
    data: bytes | None
    checksum: int = 0   # XXH3-64 of the data (kvmesh.kvstore.checksum)
    token_ids: tuple[int, ...] = ()
    size: int = 0                   # metadata-only mode: capacity units of this block


@dataclass
class PutOutcome:
    stored: int = 0
    already_present: int = 0
    bytes: int = 0
    evicted: int = 0


@dataclass
class Found:
    key: int
    block: StoredBlock
    medium: str


EventSink = Callable[[list[StoreEvent]], None]


class OffloadStore:
    def __init__(self, ram_capacity: int, *, policy: str | EvictionPolicy = "lru",
                 disk: DiskTier | RamTier | None = None, evict_on_full: bool = True,
                 event_sink: EventSink | None = None, metadata_only: bool = False,
                 max_block_bytes: int = 64 * 1024 * 1024) -> None:
        # The store's clock is the wall clock (the agent policy's recency is in seconds).
        pol = (make_eviction_policy(policy, **({"clock": time.monotonic} if policy == "agent" else {}))
               if isinstance(policy, str) else policy)
        self.ram = RamTier(ram_capacity, pol)
        self.disk = disk
        self.evict_on_full = evict_on_full
        self.metadata_only = metadata_only
        self.max_block_bytes = max_block_bytes
        self.event_sink = event_sink
        self.counters: Counter[str] = Counter()
        self._lock = threading.RLock()
        if metadata_only and isinstance(disk, DiskTier):
            raise ValueError("metadata-only mode needs a RamTier as its lower tier, not a DiskTier")

    @property
    def policy_name(self) -> str:
        return self.ram.policy.name

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> int:
        """Index the disk tier left by a previous run and announce it; return the blocks found."""
        with self._lock:
            events: list[StoreEvent] = [StoreEvent("cleared")]
            if isinstance(self.disk, DiskTier):
                recovered = self.disk.open()
                self.counters["disk_corrupt_blocks"] += self.disk.corrupt
                for (ns, key), blk in recovered:
                    events.append(StoreEvent("stored", ns, [key], DISK, blk.parent, list(blk.token_ids),
                                             blk.block_size))
                self.counters["disk_recovered_blocks"] += len(recovered)
                log.info("disk tier opened", extra={"blocks": len(recovered), "bytes": self.disk.used})
            self._emit(events)
            return len(events) - 1

    def _emit(self, events: list[StoreEvent]) -> None:
        if events and self.event_sink is not None:
            try:
                self.event_sink(events)
            except Exception:  # noqa: BLE001 - events are advisory; the store must keep working
                log.exception("offload event sink failed")

    # -- queries ------------------------------------------------------------------------------

    def _depth_after(self, namespace: str, parent: int | None) -> int:
        """Chain depth of the block after ``parent`` (0 when the parent is unknown here)."""
        if parent is None:
            return 0
        for tier in (self.ram, self.disk):
            d = tier.depth_of((namespace, parent)) if tier is not None else None
            if d is not None:
                return d + 1
        return 0

    def _where(self, bid: BlockId) -> str | None:
        if bid in self.ram:
            return CPU
        if self.disk is not None and bid in self.disk:
            return DISK
        return None

    def contains(self, namespace: str, keys: Sequence[int], session: str = "") -> tuple[int, int]:
        """(leading present in any tier, leading present in RAM)."""
        with self._lock:
            present = in_ram = 0
            ram_run = True
            for key in keys:
                where = self._where((namespace, key))
                if where is None:
                    break
                present += 1
                if ram_run and where == CPU:
                    in_ram += 1
                else:
                    ram_run = False
            return present, in_ram

    # -- put ----------------------------------------------------------------------------------

    def put(self, namespace: str, blocks: Sequence[BlockIn], *, parent: int | None = None,
            session: str = "", block_size: int = 0) -> PutOutcome:
        if not namespace:
            raise BadBlockError("namespace is required")
        out = PutOutcome()
        with self._lock:
            self.ram.new_batch()
            if self.disk is not None:
                self.disk.new_batch()
            new: list[tuple[BlockId, StoredBlock]] = []
            seen: set[BlockId] = set()
            prev = parent
            # Depth in the chain, not in this put: workers skip the leading blocks the store
            # already has, and the eviction policies rank blocks by their depth in the chain.
            for depth, b in enumerate(blocks, start=self._depth_after(namespace, parent)):
                bid = (namespace, b.key)
                size = self._size_of(b)
                blk = StoredBlock(size=size, data=None if self.metadata_only else b.data, checksum=b.checksum,
                                  parent=prev, token_ids=_compact(b.token_ids), block_size=block_size,
                                  depth=depth, session=session)
                prev = b.key
                if bid in seen:
                    continue
                seen.add(bid)
                where = self._where(bid)
                if where == CPU:
                    self.ram.touch(bid, session)
                    out.already_present += 1
                elif where == DISK:
                    self.disk.touch(bid, session)  # type: ignore[union-attr]
                    out.already_present += 1
                else:
                    new.append((bid, blk))
            need = sum(blk.size for _, blk in new)
            if new:
                try:
                    victims = self.ram.make_room(need, protect=seen, allow_evict=self.evict_on_full)
                except CapacityError as exc:
                    self.counters["put_refused_full"] += 1
                    raise StoreFullError(str(exc)) from exc
                events = self._demote(victims)
                out.evicted = len(victims)
                for bid, blk in new:
                    self.ram.add(bid, blk)
                out.stored = len(new)
                out.bytes = need
                self.counters["bytes_stored_ram"] += need
                self.counters["blocks_stored"] += len(new)
                events.extend(self._stored_events(namespace, new, block_size))
                self._emit(events)
            self.counters["blocks_already_present"] += out.already_present
            self.counters["puts"] += 1
            return out

    def _size_of(self, b: BlockIn) -> int:
        if self.metadata_only:
            return b.size or 1
        if b.data is None or len(b.data) == 0:
            raise BadBlockError(f"block {b.key}: no data")
        if len(b.data) > self.max_block_bytes:
            raise BadBlockError(f"block {b.key}: {len(b.data)} bytes exceeds the max of {self.max_block_bytes}")
        return len(b.data)

    @staticmethod
    def _stored_events(namespace: str, new: list[tuple[BlockId, StoredBlock]], block_size: int,
                       medium: str = CPU) -> list[StoreEvent]:
        # One event per contiguous run whose parent links hold, as vLLM does per request.
        events: list[StoreEvent] = []
        for bid, blk in new:
            last = events[-1] if events else None
            if last is not None and last.medium == medium and blk.parent == last.keys[-1]:
                last.keys.append(bid[1])
                last.token_ids.extend(blk.token_ids)
            else:
                events.append(StoreEvent("stored", namespace, [bid[1]], medium, blk.parent,
                                         list(blk.token_ids), blk.block_size or block_size))
        return events

    def _demote(self, victims: list[tuple[BlockId, StoredBlock]]) -> list[StoreEvent]:
        """Move RAM victims to the lower tier (or drop them); return the events."""
        events: list[StoreEvent] = []
        for bid, blk in victims:
            self.counters["evictions_ram"] += 1
            events.append(StoreEvent("removed", bid[0], [bid[1]], CPU))
            if self.disk is None:
                self.counters["blocks_dropped"] += 1
                continue
            if bid in self.disk:
                continue  # inclusive tiers: already on disk
            try:
                if isinstance(self.disk, DiskTier):
                    for gone in self.disk.make_room(blk.size):
                        self.counters["evictions_disk"] += 1
                        events.append(StoreEvent("removed", gone[0], [gone[1]], DISK))
                    self.disk.write(bid, blk)
                else:
                    for gone, _ in self.disk.make_room(blk.size):
                        self.counters["evictions_disk"] += 1
                        events.append(StoreEvent("removed", gone[0], [gone[1]], DISK))
                    self.disk.add(bid, blk)
            except (CapacityError, OSError) as exc:
                log.warning("cannot spill block to disk; dropping it",
                            extra={"namespace": bid[0], "key": bid[1], "reason": str(exc)})
                self.counters["blocks_dropped"] += 1
                continue
            self.counters["blocks_spilled"] += 1
            self.counters["bytes_stored_disk"] += blk.size
            events.append(StoreEvent("stored", bid[0], [bid[1]], DISK, blk.parent, list(blk.token_ids),
                                     blk.block_size))
        return events

    # -- get ----------------------------------------------------------------------------------

    def get(self, namespace: str, keys: Sequence[int], session: str = "", promote: bool = True) -> list[Found]:
        """The leading present blocks; disk hits are verified and promoted to RAM."""
        t0 = time.perf_counter()
        found: list[Found] = []
        events: list[StoreEvent] = []
        with self._lock:
            self.ram.new_batch()
            if self.disk is not None:
                self.disk.new_batch()
            for key in keys:
                bid = (namespace, key)
                blk = self.ram.get(bid, session)
                if blk is not None:
                    found.append(Found(key, blk, CPU))
                    self.counters["hits_ram"] += 1
                    self.counters["bytes_fetched_ram"] += blk.size
                    continue
                if self.disk is None:
                    break
                if isinstance(self.disk, DiskTier):
                    blk = self.disk.read(bid, session)
                    self.counters["disk_corrupt_blocks"] = self.disk.corrupt
                else:
                    blk = self.disk.get(bid, session)
                if blk is None:
                    break
                found.append(Found(key, blk, DISK))
                self.counters["hits_disk"] += 1
                self.counters["bytes_fetched_disk"] += blk.size
                if promote:
                    events.extend(self._promote(bid, blk, session))
            self.counters["misses"] += len(keys) - len(found)
            self.counters["gets"] += 1
            self._emit(events)
        self.counters["get_us_total"] += int((time.perf_counter() - t0) * 1e6)
        return found

    def _promote(self, bid: BlockId, blk: StoredBlock, session: str) -> list[StoreEvent]:
        promoted = StoredBlock(size=blk.size, data=blk.data, checksum=blk.checksum, parent=blk.parent,
                               token_ids=blk.token_ids, block_size=blk.block_size, depth=blk.depth,
                               session=session)
        try:
            victims = self.ram.make_room(promoted.size, allow_evict=self.evict_on_full)
        except CapacityError:
            return []
        events = self._demote(victims)
        self.ram.add(bid, promoted)
        self.counters["blocks_promoted"] += 1
        events.append(StoreEvent("stored", bid[0], [bid[1]], CPU, blk.parent, list(blk.token_ids),
                                 blk.block_size))
        return events

    # -- delete / stats -------------------------------------------------------------------------

    def delete(self, namespace: str, keys: Sequence[int]) -> int:
        with self._lock:
            deleted = 0
            events: list[StoreEvent] = []
            for key in keys:
                bid = (namespace, key)
                hit = False
                if self.ram.remove(bid) is not None:
                    events.append(StoreEvent("removed", namespace, [key], CPU))
                    hit = True
                if self.disk is not None and bid in self.disk:
                    self.disk.remove(bid)
                    events.append(StoreEvent("removed", namespace, [key], DISK))
                    hit = True
                deleted += hit
            self.counters["blocks_deleted"] += deleted
            self._emit(events)
            return deleted

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter kept by the service around the store (e.g. which put path ran)."""
        with self._lock:
            self.counters[name] += n

    def stats(self) -> dict[str, object]:
        with self._lock:
            disk = self.disk
            return {
                "ram_bytes": self.ram.used, "ram_capacity_bytes": self.ram.capacity, "ram_blocks": len(self.ram),
                "disk_bytes": disk.used if disk is not None else 0,
                "disk_capacity_bytes": disk.capacity if disk is not None else 0,
                "disk_blocks": len(disk) if disk is not None else 0,
                "eviction_policy": self.policy_name,
                "counters": dict(self.counters),
            }
