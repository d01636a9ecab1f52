"""Slab memory for large KV blocks, and glibc allocator tuning for big buffers.

Why: on virtualised hosts a page fault or TLB miss is expensive. A fresh
``bytes`` per multi-MiB block costs a page fault per 4 KiB (first touch) and
then 4 KiB-page TLB misses on every copy. Blocks of one size are instead carved
from large NumPy slabs (NumPy asks the kernel for transparent huge pages on big
allocations) and slots are reused, so a warm store copies at close to memcpy
speed.

With ``shared=True`` the slabs are POSIX shared-memory segments
(``/dev/shm/kvmesh-slab-<pid>-*``): a client on the same host maps them
read-only and copies a block straight into its destination (one copy, no
intermediate buffer); ``Slot.location()`` names the segment and offset.

Slot lifetime follows Python reference counting: a ``Slot`` returns itself to
the free list in ``__del__``, i.e. only once the store *and* every in-flight
reader (a Get streaming it, a shm copy) have dropped it. Readers therefore never
see a slot reused under them, with no explicit pinning protocol.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections import deque

import numpy as np

from kvmesh.kvstore.shm import Segment, ShmError, prune_stale

log = logging.getLogger(__name__)

MIN_SLAB_BYTES = 32 * 1024 * 1024
SLAB_PREFIX = "kvmesh-slab-"


class Slot:
    """One block's memory; ``view`` is writable until handed to the store."""

    __slots__ = ("_cls", "_idx", "view", "__weakref__")

    def __init__(self, cls: _SizeClass, idx: int, view: memoryview) -> None:
        self._cls = cls
        self._idx = idx
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __del__(self) -> None:
        self._cls.free.append(self._idx)

    def location(self) -> tuple[str, int] | None:
        """(shared segment name, byte offset) of this slot, or None for private memory."""
        return self._cls.location(self._idx)


class _SizeClass:
    def __init__(self, size: int, slab_bytes: int, shared: bool = False) -> None:
        self.size = size
        self.per_slab = max(1, slab_bytes // size)
        self.slabs: list[memoryview] = []
        self.segments: list[Segment] = []
        self.shared = shared
        self.free: deque[int] = deque()

    def grow(self) -> int:
        nbytes = self.per_slab * self.size
        arr = None
        if self.shared:
            try:
                seg = Segment.create(nbytes, prefix=SLAB_PREFIX)
                self.segments.append(seg)
                arr = np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes)
            except ShmError as exc:  # /dev/shm full: private memory, served by copy
                log.warning("shared slab unavailable, using private memory", extra={"reason": str(exc)})
                self.shared = False
        if arr is None:
            arr = np.empty(nbytes, dtype=np.uint8)
        base = len(self.slabs) * self.per_slab
        self.slabs.append(memoryview(arr))
        self.free.extend(range(base, base + self.per_slab))
        return self.per_slab * self.size

    def view(self, idx: int) -> memoryview:
        slab, i = divmod(idx, self.per_slab)
        return self.slabs[slab][i * self.size:(i + 1) * self.size]

    def location(self, idx: int) -> tuple[str, int] | None:
        slab, i = divmod(idx, self.per_slab)
        if slab >= len(self.segments):
            return None  # slabs after a shm failure are private (segments are always the first ones)
        return self.segments[slab].name, i * self.size


class Arena:
    """Size-classed slab allocator for blocks of ``min_block`` bytes or more.

    ``limit_bytes`` caps the slabs ever allocated; past it ``alloc`` returns None
    and the caller keeps a plain ``bytes`` copy instead.
    """

    def __init__(self, limit_bytes: int, min_block: int = 256 * 1024, slab_bytes: int = MIN_SLAB_BYTES,
                 shared: bool = False) -> None:
        self.limit = limit_bytes
        self.shared = shared
        if shared:
            prune_stale(SLAB_PREFIX)
        self.min_block = min_block
        self.slab_bytes = slab_bytes
        self.allocated = 0
        self._classes: dict[int, _SizeClass] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> Slot | None:
        if size < self.min_block:
            return None
        with self._lock:
            cls = self._classes.get(size)
            if cls is None:
                cls = self._classes[size] = _SizeClass(size, max(self.slab_bytes, size), self.shared)
            if not cls.free:
                need = cls.per_slab * size
                if self.allocated + need > self.limit:
                    return None
                self.allocated += cls.grow()
            idx = cls.free.popleft()
            return Slot(cls, idx, cls.view(idx))

    def slab_ids(self) -> set[tuple[int, int]]:
        """(st_dev, st_ino) of every shared slab file, to recognise them under any name."""
        with self._lock:
            classes = list(self._classes.values())
        ids = set()
        for cls in classes:
            for seg in cls.segments:
                ids.add(seg.file_id)
        return ids

    def close(self) -> None:
        """Unlink the shared slabs (their memory goes once every mapping is gone)."""
        with self._lock:
            classes = list(self._classes.values())
        for cls in classes:
            for seg in cls.segments:
                seg.path.unlink(missing_ok=True)

    def copy_in(self, data: bytes | memoryview) -> bytes | memoryview | Slot:
        """``data`` in arena memory when it qualifies (a Slot), else unchanged."""
        slot = self.alloc(len(data))
        if slot is None:
            return data
        slot.view[:] = data
        return slot


_tuned = False


def tune_malloc(mmap_threshold: int = 32 * 1024 * 1024, trim_threshold: int = (1 << 31) - 1,
                top_pad: int = 64 * 1024 * 1024) -> bool:
    """Make glibc keep freed big buffers for reuse instead of unmapping them.

    By default every multi-MiB ``bytes`` (gRPC messages, protobuf fields) is a
    fresh ``mmap``, paying a page fault per 4 KiB on first touch. Raising the
    mmap and trim thresholds lets such buffers be recycled warm. No-op off glibc.
    """
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc malloc.h; values are C ints
        ok = all(libc.mallopt(opt, ctypes.c_int(val)) for opt, val in (
            (m_mmap_threshold, mmap_threshold), (m_trim_threshold, trim_threshold), (m_top_pad, top_pad)))
    except (OSError, AttributeError):
        return False
    _tuned = ok
    log.debug("malloc tuned", extra={"ok": ok})
    return ok


def malloc_trim() -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim(0)``); False off glibc.

    ``tune_malloc`` keeps freed big buffers for reuse, which is what makes a warm store
    fast, but it also means an evicted block's memory stays in the process: RSS follows the
    peak of what was ever stored, not the RAM tier. Trimming now and then bounds it by the
    tier plus what is in flight, at the cost of a few page faults on the next big buffers.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False
