"""Which turns a router sends away from the endpoint its session's previous turn went to.

A moved turn gives up whatever its session's context left on the previous endpoint and the
new one lacks, so a policy's moves are where its hit rate goes when it trades reuse for a
shorter wait (#18: on the fleet, precise's moved turns carry 4% of the prompt tokens at half the
hit rate of the rest, docs/bench-history.md, session 61). Where the store holds the context, or
the previous endpoint had lost it, a move gives up nothing: the decision reads the previous
endpoint from here (``previous``) and reports what the policy predicted there
(``Decision.given_up_tokens``). The simulator reports moves per policy and the live router
counts them on ``/metrics``; both mark a turn through this one table, so the two count the same
thing.

Session ids come from clients, so the table is bounded: past ``capacity`` sessions the least
recently routed is forgotten, and its next turn counts as a first turn, not a move.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 100_000   # sessions remembered: about 10 MB with 50-character ids; above any simulated trace


class SessionMoves:
    """The endpoint each session's last turn was routed to, least recently routed first out."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def observe(self, session_id: str, endpoint_id: str) -> bool:
        """Record that the session's turn went to ``endpoint_id``; True if its previous turn
        went elsewhere. A request without a session id is never a move."""
        if not session_id:
            return False
        prev = self._last.pop(session_id, None)
        self._last[session_id] = endpoint_id
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return prev is not None and prev != endpoint_id

    def previous(self, session_id: str) -> str:
        """The endpoint the session's last turn was routed to ("" if none remembered); a read
        only, so a decision that is never sent changes nothing."""
        return self._last.get(session_id, "") if session_id else ""

    def __len__(self) -> int:
        return len(self._last)
