"""Pick a free loopback port that stays free until the process that needs it binds it.

A port handed out by ``bind(0)`` comes from the kernel's ephemeral range, the same range the
kernel draws from for every outgoing connection. A child process that binds the port seconds
later (vLLM takes ~20 s to import) can then find it taken by some unrelated client socket:
CI lost a whole vLLM test module to exactly that. Ports below the ephemeral range are never
assigned implicitly, so once we checked one is free, only another explicit picker can take it;
the random start makes two pickers colliding unlikely, and the bind check catches the rest.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this sit well-known and registered service ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for implicitly assigned ports (Linux default 32768-60999)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on ``host`` that is free now and outside the ephemeral range when possible."""
    lo, _ = ephemeral_range()
    rng = rng or random.Random()
    if lo - _LOWEST >= 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST, lo)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: let the kernel choose
        s.bind((host, 0))
        return int(s.getsockname()[1])
