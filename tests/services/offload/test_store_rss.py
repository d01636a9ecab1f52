"""The store's RSS stays bounded while it evicts: six times its RAM tier churned through it.

The store keeps freed big buffers for speed (``tune_malloc``) and gives freed heap memory back
every ``--malloc-trim-s``. In issue 21's replay a store without trimming held 745-1,014 MiB for
a 256 MiB tier. This test guards the outcome (RSS flat between 3x and 6x the tier, at the tier
plus a bounded overhead), not trimming alone: with equal 1 MiB blocks glibc reuses the freed
chunks, and the same churn without trimming measured 140-148 MiB here against 131-136 MiB with
it. The bound leaves room for a loaded CI machine, where one run measured 174 MiB.

"Flat" is judged against what the second round moves (3x the tier, 192 MiB): a store that kept
evicted blocks would grow by about that much, so growth above a quarter of it fails. A fixed
24 MiB margin was too tight for a loaded CI machine, where one run settled at 111 MiB after the
first round (a trim had caught it low) and 136 MiB after the second, both far under the bound.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from kvmesh.kvstore.client_sync import SyncOffloadClient

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
RAM = 64 * MiB


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _settled_rss(pid: int, below: int, samples: int = 8, every_s: float = 0.5, max_s: float = 30.0) -> int:
    """The lowest RSS over a few trim periods: on a loaded machine one trim can run late, and a
    single reading would catch memory the store is about to give back. Sampling goes on (up to
    ``max_s``) while the lowest reading is still above ``below``: on a busy machine the store's
    threads finish freeing and the trims catch up later, and a store that never gets there fails."""
    low = _rss(pid)
    t_end = time.monotonic() + max_s
    n = 0
    while n < samples or (low > below and time.monotonic() < t_end):
        time.sleep(every_s)
        low = min(low, _rss(pid))
        n += 1
    return low


def _churn(address: str, total: int, block: int = MiB, clients: int = 4, key_base: int = 0) -> None:
    """``clients`` threads put and read back blocks at once: the store's gRPC threads each
    allocate in their own malloc arena, which is where freed memory piles up."""
    payload = bytes(block)
    per = total // block // 4 // clients

    def run(c_idx: int) -> None:
        with SyncOffloadClient(address, use_shm=False) as c:
            for i in range(per):
                keys = [key_base + (c_idx * per + i) * 4 + j + 1 for j in range(4)]
                c.put("rss", [(k, payload) for k in keys])
                c.get("rss", keys[:2])

    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        list(ex.map(run, range(clients)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_rss_stays_at_the_ram_tier_plus_a_bounded_overhead(offload_process) -> None:
    store = offload_process("--ram-capacity-bytes", str(RAM), "--malloc-trim-s", "0.5", "--shm-enabled", "false")
    pid = store.proc.pid
    base = _rss(pid)
    churn = 3 * RAM
    _churn(store.grpc_address, churn)
    bound = RAM + 128 * MiB
    first = _settled_rss(pid, base + bound) - base
    _churn(store.grpc_address, churn, key_base=10_000_000)
    flat = first + churn // 4
    second = _settled_rss(pid, base + min(bound, flat)) - base
    print(f"RSS growth over the idle store: {first / MiB:.1f} MiB after 3x the tier, {second / MiB:.1f} MiB after 6x")
    # Flat: the second round's evicted blocks are reused or returned, not kept ...
    assert second <= flat, (first, second)
    # ... at the tier plus a bounded overhead (gRPC message buffers of the puts in flight, per-thread arenas).
    assert second <= bound, (first, second)
