"""The in-memory trace model shared by every reader, the generator, the analyzer,
the simulator and the replayer.

A trace is a list of sessions. A session is a tree of agents: the main agent's
items are requests and sub-agents, in recorded order; a sub-agent is an agent
of its own (it may nest). Times are seconds relative to the session start.

Block identity: a trace gives each full input block an id (``hash_ids``); equal
leading ids mean an equal prefix. Ids are only unique inside their namespace
(one file for claude-code traces), so every consumer works on *chained keys*:
``key[i] = mix(key[i-1], namespace, id[i])``. Chaining makes a key identify the
whole prefix, exactly as vLLM's block hash does, so the keys can be fed to a
real block manager and index without per-token work.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field

from kvmesh.sequences import common_prefix_len as common_len  # noqa: F401 - re-exported

_MASK64 = (1 << 64) - 1


def namespace_seed(namespace: str) -> int:
    """A stable 32-bit integer for a namespace string (independent of PYTHONHASHSEED)."""
    return zlib.crc32(namespace.encode())


def chain_keys(namespace: str, hash_ids: list[int]) -> list[int]:
    """Chained 64-bit block keys for ``hash_ids`` in ``namespace``.

    Tuple hashing of ints is deterministic across processes (only str/bytes hashes
    are salted), fast, and collision-free enough for simulation at 10^8 blocks.
    """
    ns = namespace_seed(namespace)
    return _extend_chain([], ns, ns, hash_ids)


def _extend_chain(out: list[int], ns: int, prev: int, hash_ids: list[int]) -> list[int]:
    for hid in hash_ids:
        prev = hash((prev, ns, hid)) & _MASK64
        out.append(prev)
    return out


def share_chain_keys(requests: list[Request], recent: int = 4) -> None:
    """Compute every request's chained keys once, reusing the keys of the recent request
    (same namespace, one of the last ``recent``) that shares the most leading ids.

    An agent's turn repeats its previous input and adds to it, so most of a request's keys
    are its predecessor's: the list then shares those key objects instead of holding equal
    copies. At fleet scale the keys are most of the simulator's memory (tens of millions of
    blocks), and shared objects also make equal keys identical for every dict lookup. The
    values are exactly :func:`chain_keys`'s.
    """
    last: dict[str, deque[Request]] = {}
    for r in requests:
        if r._keys is not None:
            continue
        seen = last.setdefault(r.namespace, deque(maxlen=recent))
        base: Request | None = None
        k = 0
        for p in seen:
            n = common_len(p.hash_ids, r.hash_ids)
            if n > k:
                base, k = p, n
        ns = namespace_seed(r.namespace)
        if base is None:
            r._keys = _extend_chain([], ns, ns, r.hash_ids)
        else:
            keys = base.keys
            r._keys = _extend_chain(keys[:k], ns, keys[k - 1], r.hash_ids[k:])
        seen.append(r)


@dataclass(slots=True)
class Request:
    """One LLM call as recorded in a trace."""

    uid: str                     # unique across the whole trace: "<session>/<agent>/<index>"
    session: str
    agent: str                   # "main" or the sub-agent id (nested: "a1/a2")
    t: float                     # recorded start, seconds since session start
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]          # one id per full block of the input, trace block size
    namespace: str               # scope of hash_ids
    block_size: int
    think_time: float | None = None   # recorded gap after the previous turn ended
    api_time: float | None = None     # recorded duration of the call
    model: str = ""
    _keys: list[int] | None = field(default=None, repr=False)

    @property
    def keys(self) -> list[int]:
        """Chained block keys (computed once, cached)."""
        if self._keys is None:
            self._keys = chain_keys(self.namespace, self.hash_ids)
        return self._keys

    @property
    def recorded_end(self) -> float:
        return self.t + (self.api_time or 0.0)


@dataclass(slots=True)
class Agent:
    """A main agent or a sub-agent: an ordered list of requests and sub-agents."""

    agent_id: str
    t: float                                   # recorded start, seconds since session start
    items: list[Request | Agent] = field(default_factory=list)
    duration: float | None = None              # recorded wall time, when the trace has it
    kind: str = ""                             # e.g. sub-agent type ("Explore")
    detached: bool = False                     # launched in the background: its parent never waits for it

    def requests(self) -> list[Request]:
        """All requests of this agent and its sub-agents, depth first."""
        out: list[Request] = []
        for it in self.items:
            if isinstance(it, Request):
                out.append(it)
            else:
                out.extend(it.requests())
        return out

    def sub_agents(self) -> list[Agent]:
        return [it for it in self.items if isinstance(it, Agent)]

    @property
    def recorded_end(self) -> float:
        if self.duration is not None:
            return self.t + self.duration
        reqs = self.requests()
        return max((r.recorded_end for r in reqs), default=self.t)


@dataclass(slots=True)
class Session:
    """One agent session (one claude-code file, one generated session, one mooncake request)."""

    session_id: str
    root: Agent
    block_size: int
    start: float = 0.0          # recorded start offset of the session (open-loop traces)
    source: str = ""

    def requests(self) -> list[Request]:
        return self.root.requests()


@dataclass
class Trace:
    sessions: list[Session]
    fmt: str = ""
    block_size: int = 0

    def requests(self) -> list[Request]:
        out: list[Request] = []
        for s in self.sessions:
            out.extend(s.requests())
        return out

    def __len__(self) -> int:
        return len(self.sessions)
