"""What the router remembers of its own decisions: speculative entries and an approximate index.

Both store chains of block keys per endpoint and answer "how many leading
blocks of this chain does endpoint E hold". Entries are always written as
whole leading chains and a prefix is refreshed whenever a longer chain
through it is, so presence along a chain is monotone (if block i is present,
so are blocks 0..i-1). That lets a lookup binary-search the chain: O(log n)
per endpoint even for 200k-token prompts.
"""

from __future__ import annotations

from collections import OrderedDict


def _leading(keys: list[int], present) -> int:
    """Length of the leading run of ``keys`` for which ``present(key)`` holds (monotone)."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if present(keys[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class SpeculativeIndex:
    """Short-lived "this endpoint will hold these blocks" entries written right after a pick.

    A burst of sibling sub-agents arrives before the first one's KV events reach
    the indexer; these entries make the siblings see the first pick's prefix.
    Bounded: at most ``max_keys`` keys, oldest dropped first.
    """

    def __init__(self, ttl_s: float = 2.0, max_keys: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # key -> {endpoint_id: expiry}
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, endpoint_id: str, keys: list[int], now: float, ttl_s: float | None = None) -> None:
        exp = now + (self.ttl_s if ttl_s is None else ttl_s)
        ent = self._entries
        # Deepest first, so the chain's head ends up most recent and is dropped last.
        for k in reversed(keys):
            d = ent.get(k)
            if d is None:
                ent[k] = {endpoint_id: exp}
            else:
                if d.get(endpoint_id, 0.0) < exp:
                    d[endpoint_id] = exp
                ent.move_to_end(k)
        while len(ent) > self.max_keys:
            ent.popitem(last=False)

    def match(self, keys: list[int], now: float) -> dict[str, int]:
        """Leading speculative blocks per endpoint (only unexpired entries)."""
        if not keys:
            return {}
        head = self._entries.get(keys[0])
        if not head:
            return {}
        out: dict[str, int] = {}
        ent = self._entries
        for ep, exp in list(head.items()):
            if exp <= now:
                del head[ep]
                continue

            def present(k: int, ep: str = ep) -> bool:
                d = ent.get(k)
                return d is not None and d.get(ep, 0.0) > now

            out[ep] = _leading(keys, present)
        return out

    def forget_endpoint(self, endpoint_id: str) -> None:
        for d in self._entries.values():
            d.pop(endpoint_id, None)


class ApproxIndex:
    """Per-endpoint LRU of block keys the router sent there; no engine events.

    The baseline other routers use: it assumes an endpoint keeps everything it
    was sent up to ``capacity_blocks`` (then least recently routed first).
    """

    def __init__(self, capacity_blocks: int = 100_000) -> None:
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def insert(self, endpoint_id: str, keys: list[int]) -> None:
        lru = self._lru.setdefault(endpoint_id, OrderedDict())
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def match(self, keys: list[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        if not keys:
            return out
        for ep, lru in self._lru.items():
            if keys[0] in lru:
                out[ep] = _leading(keys, lru.__contains__)
        return out

    def forget_endpoint(self, endpoint_id: str) -> None:
        self._lru.pop(endpoint_id, None)

    def size(self, endpoint_id: str) -> int:
        return len(self._lru.get(endpoint_id, ()))


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
