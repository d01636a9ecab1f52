"""A thin wrapper over Mooncake's ``MooncakeDistributedStore``: setup, object keys, error codes.

Why it exists: both sides of a pooled offload store (the offload service, which owns
the index, and the workers, which move the bytes) talk to Mooncake the same way; this
is the one place that imports Mooncake (so the package stays optional), names objects
and turns Mooncake's negative return codes into messages.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# Mooncake's error codes (mooncake-store/include/types.h) that callers here act on.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
BUFFER_OVERFLOW = -600
_NAMES = {-600: "buffer too small", -704: "object not found", -706: "object leased by a reader",
          -707: "lease expired during the transfer", -200: "no space left in the pool",
          -1000: "master unreachable"}

MIN_SEGMENT = 16 << 20   # Mooncake refuses smaller segments and local buffers

INSTALL_HINT = "install it with `make install-mooncake` (pip install 'kvmesh[mooncake]' plus apt libibverbs1 " \
               "ibverbs-providers)"


class PoolError(Exception):
    """Mooncake refused or failed an operation (the message names the code)."""


def describe(code: int) -> str:
    return f"{_NAMES.get(code, 'mooncake error')} ({code})"


@dataclass
class PoolConfig:
    master: str = field(default="", metadata={"help": "mooncake_master host:port (empty = no pool)"})
    local_hostname: str = field(default="127.0.0.1", metadata={
        "help": "this process's address in the pool (other members connect to it)"})
    metadata_server: str = field(default="P2PHANDSHAKE", metadata={
        "help": "Mooncake metadata server (P2PHANDSHAKE = none: peers exchange it directly)"})
    segment_bytes: int = field(default=-1, metadata={
        "help": "memory this process lends to the pool (>= 16 MiB; 0 = none: it only reads and writes; -1 = "
                "auto: the offload service lends its RAM budget plus Mooncake's eviction headroom, a worker none)"})
    buffer_bytes: int = field(default=64 << 20, metadata={
        "help": "local transfer buffer Mooncake stages its bytes API through (>= 16 MiB)"})
    protocol: str = field(default="tcp", metadata={"help": "tcp | rdma"})
    rdma_devices: str = field(default="", metadata={"help": "RDMA devices (protocol rdma), e.g. mlx5_0"})


def object_key(prefix: str, namespace: str, key: int) -> str:
    """The pool object holding block ``key`` of ``namespace`` (namespaces may hold any character)."""
    return f"{prefix}{hashlib.sha256(namespace.encode()).hexdigest()[:20]}/{key:016x}"


def load_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise PoolError(f"Mooncake Store is not installed ({exc}); {INSTALL_HINT}") from None
    return MooncakeDistributedStore


def buffer_address(buf: object) -> tuple[int, int]:
    """(address, bytes) of a writable C-contiguous buffer (numpy array, bytearray, memoryview, torch tensor)."""
    import numpy as np

    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):   # torch.Tensor, without importing torch
        if not buf.is_contiguous():  # type: ignore[attr-defined]
            raise ValueError("tensor must be contiguous")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())  # type: ignore[attr-defined]
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)  # type: ignore[arg-type]
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return int(arr.ctypes.data), int(arr.nbytes)


class Pool:
    """One Mooncake client of this process (setup once, closed once); thread-safe as Mooncake's is."""

    def __init__(self, cfg: PoolConfig) -> None:
        if not cfg.master:
            raise PoolError("no mooncake master address")
        if cfg.segment_bytes == -1:
            cfg = replace(cfg, segment_bytes=0)
        for name in ("segment_bytes", "buffer_bytes"):
            n = getattr(cfg, name)
            if n != 0 and not MIN_SEGMENT <= n:
                raise PoolError(f"mooncake {name} must be 0 or at least {MIN_SEGMENT} (Mooncake's minimum), got {n}")
        cls = load_store_class()
        self.cfg = cfg
        self._store = cls()
        rc = self._store.setup(cfg.local_hostname, cfg.metadata_server, cfg.segment_bytes, cfg.buffer_bytes,
                               cfg.protocol, cfg.rdma_devices, cfg.master)
        if rc != 0:
            raise PoolError(f"cannot join the Mooncake pool at {cfg.master}: setup returned {rc} "
                            "(is mooncake_master running and reachable?)")
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []
        self.closed = False

    # -- memory ----------------------------------------------------------------------------

    def register(self, buf: object) -> tuple[int, int]:
        """Register ``buf`` for zero-copy transfers; return its (address, size)."""
        addr, size = buffer_address(buf)
        with self._lock:
            if not self.is_registered(addr, size):
                rc = self._store.register_buffer(addr, size)
                if rc != 0:
                    raise PoolError(f"register_buffer failed: {describe(rc)}")
                self._registered.append((addr, size))
        return addr, size

    def unregister(self, addr: int) -> None:
        with self._lock:
            for i, (a, _) in enumerate(self._registered):
                if a == addr:
                    self._store.unregister_buffer(addr)
                    del self._registered[i]
                    return

    def is_registered(self, addr: int, size: int) -> bool:
        return any(a <= addr and addr + size <= a + n for a, n in self._registered)

    # -- objects ---------------------------------------------------------------------------

    def put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return list(self._store.batch_put_from(list(keys), list(addrs), list(sizes)))

    def get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return list(self._store.batch_get_into(list(keys), list(addrs), list(sizes)))

    def exists(self, keys: Sequence[str]) -> list[int]:
        return list(self._store.batch_is_exist(list(keys))) if keys else []

    def remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """Remove objects; a lease keeps one (OBJECT_HAS_LEASE: try again later) unless ``force``."""
        return list(self._store.batch_remove(list(keys), force)) if keys else []

    def remove_prefix(self, prefix: str) -> int:
        import re

        return int(self._store.remove_by_regex("^" + re.escape(prefix)))

    def put_bytes(self, key: str, data: bytes) -> int:
        return int(self._store.put(key, data))

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for addr, _ in self._registered:
                self._store.unregister_buffer(addr)
            self._registered.clear()
        self._store.close()
