"""Client side and wire constants of the offload store's bulk TCP data plane.

Why: a Python gRPC stream costs several user-space copies per byte and caps a
Get well below memory speed. For a client on another host the store instead
leases the blocks (``GetBulk``, over gRPC) and the client reads them over a
plain TCP connection, ``recv_into`` its destination buffers: only the kernel
copies. The server side lives in ``kvmesh_offload.bulk``.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence

from kvmesh.kvstore.checksum import block_checksum

MAGIC = b"KVB2"
REQUEST = struct.Struct("<4s16s")   # magic, 128-bit lease token
ANSWER = struct.Struct("<Q")        # total bytes that follow, or NO_LEASE
NO_LEASE = (1 << 64) - 1
SOCKET_BUFFER_BYTES = 8 << 20


class BulkLeaseExpired(Exception):
    """The store no longer holds the lease (expired or already used)."""


class BulkUnreachable(Exception):
    """The store's bulk port cannot be reached from here."""


class BulkChecksumMismatch(Exception):
    """A received block's checksum (XXH3-64) is not the one the store announced."""

    def __init__(self, index: int) -> None:
        super().__init__(f"block {index}: checksum mismatch")
        self.index = index


class BulkConnections:
    """Idle connections to store bulk ports, reused across transfers (one per concurrent transfer)."""

    def __init__(self, max_idle: int = 4) -> None:
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._max_idle = max_idle

    def _acquire(self, host: str, port: int, timeout_s: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get((host, port))
            if idle:
                return idle.pop()
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Large transfers: a deep receive buffer keeps the sender streaming (the kernel caps it).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        return sock

    def _release(self, host: str, port: int, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()

    def connect(self, host: str, port: int, timeout_s: float) -> socket.socket:
        """A connection (raises OSError if the port cannot be reached)."""
        return self._acquire(host, port, timeout_s)

    def transfer(self, sock: socket.socket, host: str, port: int, lease: bytes, dests: list[memoryview],
                 timeout_s: float) -> None:
        """Read the leased blocks into ``dests`` (exact sizes) over ``sock``; the socket goes back
        to the pool on success and is closed on any error."""
        ok = False
        try:
            sock.settimeout(timeout_s)
            sock.sendall(REQUEST.pack(MAGIC, lease))
            head = bytearray(ANSWER.size)
            _recv_into_exact(sock, memoryview(head))
            (total,) = ANSWER.unpack(head)
            if total == NO_LEASE:
                ok = True  # the connection is still in step
                raise BulkLeaseExpired(f"bulk lease {lease[:4].hex()}... is unknown or expired")
            want = sum(len(d) for d in dests)
            if total != want:
                raise OSError(f"bulk transfer announces {total} bytes, expected {want}")
            for d in dests:
                _recv_into_exact(sock, d)
            ok = True
        finally:
            if ok:
                self._release(host, port, sock)
            else:
                sock.close()

    def receive(self, host: str, port: int, lease: bytes, dests: list[memoryview], timeout_s: float,
                checksums: Sequence[int] | None = None) -> None:
        """Blocking: read the leased blocks into ``dests`` over a (reused) connection, and check
        them against ``checksums`` (0 = unknown) when given. Raises ``BulkUnreachable``,
        ``BulkLeaseExpired``, ``BulkChecksumMismatch``, or OSError when the transfer breaks."""
        try:
            sock = self.connect(host, port, timeout_s)
        except OSError as exc:
            raise BulkUnreachable(str(exc)) from exc
        self.transfer(sock, host, port, lease, dests, timeout_s)
        if checksums is not None:
            for i, d in enumerate(dests):
                if checksums[i] and block_checksum(d) != checksums[i]:
                    raise BulkChecksumMismatch(i)

    def close(self) -> None:
        with self._lock:
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle = {}
        for s in socks:
            s.close()


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 16 << 20))
        if k == 0:
            raise ConnectionError("store closed the bulk connection mid-transfer")
        got += k


def host_of(address: str) -> str | None:
    """The host part of a gRPC target, or None where there is no TCP host (unix sockets)."""
    if address.startswith("unix:"):
        return None
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"
