"""Eviction policies for the offload tiers (and the virtual-time cluster simulator).

A policy only orders keys; the tier owns sizes and bytes. Keys are opaque
hashables (the store uses ``(namespace, block_key)``).

Prefix caches only pay off on *leading* hits: losing block 0 of a chain makes
every later block of it useless. Every policy therefore sees each block's depth
in its chain and, among blocks touched by the same request, evicts the deepest
first (vLLM's free queue does the same by freeing a request's blocks tail first).
The owner calls ``new_batch()`` once per request.

- ``lru``: least recently used, the baseline.
- ``agent`` (default): recency in *time*, discounted by depth and credited for
  sharing: ``priority = last_touch_s - depth_cost_s * depth + share_s *
  log2(sharers)``; the lowest priority goes first. A block deep in a long chain
  must be "fresher" than a chain head to stay, so under memory pressure the
  store keeps the heads of many sessions' chains rather than the whole chain of
  the few most recent ones (a returning session hits its head first, and a head
  is cheap). ``sharers`` counts sessions that touched the block (a system prompt
  and tools shared by a main agent and its sub-agents). Chain-safe by
  construction: a parent is touched whenever its child is, is never deeper and
  has at least as many sharers, so it never ranks below its child and the
  policy never leaves a child whose parent was evicted.
- ``greedy-dual``: the earlier agent policy, GreedyDual ``H = L + value`` with a
  sharing bonus (kept for comparison).
- ``session-rate``: LRU on a per-session clock that charges each session its
  typical think time (EWMA of its request gaps).

Each policy is picked by its ``name`` through ``kvmesh.kvstore.eviction_registry``.

Measured on the Claude Code traces with ``kvmesh bench offload-policy`` (see
docs/offload.md for the figures and the variants that did *not* help).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol


class EvictionPolicy(Protocol):
    name: str
    timed: bool   # new_batch(now) takes a clock reading (the trace's or the simulation's time)

    def new_batch(self) -> None:
        """Mark the start of one operation (a request's put or lookup)."""
        ...

    def insert(self, key: Hashable, depth: int = 0, session: str = "") -> None: ...

    def touch(self, key: Hashable, depth: int = 0, session: str = "") -> None: ...

    def insert_many(self, keys: Sequence[Hashable], depths: Sequence[int], session: str = "") -> None:
        """``insert`` each key at its depth, in order (one put's new blocks)."""
        ...

    def touch_many(self, keys: Iterable[Hashable], session: str = "") -> None:
        """``touch`` each held key at the depth it holds, in order (one request's restore)."""
        ...

    def remove(self, key: Hashable) -> None: ...

    def victim(self) -> Hashable | None:
        """The key to evict next (not removed; the tier calls ``remove``)."""
        ...

    def pop_victim(self) -> Hashable | None:
        """``victim`` and ``remove`` of it in one call (a tier making room)."""
        ...

    def pop_victims(self, count: int) -> list[Hashable]:
        """What ``count`` calls of ``pop_victim`` return, in order (fewer if it runs dry)."""
        ...

    def __len__(self) -> int: ...


def _count_sharer(sharers: dict[Hashable, int], last: dict[Hashable, str], key: Hashable, session: str) -> None:
    """Distinct-session count of a block, approximated by "a different session than last time"."""
    if session and session != last.get(key):
        sharers[key] = sharers.get(key, 1) + 1
        last[key] = session


class _LazyHeap:
    """Priority order of ``(priority, -depth, seq, key)`` entries with lazy updates, the core of every policy.

    A key's true entry is its latest push (``_live``); older entries of it are stale and
    are skipped when they surface. Pushes are appended to an open batch, which is sorted
    into a *run* when the next victim is asked for (a batch of a few entries goes into a
    plain heap instead); a heap orders the runs by their smallest entry. The victim is the
    smaller of the plain heap's top and the first run's head, once stale ones are skipped:
    each run is sorted and every other run's entries are no smaller than its head, which is
    no smaller than the first run's head, so the order is exactly that of a heap holding
    every key's true entry.

    Why runs: touches far outnumber evictions (a restore touches a whole chain) and cost
    one append each. Evictions take whole stretches of one run (a put's blocks, deepest
    first), which need no heap operation while the run's next entry stays below the next
    run's head; a plain heap paid a sift of a million-entry heap per victim and per
    re-ranked key. Stale entries are dropped in one pass once they outnumber the live ones.
    """

    timed = False   # see EvictionPolicy.timed

    _SLACK = 1024   # stale entries tolerated on top of one per live key before a cleanup pass
    # A batch this small goes into a plain heap instead of becoming a run: a caller that asks
    # for a victim after every block (the admission replay) would otherwise make a run of each.
    _SMALL_BATCH = 4

    def __init__(self) -> None:
        self._live: dict[Hashable, tuple[float, int, int, Hashable]] = {}
        # Per-key tables a policy keeps beside the heap: a key's entries go with the key.
        self._sides: tuple[dict[Hashable, Any], ...] = ()
        self._open: list[tuple[float, int, int, Hashable]] = []
        self._small: list[tuple[float, int, int, Hashable]] = []   # a plain heap of entries from tiny batches
        # (head entry, run number, run sorted descending: its head is run[-1])
        self._runs: list[tuple[tuple[float, int, int, Hashable], int, list[tuple[float, int, int, Hashable]]]] = []
        self._held = 0      # entries in runs, the small heap and the open batch, stale ones included
        self._seq = itertools.count()
        self._run_seq = itertools.count()

    def _push(self, key: Hashable, depth: int, priority: float) -> None:
        ent = (priority, -depth, next(self._seq), key)
        self._live[key] = ent
        self._open.append(ent)
        self._held += 1
        if self._held > 2 * len(self._live) + self._SLACK:
            self._compact()

    def _compact(self) -> None:
        live = self._live
        runs = []
        held = 0
        for _, n, run in self._runs:
            run = [e for e in run if live.get(e[3]) is e]
            if run:
                runs.append((run[-1], n, run))
                held += len(run)
        heapq.heapify(runs)
        self._runs = runs
        self._open = [e for e in self._open if live.get(e[3]) is e]
        self._small = [e for e in self._small if live.get(e[3]) is e]
        heapq.heapify(self._small)
        self._held = held + len(self._open) + len(self._small)

    def _seal(self) -> None:
        batch = self._open
        self._open = []
        if len(batch) <= self._SMALL_BATCH:
            for ent in batch:
                heapq.heappush(self._small, ent)
            return
        run = sorted(batch, reverse=True)
        heapq.heappush(self._runs, (run[-1], next(self._run_seq), run))

    def _top_entry(self) -> tuple[float, int, int, Hashable] | None:
        """The live entry to evict next."""
        if self._open:
            self._seal()
        small, live = self._small, self._live
        while small and live.get(small[0][3]) is not small[0]:
            heapq.heappop(small)
            self._held -= 1
        top = self._run_top()
        if small and (top is None or small[0] < top):
            return small[0]
        return top

    def _run_top(self) -> tuple[float, int, int, Hashable] | None:
        runs, live = self._runs, self._live
        while runs:
            head, n, run = runs[0]
            while run and live.get(run[-1][3]) is not run[-1]:
                run.pop()
                self._held -= 1
            if not run:
                heapq.heappop(runs)
                continue
            top = run[-1]
            if top is head:
                return top
            # The run's head moved up: it stays first, in place, while it is below both
            # children; otherwise it sinks to its place.
            nxt = len(runs)
            if (nxt < 2 or top < runs[1][0]) and (nxt < 3 or top < runs[2][0]):
                runs[0] = (top, n, run)
                return top
            heapq.heapreplace(runs, (top, n, run))
        return None

    # The one-call forms of insert and touch: a fleet's store takes a hundred blocks per put
    # and per restore, millions in a run. Policies with a hot path override them.
    def insert_many(self, keys: Sequence[Hashable], depths: Sequence[int], session: str = "") -> None:
        for key, depth in zip(keys, depths, strict=True):
            self.insert(key, depth, session)  # type: ignore[attr-defined]

    def touch_many(self, keys: Iterable[Hashable], session: str = "") -> None:
        live = self._live
        for key in keys:
            ent = live.get(key)
            if ent is not None:
                self.touch(key, -ent[1], session)  # type: ignore[attr-defined]

    def _pushed(self, n: int) -> None:
        """Account for ``n`` entries appended to the open batch by a ``*_many`` loop."""
        self._held += n
        if self._held > 2 * len(self._live) + self._SLACK:
            self._compact()

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)
        for side in self._sides:
            side.pop(key, None)
        if self._held > 2 * len(self._live) + self._SLACK:
            self._compact()

    def admits(self, depth: int) -> bool:
        """Whether a new block at ``depth`` is worth storing now (see ``DepthDiscountedPolicy``)."""
        return True

    def victim(self) -> Hashable | None:
        top = self._top_entry()
        return None if top is None else top[3]

    def pop_victim(self) -> Hashable | None:
        key = self.victim()   # through the subclass: greedy-dual notes its victims
        if key is None:
            return None
        # The victim's entry is on top of the small heap or last in the first run: taken off
        # there now, it is not met again as a stale entry on the next call.
        ent = self._live[key]
        small = self._small
        if small and small[0] is ent:
            heapq.heappop(small)
        else:
            self._runs[0][2].pop()
        self._held -= 1
        self.remove(key)
        return key

    def pop_victims(self, count: int) -> list[Hashable]:
        """What ``count`` calls of ``pop_victim`` return, in order (fewer if it runs dry).

        A tier making room for a put of thousands of blocks asks once. Victims mostly come in
        stretches of one run (a put's blocks, deepest first): every entry of the first run
        below the smallest head of the rest (the heap's two children and the small heap's
        top, each no larger than anything behind it) is the next victim if live, or a stale
        entry a single pop would skip, so the stretch comes off in one loop.
        """
        out: list[Hashable] = []
        live = self._live
        while len(out) < count:
            top = self._top_entry()
            if top is None:
                break
            small = self._small
            if small and small[0] is top:
                heapq.heappop(small)
                self._held -= 1
                out.append(top[3])
                continue
            runs = self._runs
            run = runs[0][2]
            run.pop()   # top, the smallest live entry
            out.append(top[3])
            bound = runs[1][0] if len(runs) > 1 else None
            if len(runs) > 2 and runs[2][0] < bound:
                bound = runs[2][0]
            if small and (bound is None or small[0] < bound):
                bound = small[0]
            popped = 1
            while run and len(out) < count:
                ent = run[-1]
                if bound is not None and not ent < bound:
                    break
                run.pop()
                popped += 1
                if live.get(ent[3]) is ent:
                    out.append(ent[3])
            self._held -= popped
        self._forget(out)
        return out

    def _forget(self, keys: list[Hashable]) -> None:
        """``remove`` of keys whose entries are already off the runs (``pop_victims``)."""
        live = self._live
        for key in keys:
            del live[key]
        for side in self._sides:
            for key in keys:
                side.pop(key, None)
        if self._held > 2 * len(live) + self._SLACK:
            self._compact()

    def __len__(self) -> int:
        return len(self._live)


class LRUPolicy(_LazyHeap):
    """Least recently used; inside one batch (one request) deeper blocks go first.

    The owner calls ``new_batch()`` once per operation; every touch in that
    operation shares a recency stamp and is ordered by depth, deepest evicted first.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._batch = 0

    def new_batch(self) -> None:
        self._batch += 1

    def insert(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        self._push(key, depth, self._batch)

    def touch(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        if key in self._live:
            self._push(key, depth, self._batch)


class DepthDiscountedPolicy(_LazyHeap):
    """Time recency minus a per-depth cost plus a sharing credit (the ``agent`` policy, see module doc).

    Time comes from ``new_batch(now)`` (the trace replay), else from ``clock``
    (the store passes ``time.monotonic``). ``depth_cost_s`` is in seconds per
    block of depth; the default was tuned on 64-token blocks (0.008 s per block,
    i.e. a block 1,000 deep must have been touched 8 s later than a chain head
    to outrank it). Without either (a caller with no notion of time, such as the
    cluster simulator today), each batch is one tick and the costs are
    ``depth_cost_batches`` per block (0.001, the best batch-unit value on the
    traces) and the sharing credit scaled alike.
    """

    name = "agent"
    timed = True

    def __init__(self, depth_cost_s: float = 0.008, share_s: float = 30.0,
                 clock: object = None, depth_cost_batches: float = 0.001) -> None:
        if depth_cost_s < 0 or share_s < 0 or depth_cost_batches < 0:
            raise ValueError("depth_cost_s, share_s and depth_cost_batches must be >= 0")
        self.depth_cost_s = depth_cost_s
        self.share_s = share_s
        self.depth_cost_batches = depth_cost_batches
        self._clock = clock
        super().__init__()
        self._now = 0.0
        self._ticks = 0
        self._cost = depth_cost_s
        self._share = share_s
        self._sharers: dict[Hashable, int] = {}
        self._last_session: dict[Hashable, str] = {}
        self._sides = (self._sharers, self._last_session)

    def new_batch(self, now: float | None = None) -> None:
        if now is None and self._clock is None:
            self._ticks += 1
            self._now = float(self._ticks)
            self._cost = self.depth_cost_batches
            self._share = self.share_s * (self.depth_cost_batches / self.depth_cost_s) if self.depth_cost_s else 0.0
            return
        self._now = float(self._clock()) if now is None else float(now)  # type: ignore[misc]
        self._cost, self._share = self.depth_cost_s, self.share_s

    def _value(self, key: Hashable, depth: int) -> float:
        n = self._sharers.get(key, 1)
        bonus = self._share * math.log2(n) if n > 1 else 0.0
        return self._now - self._cost * depth + bonus

    def insert(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        self._sharers.setdefault(key, 1)
        self._last_session[key] = session
        self._push(key, depth, self._value(key, depth))

    def touch(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        if key not in self._live:
            return
        _count_sharer(self._sharers, self._last_session, key, session)
        self._push(key, depth, self._value(key, depth))

    # insert and touch, inlined over a batch (the same entries, in the same order).
    def insert_many(self, keys: Sequence[Hashable], depths: Sequence[int], session: str = "") -> None:
        live, batch, seq = self._live, self._open, self._seq
        sharers, last = self._sharers, self._last_session
        now, cost, share = self._now, self._cost, self._share
        for key, depth in zip(keys, depths, strict=True):
            n = sharers.setdefault(key, 1)
            last[key] = session
            ent = (now - cost * depth + (share * math.log2(n) if n > 1 else 0.0), -depth, next(seq), key)
            live[key] = ent
            batch.append(ent)
        self._pushed(len(keys))

    def touch_many(self, keys: Iterable[Hashable], session: str = "") -> None:
        live, batch, seq = self._live, self._open, self._seq
        sharers, last = self._sharers, self._last_session
        now, cost, share = self._now, self._cost, self._share
        pushed = 0
        for key in keys:
            ent = live.get(key)
            if ent is None:
                continue
            if session and session != last.get(key):
                n = sharers[key] = sharers.get(key, 1) + 1
                last[key] = session
            else:
                n = sharers.get(key, 1)
            depth = -ent[1]
            ent = (now - cost * depth + (share * math.log2(n) if n > 1 else 0.0), ent[1], next(seq), key)
            live[key] = ent
            batch.append(ent)
            pushed += 1
        self._pushed(pushed)

    def admits(self, depth: int) -> bool:
        """Whether a new block at ``depth`` outranks the next victim. When it does not,
        storing it would evict a block worth more (often its own parent, leaving it an
        orphan), so the caller stops storing that chain here."""
        top = self._top_entry()
        if top is None:
            return True
        return (top[0], top[1]) < (self._now - self._cost * depth, -depth)


class GreedyDualPolicy(_LazyHeap):
    """GreedyDual priority valuing shared blocks and long-lived sessions (the earlier agent policy)."""

    name = "greedy-dual"

    def __init__(self, share_weight: float = 1.0, session_weight: float = 0.0) -> None:
        self.share_weight = share_weight
        self.session_weight = session_weight
        super().__init__()
        self._sharers: dict[Hashable, int] = {}
        self._last_session: dict[Hashable, str] = {}
        self._sides = (self._sharers, self._last_session)
        self._activity: dict[str, int] = {}       # session -> operations seen (requests)
        self._session_batch: dict[str, int] = {}
        self._batch = 0
        self._inflation = 0.0
        self._batch_inflation = 0.0

    def new_batch(self) -> None:
        # One request's touches share the inflation of its start: otherwise evictions
        # during the request would rank its deep blocks above its head, and losing
        # the head of a chain loses every hit behind it.
        self._batch += 1
        self._batch_inflation = self._inflation

    def _note_session(self, session: str) -> int:
        if not session:
            return 1
        if self._session_batch.get(session) != self._batch:
            self._session_batch[session] = self._batch
            self._activity[session] = self._activity.get(session, 0) + 1
        return self._activity[session]

    def _push_valued(self, key: Hashable, depth: int, activity: int) -> None:
        value = (1.0 + self.share_weight * math.log2(self._sharers.get(key, 1))
                 + self.session_weight * math.log2(activity))
        self._push(key, depth, self._batch_inflation + value)

    def insert(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        self._sharers[key] = 1
        self._last_session[key] = session
        self._push_valued(key, depth, self._note_session(session))

    def touch(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        if key not in self._live:
            return
        _count_sharer(self._sharers, self._last_session, key, session)
        self._push_valued(key, depth, self._note_session(session))

    def victim(self) -> Hashable | None:
        top = self._top_entry()
        if top is None:
            return None
        self._inflation = max(self._inflation, top[0])
        return top[3]

    def pop_victims(self, count: int) -> list[Hashable]:
        # One by one: each victim raises the inflation (``victim``).
        out: list[Hashable] = []
        while len(out) < count and (key := self.pop_victim()) is not None:
            out.append(key)
        return out


class SessionRatePolicy(_LazyHeap):
    """LRU on a per-session clock: a block's recency is its session's last request time
    minus ``gap_weight`` x the session's typical think time (EWMA of its request gaps).

    An agent in a fast tool loop comes back within seconds; one whose turns are
    minutes apart will not need its KV soon even if it was active a moment ago.
    Time comes from ``new_batch(now)`` (wall clock in the store, virtual time in
    the simulator); without it, the batch counter stands in.
    """

    name = "session-rate"
    timed = True

    def __init__(self, gap_weight: float = 1.0, ewma: float = 0.3, default_gap: float = 30.0) -> None:
        self.gap_weight = gap_weight
        self.ewma = ewma
        self.default_gap = default_gap
        super().__init__()
        self._now = 0.0
        self._batch = 0
        self._last: dict[str, float] = {}
        self._gap: dict[str, float] = {}
        self._session_batch: dict[str, int] = {}

    def new_batch(self, now: float | None = None) -> None:
        self._batch += 1
        self._now = float(self._batch) if now is None else now

    def _key(self, session: str) -> float:
        if session and self._session_batch.get(session) != self._batch:
            self._session_batch[session] = self._batch
            prev = self._last.get(session)
            if prev is not None:
                g = self._gap.get(session, self.default_gap)
                self._gap[session] = (1 - self.ewma) * g + self.ewma * (self._now - prev)
            self._last[session] = self._now
        return self._now - self.gap_weight * self._gap.get(session, self.default_gap)

    def insert(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        self._push(key, depth, self._key(session))

    def touch(self, key: Hashable, depth: int = 0, session: str = "") -> None:
        if key in self._live:
            self._push(key, depth, self._key(session))
