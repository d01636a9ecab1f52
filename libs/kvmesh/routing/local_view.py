"""The router's own recent picture of where prefixes are, for when the indexer answers late.

On a loaded machine the indexer's answer can come after the router's lookup deadline
(``--lookup-timeout-s``). Falling back to ``approx`` then throws away what the router
learnt from the index a moment ago: which endpoints and the store held a chain, including
prefixes other replicas placed. This view keeps that for ``--local-view-ttl-s``: every
index answer (on time or late: the call stays open ``--lookup-late-s`` and its answer is
merged when it comes), and every prompt this router saw an engine finish. A lookup past its
deadline is answered from here when the view knows the chain; only an unknown chain falls
back to ``approx``.

It can be wrong where the index would have been right (blocks evicted within the TTL, a
store that dropped a chain); those misses are counted as ``lookup_timeout`` by
``kvmesh.routing.fidelity``, not as view bugs. Bounded by ``max_chains``.
"""

from __future__ import annotations

from kvmesh.routing.prefix_memory import SpeculativeIndex
from kvmesh.routing.types import Matches, TierMatch

_STORE = "\x00store"


class LocalView:
    def __init__(self, ttl_s: float = 30.0, max_chains: int = 50_000) -> None:
        self.ttl_s = ttl_s
        self._chains = SpeculativeIndex(ttl_s=ttl_s, max_chains=max_chains)

    def learn(self, keys: list[int], matches: Matches, now: float) -> None:
        """Remember an index answer for ``keys``: each endpoint's leading GPU blocks, the store's."""
        for eid, tm in matches.per_endpoint.items():
            if tm.gpu:
                self._chains.put(eid, keys[:tm.gpu], now)
        store = max(matches.store.cpu, matches.store.disk, matches.store.gpu)
        if store:
            self._chains.put(_STORE, keys[:store], now)

    def served(self, endpoint_id: str, keys: list[int], now: float) -> None:
        """An engine finished this prompt: it holds its blocks (until it evicts them)."""
        self._chains.put(endpoint_id, keys, now)

    def matches(self, keys: list[int], now: float) -> Matches | None:
        """What the view knows of ``keys`` (``source="local"``), or None when it knows nothing."""
        got = self._chains.match(keys, now)
        if not got:
            return None
        store = got.pop(_STORE, 0)
        return Matches(per_endpoint={eid: TierMatch(gpu=n) for eid, n in got.items()},
                       store=TierMatch(cpu=store), source="local")

    def forget_endpoint(self, endpoint_id: str) -> None:
        self._chains.forget_endpoint(endpoint_id)

    def __len__(self) -> int:
        return len(self._chains)
