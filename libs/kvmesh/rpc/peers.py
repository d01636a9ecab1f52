"""The host a gRPC call or socket came from, in one spelling per host.

Why: without mTLS the only fact a server has about a caller is its address, and
services use it to bind state to a caller (offload leases, who registered an
endpoint). ``context.peer()`` spells the same host several ways (``ipv4:``,
``ipv6:[::ffff:a.b.c.d]``, every loopback address), so they are normalised:
all loopback addresses are one host, v4-mapped v6 is v4, and unix sockets are
"local".
"""

from __future__ import annotations

import ipaddress

LOOPBACK = "loopback"
LOCAL = "local"


def normalize_host(host: str) -> str:
    """One spelling per host: loopback addresses are all one host, v4-mapped v6 is v4."""
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return LOOPBACK if ip.is_loopback else str(ip)


def peer_host(peer: str) -> str:
    """The host of a gRPC ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:...``)."""
    if peer.startswith("unix"):
        return LOCAL
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            rest = peer[len(prefix):]
            host = rest.rsplit(":", 1)[0] if ":" in rest else rest
            return normalize_host(host)
    return peer
