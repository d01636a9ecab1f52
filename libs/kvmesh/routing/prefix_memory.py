"""What the router remembers of its own decisions: speculative entries and an approximate index.

Both remember whole chains of block keys per endpoint and answer "how many
leading blocks of this chain does endpoint E hold". Block keys are chained
hashes (each folds in its parent), so two chains that agree at position i
agree on everything before it: the common prefix of two chains is found by
binary search in O(log n), and remembering a chain is O(1) (a reference to
its key list). That keeps a decision on a 200k-token prompt sub-millisecond.
Chains are grouped by their first key, so only chains that share a first
block are ever compared.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Callable

from kvmesh.hashing.prefix import common_prefix_near, extends

_VALUE = operator.itemgetter(2)


def speculative_ttl(ttl_s: float, estimated_ttft_s: float) -> float:
    """TTL of a speculative entry for a request just sent: its blocks exist once its prefill
    is done (the estimated TTFT) and the index has them one event delivery later (``ttl_s``),
    so a sibling arriving behind a long prefill still finds the entry."""
    return ttl_s + max(estimated_ttft_s, 0.0)


class _ChainSet:
    """Chains grouped by head key, each tagged with an endpoint, a value (expiry or order) and
    ``known``: how many of its leading blocks the engine had already reported when it was written."""

    def __init__(self, max_per_head: int) -> None:
        self.max_per_head = max_per_head
        self.by_head: dict[int, list[list]] = {}   # head -> [[endpoint, keys, value, known], ...]

    def add(self, endpoint: str, keys: list[int], value: float, known: int = 0) -> list | None:
        """Remember a chain; an older chain of the same endpoint that it extends is replaced."""
        lst = self.by_head.setdefault(keys[0], [])
        for ent in lst:
            if ent[0] == endpoint and extends(ent[1], keys):
                ent[1] = keys if len(keys) >= len(ent[1]) else ent[1]
                ent[2] = max(ent[2], value)
                ent[3] = max(ent[3], known)
                return None
        ent = [endpoint, keys, value, known]
        lst.append(ent)
        if len(lst) > self.max_per_head:
            lst.sort(key=_VALUE)
            del lst[0]
        return ent

    def best(self, keys: list[int], live_after: float | None = None,
             known_out: dict[str, int] | None = None) -> dict[str, int]:
        """Per endpoint, the longest leading run of ``keys`` in its chains (those whose value
        is above ``live_after``, if given); ``known_out`` gets, per endpoint, how much of that
        run the engine had reported when the chain was written."""
        out: dict[str, int] = {}
        if not keys:
            return out
        near = far = 0
        lk = len(keys)
        before = after = None    # keys[near - 1] and keys[near], None where out of range
        cutoff = -math.inf if live_after is None else live_after
        get = out.get
        for ent in self.by_head.get(keys[0], ()):
            if ent[2] <= cutoff:
                continue
            a = ent[1]
            la = len(a)
            # Nearly every chain leaves this prompt where the last one did (the end of a
            # shared system prompt): that guess is checked here, without a call.
            if before is not None and near <= la and a[near - 1] == before and (
                    after is None or near == la or a[near] != after):
                n = near
            else:
                n = common_prefix_near(a, keys, far)
                if n != near:
                    near, far = n, near
                    before = keys[n - 1] if n > 0 else None
                    after = keys[n] if n < lk else None
            if n > get(ent[0], 0):
                out[ent[0]] = n
                if known_out is not None:
                    known_out[ent[0]] = min(ent[3], n)
        return out

    def drop_endpoint(self, endpoint: str) -> None:
        for head in list(self.by_head):
            lst = [e for e in self.by_head[head] if e[0] != endpoint]
            if lst:
                self.by_head[head] = lst
            else:
                del self.by_head[head]


class SpeculativeIndex:
    """Short-lived "this endpoint will hold these blocks" entries written right after a pick.

    A burst of sibling sub-agents arrives before the first one's KV events reach
    the indexer; these entries make the siblings see the first pick's prefix.
    Bounded: at most ``max_chains`` chains (oldest expiry dropped first).
    """

    def __init__(self, ttl_s: float = 2.0, max_chains: int = 100_000, max_per_head: int = 256) -> None:
        self.ttl_s = ttl_s
        self.max_chains = max_chains
        self._set = _ChainSet(max_per_head)
        self._order: OrderedDict[int, tuple[int, list]] = OrderedDict()   # id(entry) -> (head, entry)

    def __len__(self) -> int:
        return len(self._order)

    def ttl_after(self, estimated_ttft_s: float) -> float:
        """TTL of an entry for a request just sent (see :func:`speculative_ttl`)."""
        return speculative_ttl(self.ttl_s, estimated_ttft_s)

    def put(self, endpoint_id: str, keys: list[int], now: float, ttl_s: float | None = None,
            known: int = 0) -> None:
        """``known``: leading blocks of ``keys`` the engine had already reported (the index
        held them) when the entry was written; see :meth:`confirmed`."""
        if not keys:
            return
        ent = self._set.add(endpoint_id, keys, now + (self.ttl_s if ttl_s is None else ttl_s), known)
        if ent is not None:
            self._order[id(ent)] = (keys[0], ent)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._order:
            _, (head, ent) = next(iter(self._order.items()))
            if ent[2] > now and len(self._order) <= self.max_chains:
                break
            self._order.popitem(last=False)
            lst = self._set.by_head.get(head)
            if lst is not None:
                try:
                    lst.remove(ent)
                except ValueError:
                    pass
                if not lst:
                    del self._set.by_head[head]

    def match(self, keys: list[int], now: float) -> dict[str, int]:
        """Leading speculative blocks per endpoint (only unexpired entries)."""
        return self._set.best(keys, now)

    def confirmed(self, keys: list[int], now: float, index_gpu: Callable[[str], int]) -> dict[str, int]:
        """:meth:`match`, without the entries the index contradicts.

        An entry for a finished request says the engine holds its chain, the ``known`` blocks
        of it reported already. Where the index now holds fewer of those, the engine evicted
        them since (an agent's context freed at the end of its turn goes first on a full GPU),
        and the entry's claim on the rest is stale too. An entry for a request in flight has
        ``known`` 0 and always stands: what is evicted before it runs, it computes again."""
        known: dict[str, int] = {}
        out = self._set.best(keys, now, known)
        return {ep: n for ep, n in out.items() if known[ep] <= 0 or index_gpu(ep) >= known[ep]}

    def forget_endpoint(self, endpoint_id: str) -> None:
        self._set.drop_endpoint(endpoint_id)
        self._order = OrderedDict((k, v) for k, v in self._order.items() if v[1][0] != endpoint_id)


class ApproxIndex:
    """Per-endpoint LRU of the chains the router sent there; no engine events.

    The baseline other routers use: it assumes an endpoint keeps everything it
    was sent up to ``capacity_blocks`` (then least recently routed chains go
    first). Blocks shared by sibling chains are counted once per chain, so the
    capacity is approximate — as the whole policy is by design.
    """

    def __init__(self, capacity_blocks: int = 100_000, max_per_head: int = 256) -> None:
        self.capacity_blocks = capacity_blocks
        self._set = _ChainSet(max_per_head)
        self._lru: dict[str, OrderedDict[int, list]] = {}
        self._blocks: dict[str, int] = {}
        self._clock = 0

    def insert(self, endpoint_id: str, keys: list[int]) -> None:
        if not keys:
            return
        self._clock += 1
        lru = self._lru.setdefault(endpoint_id, OrderedDict())
        for ent in self._set.by_head.get(keys[0], ()):
            if ent[0] == endpoint_id and extends(ent[1], keys):
                # Extends (or repeats) a remembered chain: grow it in place and refresh.
                self._blocks[endpoint_id] = self._blocks.get(endpoint_id, 0) + max(0, len(keys) - len(ent[1]))
                if len(keys) > len(ent[1]):
                    ent[1] = keys
                ent[2] = self._clock
                lru.move_to_end(id(ent))
                break
        else:
            ent = self._set.add(endpoint_id, keys, self._clock)
            if ent is not None:
                lru[id(ent)] = ent
                self._blocks[endpoint_id] = self._blocks.get(endpoint_id, 0) + len(keys)
        while self._blocks.get(endpoint_id, 0) > self.capacity_blocks and len(lru) > 1:
            _, victim = lru.popitem(last=False)
            self._blocks[endpoint_id] -= len(victim[1])
            lst = self._set.by_head.get(victim[1][0], [])
            if victim in lst:
                lst.remove(victim)

    def match(self, keys: list[int]) -> dict[str, int]:
        return self._set.best(keys)

    def forget_endpoint(self, endpoint_id: str) -> None:
        self._set.drop_endpoint(endpoint_id)
        self._lru.pop(endpoint_id, None)
        self._blocks.pop(endpoint_id, None)

    def size(self, endpoint_id: str) -> int:
        return self._blocks.get(endpoint_id, 0)


class SessionAffinity:
    """session id -> last endpoint, with a TTL and a bounded size."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._map: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def get(self, session_id: str, now: float) -> str:
        if not session_id:
            return ""
        v = self._map.get(session_id)
        if v is None or v[1] <= now:
            return ""
        return v[0]

    def set(self, session_id: str, endpoint_id: str, now: float) -> None:
        if not session_id:
            return
        self._map[session_id] = (endpoint_id, now + self.ttl_s)
        self._map.move_to_end(session_id)
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)

    def forget_endpoint(self, endpoint_id: str) -> None:
        for s in [s for s, (e, _) in self._map.items() if e == endpoint_id]:
            del self._map[s]
