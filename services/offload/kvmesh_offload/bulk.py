"""Bulk data plane: leased blocks streamed over plain TCP, for clients on other hosts.

Why: Python gRPC moves a large message through several user-space copies and
HTTP/2 framing, which caps a Get stream well below what the link and memory can
do. Here the client first calls ``GetBulk`` (gRPC: validation, lookup, a lease
on the blocks, their sizes and checksums), then reads the bytes over a raw TCP
connection, where the store ``sendall``s straight from its slab memory and the
client ``recv_into``s straight into its destination buffer (the kernel's copies
only). A transfer needs a live lease id, which only ``GetBulk`` hands out; the
port carries nothing else. A lease is a random 128-bit token that only
the host which took it can redeem (``kvmesh_offload.leases``). Wire format: see ``BulkGetResponse`` in offload.proto.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from kvmesh.kvstore.block import buffer_of
from kvmesh.kvstore.bulk import ANSWER, MAGIC, NO_LEASE, REQUEST, SOCKET_BUFFER_BYTES
from kvmesh_offload.store import Found

log = logging.getLogger(__name__)


class BulkServer:
    """Accept loop plus one thread per connection (few, long-lived: one per client process)."""

    def __init__(self, host: str, port: int, take_lease: Callable[[bytes, str], list[Found] | None],
                 idle_timeout_s: float = 300.0) -> None:
        self._take = take_lease
        self._idle = idle_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="offload-bulk-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            conn.settimeout(self._idle)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, str(addr[0])), name="offload-bulk-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer_host: str) -> None:
        try:
            while not self._closed.is_set():
                head = _recv_exact(conn, REQUEST.size)
                if head is None:
                    return
                magic, lease = REQUEST.unpack(head)
                if magic != MAGIC:
                    log.warning("bulk connection sent a bad header; closing")
                    return
                found = self._take(lease, peer_host)  # only the host the lease was given to
                if found is None:
                    conn.sendall(ANSWER.pack(NO_LEASE))
                    continue
                conn.sendall(ANSWER.pack(sum(len(buffer_of(f.block.data)) for f in found)))
                for f in found:
                    conn.sendall(buffer_of(f.block.data))
                del found  # the lease ends here: slots may be reused
        except OSError as exc:
            log.debug("bulk connection ended", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close alone would not
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()



def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)
