"""Shared-memory segments for the same-host fast path between a client and the store.

Moving KV over gRPC costs several copies and protobuf framing per chunk; when the
client and the store share a host, the client instead hands the store the name of
a POSIX shared-memory segment (``/dev/shm/<name>``) and the store copies straight
from or into it. We map the files ourselves rather than use
``multiprocessing.shared_memory`` because its resource tracker unlinks segments
that the *attaching* process (the store) merely opened, breaking the owner.

Only names starting with ``kvmesh-`` and free of path separators are accepted,
so a client cannot make the store open arbitrary files.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
import weakref
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "kvmesh-"
_NAME_RE = re.compile(r"^kvmesh-[A-Za-z0-9_.\-]{1,200}$")


class ShmError(Exception):
    """A segment cannot be created, opened or is too small."""


def shm_available() -> bool:
    """True where POSIX shared memory is usable (Linux ``/dev/shm``)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise ShmError(f"bad shared-memory segment name {name!r} (must match {_NAME_RE.pattern})")
    return name


class Segment:
    """One mapped shared-memory segment; the creator owns (and unlinks) it."""

    def __init__(self, name: str, size: int, *, create: bool, readonly: bool = False,
                 populate: bool = False) -> None:
        self.name = validate_name(name)
        self.path = SHM_DIR / name
        self.owner = create
        readonly = readonly and not create
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} not found on this host") from None
        except OSError as exc:
            raise ShmError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
        try:
            if create:
                # Reserve the pages now: writing into a sparse tmpfs file that the
                # host cannot back raises SIGBUS in whichever process touches it
                # (possibly the store); fallocate fails cleanly with ENOSPC instead.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.close(fd)
                    fd = -1
                    self.path.unlink(missing_ok=True)
                    raise ShmError(f"cannot reserve {size} bytes of shared memory: {exc}") from exc
            st = os.fstat(fd)
            self.file_id = (st.st_dev, st.st_ino)
            actual = st.st_size
            if actual < size or actual == 0:
                raise ShmError(f"segment {name!r} has {actual} bytes, need {size}")
            self.size = actual
            # populate: map every page now (MAP_POPULATE), in one pass, instead of one page
            # fault per 4 KiB on first touch (writes to a shared mapping get no fault-around):
            # 3-5x cheaper here, and the cost lands at map time, not in the first transfer.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self.mm = mmap.mmap(fd, actual, flags=flags, prot=prot)
        finally:
            if fd >= 0:
                os.close(fd)
        self.buf = memoryview(self.mm)
        # An owner that exits without close() (or is collected) still unlinks its file;
        # only a killed process leaves one behind, for prune_stale() to find.
        self._unlink_at_exit = weakref.finalize(self, _unlink, str(self.path)) if create else None

    @classmethod
    def create(cls, size: int, prefix: str = NAME_PREFIX, populate: bool = False) -> Segment:
        return cls(f"{prefix}{os.getpid()}-{secrets.token_hex(6)}", max(size, mmap.PAGESIZE), create=True,
                   populate=populate)

    @classmethod
    def attach(cls, name: str, min_size: int = 0, readonly: bool = False, populate: bool = False) -> Segment:
        return cls(name, min_size, create=False, readonly=readonly, populate=populate)

    def close(self) -> None:
        try:
            self.buf.release()
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a caller still holds a view; the mapping dies with the process
        if self.owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            if self._unlink_at_exit is not None:
                self._unlink_at_exit.detach()

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SegmentPool:
    """Reusable client-side segments: a hot segment avoids page faults on every call.

    Each in-flight call takes its own segment so concurrent calls never share bytes.
    """

    def __init__(self, max_idle: int = 4) -> None:
        _prune_once()
        self._idle: list[Segment] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle
        self._closed = False

    def acquire(self, size: int) -> Segment:
        with self._lock:
            for i, seg in enumerate(self._idle):
                if seg.size >= size:
                    return self._idle.pop(i)
            # Drop the biggest-too-small one so the pool does not hoard stale sizes.
            if self._idle:
                self._idle.pop().close()
        return Segment.create(_round_up(size))

    def release(self, seg: Segment) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(seg)
                return
        seg.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for seg in idle:
            seg.close()


def _round_up(size: int, quantum: int = 1 << 20) -> int:
    return max(quantum, (size + quantum - 1) // quantum * quantum)


class AttachCache:
    """Store-side cache of mapped client segments.

    Clients reuse pooled segments, so keeping their mappings saves re-faulting
    every page table entry on each call (for 1 GiB that is ~260k minor faults).
    A cached mapping is dropped when its file is gone or was replaced.

    ``get`` holds the mapping for its caller until ``release``: a mapping evicted (more
    than ``max_entries`` clients' segments) or replaced meanwhile is closed by its last
    user, never under one. Closing it at eviction while another call still copied into
    it failed that call ("operation forbidden on released memoryview object"): 76 restores
    and puts of a 30-minute soak with six workers' segment pools cycling through 8 entries.
    """

    def __init__(self, max_entries: int = 8, readonly: bool = False) -> None:
        self._max = max_entries
        self._readonly = readonly
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[int, Segment]] = {}
        self._users: dict[Segment, int] = {}      # segments handed out and not released yet
        self._retired: set[Segment] = set()       # dropped from the cache while in use

    def get(self, name: str) -> Segment:
        """The mapping of ``name``; the caller must ``release`` it."""
        validate_name(name)
        self.prune()
        try:
            st = os.stat(SHM_DIR / name)
        except FileNotFoundError:
            self._drop(name)
            raise ShmError(f"shared-memory segment {name!r} not found on this host") from None
        with self._lock:
            hit = self._maps.pop(name, None)
            if hit is not None and hit[0] == st.st_ino and hit[1].size == st.st_size:
                self._maps[name] = hit  # most recent last
                self._users[hit[1]] = self._users.get(hit[1], 0) + 1
                return hit[1]
        if hit is not None:
            self._retire(hit[1])
        seg = Segment.attach(name, readonly=self._readonly)
        dropped: list[Segment] = []
        with self._lock:
            prev = self._maps.pop(name, None)   # another call attached it meanwhile
            if prev is not None:
                dropped.append(prev[1])
            self._maps[name] = (st.st_ino, seg)
            self._users[seg] = 1
            while len(self._maps) > self._max:
                dropped.append(self._maps.pop(next(iter(self._maps)))[1])
        for old in dropped:
            self._retire(old)
        return seg

    def release(self, seg: Segment) -> None:
        """The caller is done with ``seg`` (from ``get``)."""
        with self._lock:
            n = self._users.get(seg, 0) - 1
            if n > 0:
                self._users[seg] = n
                return
            self._users.pop(seg, None)
            if seg not in self._retired:
                return
            self._retired.discard(seg)
        seg.close()

    def _retire(self, seg: Segment) -> None:
        """Out of the cache: closed now, or by its last user."""
        with self._lock:
            if self._users.get(seg, 0) > 0:
                self._retired.add(seg)
                return
        seg.close()

    def _drop(self, name: str) -> None:
        with self._lock:
            hit = self._maps.pop(name, None)
        if hit is not None:
            self._retire(hit[1])

    def prune(self) -> None:
        """Unmap segments whose files were unlinked (their memory is freed only once unmapped)."""
        with self._lock:
            names = list(self._maps)
        for name in names:
            if not (SHM_DIR / name).exists():
                self._drop(name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            retired, self._retired = self._retired, set()
            self._users.clear()
        for seg in [s for _, s in maps.values()] + list(retired):
            seg.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_pruned = False


def _prune_once() -> None:
    """Client segments of dead processes hold host memory: drop them once per process."""
    global _pruned
    if not _pruned and shm_available():
        _pruned = True
        prune_stale(NAME_PREFIX)


def prune_stale(prefix: str) -> int:
    """Unlink ``<prefix><pid>-*`` segments left by processes that no longer exist
    (a store that was killed cannot unlink its slabs). Returns how many went."""
    gone = 0
    for path in SHM_DIR.glob(f"{prefix}*"):
        pid_part = path.name[len(prefix):].split("-", 1)[0]
        if not pid_part.isdigit() or int(pid_part) == os.getpid():
            continue
        try:
            os.kill(int(pid_part), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            gone += 1
        except PermissionError:
            pass  # alive, another user's
    return gone
