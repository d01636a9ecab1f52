"""Keep a long-running Python service's native heap from creeping up (glibc malloc).

Why: under a soak the sim workers' RSS rose 2-3 MiB/min while their Python objects did
not. Two native causes, both glibc's: every thread that allocates may get its own malloc
arena (up to 8 per core), and freed memory inside an arena is kept for reuse rather than
returned to the OS, so RSS follows the peak of every arena at once and fragmentation
ratchets it up. gRPC's and ZMQ's I/O threads and ``asyncio.to_thread`` workers all
allocate. Capping the arenas (``mallopt(M_ARENA_MAX)``, what ``MALLOC_ARENA_MAX`` does)
and trimming now and then (``malloc_trim(0)``) bounds that. Both are no-ops off glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8   # glibc malloc.h


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def limit_arenas(n: int) -> bool:
    """At most ``n`` malloc arenas from now on (0 = leave glibc's default); False off glibc."""
    if n <= 0:
        return False
    libc = _libc()
    try:
        return bool(libc is not None and libc.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(n)))
    except AttributeError:
        return False


def malloc_trim() -> bool:
    """Give free heap memory back to the OS (``malloc_trim(0)``); False off glibc or when nothing was freed."""
    libc = _libc()
    try:
        return bool(libc is not None and libc.malloc_trim(0))
    except AttributeError:
        return False


async def trim_every(period_s: float) -> None:
    """Trim every ``period_s`` seconds until cancelled (in a thread: it walks every arena)."""
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(malloc_trim)
