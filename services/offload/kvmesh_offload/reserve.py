"""Reservations of shared-slab slots for zero-copy same-host puts (ReservePut/CommitPut).

Why: a PutShm copies every byte twice (client into its segment, store into its
slab) and checksums it on both sides, so a put ran at a third of a shm get. With
a reservation the client writes each block straight into the slot the store will
keep and sends the checksums it computed on the written bytes; the store checks
nothing it would have to read again. The slabs are 0600 files of the store's user,
so only a client that could already map them (the get path does) can write there.

A reservation holds its slots until committed, aborted or expired (``ttl_s``); the
bytes reserved at once are capped so clients that reserve and vanish cannot pin
more than ``max_bytes`` of slab memory (the service sets the RAM budget: the most one
put may store, so no put is too big for a reservation of its own).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from kvmesh_api.offload.v1 import offload_pb2
from kvmesh_offload.arena import Arena, Slot


class ReserveError(Exception):
    """The reservation cannot be made now; the client falls back to PutShm."""


@dataclass
class Reservation:
    header: offload_pb2.PutHeader
    keys: list[int]
    slots: list[Slot]
    nbytes: int
    deadline: float
    caller: object


class ReservationTable:
    def __init__(self, arena: Arena, max_bytes: int, ttl_s: float = 30.0) -> None:
        self.arena = arena
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.reserved_bytes = 0
        self._lock = threading.Lock()
        self._table: dict[bytes, Reservation] = {}

    def reserve(self, header: offload_pb2.PutHeader, keys: list[int], sizes: list[int],
                caller: object) -> tuple[bytes, list[tuple[str, int]]]:
        """Slots for every block in shared slabs, or ReserveError (then nothing is held)."""
        self.sweep()
        total = sum(sizes)
        with self._lock:
            if self.reserved_bytes + total > self.max_bytes:
                raise ReserveError(f"{self.reserved_bytes} bytes already reserved; {total} more exceed "
                                   f"{self.max_bytes}")
            self.reserved_bytes += total
        slots: list[Slot] = []
        locs: list[tuple[str, int]] = []
        try:
            for size in sizes:
                slot = self.arena.alloc(size)
                loc = slot.location() if slot is not None else None
                if slot is None or loc is None:
                    raise ReserveError("no shared slab slot for a block of this size (small block, "
                                       "private memory or the slab budget is used)")
                slots.append(slot)
                locs.append(loc)
        except BaseException:
            with self._lock:
                self.reserved_bytes -= total
            raise
        token = secrets.token_bytes(16)
        with self._lock:
            self._table[token] = Reservation(header, keys, slots, total, time.monotonic() + self.ttl_s, caller)
        return token, locs

    def take(self, token: bytes, caller: object) -> Reservation | None:
        """The reservation (ending it), or None when unknown, expired or made by another caller."""
        self.sweep()
        with self._lock:
            res = self._table.get(token)
            if res is None or res.caller != caller:
                return None
            del self._table[token]
            self.reserved_bytes -= res.nbytes
        return res

    def sweep(self) -> int:
        """Drop expired reservations (their slots go back to the free list)."""
        now = time.monotonic()
        with self._lock:
            dead = [t for t, r in self._table.items() if r.deadline < now]
            for t in dead:
                self.reserved_bytes -= self._table.pop(t).nbytes
        return len(dead)

    def __len__(self) -> int:
        return len(self._table)
