"""How far behind schedule the router's own event loop runs, so a lookup deadline charges
the indexer only for time the router was ready to read its answer.

Why: under a soak on a loaded 2-core machine, the router's indexer lookups missed their
0.25 s deadline for most requests while the indexer answered each in ~40 ms (its handler
time, measured). The time went to the router's own event loop: with hundreds of streams,
every loop iteration runs many callbacks, and an answer that has arrived still needs
several iterations (gRPC completion, the call's task, the waiter) before the router sees
it. The deadline's timer fired first, and the request was routed from the local view or
``approx`` although the index had answered in time. A deadline measured on the wall clock
of a saturated loop measures the loop, not the indexer.

``LoopLag`` wakes every ``period_s`` and adds up how late each wake-up was: the time the
loop was behind schedule. ``behind()`` is that sum so far (including a wake-up overdue
right now). A lookup that started when ``behind()`` was ``b0`` and times out is granted
``behind() - b0`` more seconds (capped): the time its answer could not have been read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from kvmesh_router.metrics import LOOP_LAG


class LoopLag:
    def __init__(self, period_s: float = 0.02, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self._clock = clock
        self._behind = 0.0
        self._due: float | None = None
        self._task: asyncio.Task | None = None

    def behind(self) -> float:
        """Seconds the loop has been behind schedule since ``start`` (an overdue wake-up counted)."""
        overdue = 0.0 if self._due is None else max(0.0, self._clock() - self._due)
        return self._behind + overdue

    def woke(self, due: float, now: float) -> float:
        """Record a wake-up planned for ``due`` that ran at ``now``; returns its lateness."""
        late = max(0.0, now - due)
        self._behind += late
        return late

    def start(self) -> None:
        if self._task is None and self.period_s > 0:
            self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._due = None

    async def _run(self) -> None:
        while True:
            self._due = self._clock() + self.period_s
            await asyncio.sleep(self.period_s)
            due, self._due = self._due, None
            LOOP_LAG.observe(self.woke(due, self._clock()))


async def wait_answer(call: asyncio.Future, timeout_s: float, lag: LoopLag | None, max_grace_s: float,
                      arrived: Callable[[], bool] | None = None) -> tuple[bool, float]:
    """Wait for ``call`` up to ``timeout_s`` plus the time the loop was behind meanwhile
    (at most ``max_grace_s`` more). Returns (answered, grace used); ``call`` is never cancelled here.

    ``arrived`` tells, at the deadline, whether the answer is in although ``call`` is not done
    yet (it arrived on another thread and the loop has not run its callback): it counts."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    b0 = lag.behind() if lag is not None else 0.0
    deadline = t0 + timeout_s
    grace = 0.0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(call)
            return True, grace
        except TimeoutError:
            if call.done() or (arrived is not None and arrived()):
                return True, grace
            if lag is None or max_grace_s <= 0:
                return False, grace
            owed = min(lag.behind() - b0, max_grace_s)
            nxt = t0 + timeout_s + owed
            if nxt <= loop.time() + 1e-3:
                return False, grace
            grace, deadline = owed, nxt
