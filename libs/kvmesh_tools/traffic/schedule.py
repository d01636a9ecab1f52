"""When each request of a trace is sent: the closed-loop (agent-like) or open-loop schedule.

Why it exists: agents are closed loops. A turn is sent when the previous response
has finished plus the recorded think time, so a slow cluster delays the rest of
the session instead of piling up requests that a real agent would never send.
The simulator (virtual time) and the live replayer (real time) both drive this
same dependency graph, so they send the same requests in the same order.

Rules (closed loop):
- a request waits for the previous request of its agent; its gap is the recorded
  think time (or, lacking it, recorded start minus recorded end of the previous call);
- a sub-agent starts after the request that launched it (the last request of the
  parent before it) plus the recorded gap; sub-agents launched together therefore
  fire together, as a burst;
- a parent request that in the recording started after a sub-agent had finished
  also waits for that sub-agent; sub-agents still running at that point keep
  running in the background, and so does a sub-agent the trace marks as launched
  in the background (kv-cache-tester's ``status: "async_launched"``): its parent
  never waits for it;
- session starts are spread uniformly (seeded) over ``start_window_s``, or taken
  from the trace (Mooncake timestamps) when no window is given.
Open loop: every request is released at session start + its recorded time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvmesh_tools.traffic.model import Agent, Request, Trace

_EPS = 1e-6


@dataclass(slots=True)
class Node:
    idx: int
    req: Request
    deps: list[int]            # nodes that must complete first
    gap: float                 # seconds after the last dependency completes (or the session start)
    session_idx: int


@dataclass
class Schedule:
    nodes: list[Node]
    session_start: list[float]
    dependents: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dependents = [[] for _ in self.nodes]
        for n in self.nodes:
            for d in n.deps:
                self.dependents[d].append(n.idx)

    def __len__(self) -> int:
        return len(self.nodes)


@dataclass
class ScheduleOptions:
    mode: str = "closed"                 # closed | open
    start_window_s: float | None = None  # spread session starts over this window; None = recorded starts
    think_scale: float = 1.0             # multiply recorded think times
    max_think_s: float | None = 3600.0   # cap a single recorded gap (users walking away for days)
    seed: int = 0


def _gap(value: float, opts: ScheduleOptions) -> float:
    g = max(0.0, value) * opts.think_scale
    if opts.max_think_s is not None:
        g = min(g, opts.max_think_s)
    return g


def _compile_agent(agent: Agent, launch_dep: int | None, launch_end: float, sidx: int,
                   nodes: list[Node], opts: ScheduleOptions) -> int | None:
    """Append ``agent``'s nodes; return the node index of its last request (its completion)."""
    prev: int | None = None                  # previous request of this agent
    prev_end = launch_end                    # its recorded end
    open_subs: list[tuple[int, float]] = []  # (terminal node, recorded end) of running sub-agents
    for it in agent.items:
        if isinstance(it, Request):
            if prev is None:
                deps = [launch_dep] if launch_dep is not None else []
                gap = it.t - launch_end
            else:
                deps = [prev]
                gap = it.think_time if it.think_time is not None else it.t - prev_end
            # Sub-agents that had finished before this request was sent block it.
            blocking = [(n, end) for n, end in open_subs if end <= it.t + _EPS]
            if blocking:
                deps += [n for n, _ in blocking]
                gap = it.t - max([prev_end] + [end for _, end in blocking])
                open_subs = [s for s in open_subs if s not in blocking]
            n = Node(idx=len(nodes), req=it, deps=deps, gap=_gap(gap, opts), session_idx=sidx)
            nodes.append(n)
            prev = n.idx
            prev_end = it.recorded_end
        else:
            dep = prev if prev is not None else launch_dep
            terminal = _compile_agent(it, dep, prev_end, sidx, nodes, opts)
            if terminal is not None and not it.detached:
                open_subs.append((terminal, it.recorded_end))
    return prev


def build_schedule(trace: Trace, opts: ScheduleOptions | None = None) -> Schedule:
    """Compile ``trace`` into a dependency graph with per-session start times."""
    opts = opts or ScheduleOptions()
    if opts.mode not in ("closed", "open"):
        raise ValueError(f"schedule mode must be 'closed' or 'open', got {opts.mode!r}")
    rng = random.Random(opts.seed)
    starts: list[float] = []
    for s in trace.sessions:
        if opts.start_window_s is not None:
            starts.append(rng.uniform(0.0, opts.start_window_s))
        else:
            starts.append(s.start)
    nodes: list[Node] = []
    for sidx, s in enumerate(trace.sessions):
        if opts.mode == "open":
            for r in s.requests():
                nodes.append(Node(idx=len(nodes), req=r, deps=[], gap=max(0.0, r.t), session_idx=sidx))
        else:
            _compile_agent(s.root, None, 0.0, sidx, nodes, opts)
    return Schedule(nodes=nodes, session_start=starts)


class ScheduleRunner:
    """Releases nodes as their dependencies complete.

    ``initial()`` gives the ``(release_time, node)`` pairs that need nothing;
    ``complete(node, now)`` marks a node done and returns the newly released pairs.
    Time is whatever clock the caller uses (virtual or wall, already scaled).
    """

    def __init__(self, schedule: Schedule, time_scale: float = 1.0) -> None:
        self.s = schedule
        self.scale = time_scale
        self._missing = [len(n.deps) for n in schedule.nodes]
        self._last_done = [0.0] * len(schedule.nodes)
        self.done = 0

    def initial(self, t0: float = 0.0) -> list[tuple[float, int]]:
        out = []
        for n in self.s.nodes:
            if not n.deps:
                out.append((t0 + (self.s.session_start[n.session_idx] + n.gap) / self.scale, n.idx))
        return out

    def complete(self, idx: int, now: float) -> list[tuple[float, int]]:
        self.done += 1
        out = []
        for d in self.s.dependents[idx]:
            self._missing[d] -= 1
            self._last_done[d] = max(self._last_done[d], now)
            if self._missing[d] == 0:
                out.append((self._last_done[d] + self.s.nodes[d].gap / self.scale, d))
        return out

    @property
    def finished(self) -> bool:
        return self.done >= len(self.s.nodes)


def recorded_order(schedule: Schedule) -> list[Request]:
    """Requests in the order they would be sent if every call took its recorded time.

    A policy-independent order used for ceilings and ``kvmesh analyze``.
    """
    import heapq

    runner = ScheduleRunner(schedule)
    heap = [(t, i) for t, i in runner.initial()]
    heapq.heapify(heap)
    out: list[Request] = []
    while heap:
        t, i = heapq.heappop(heap)
        req = schedule.nodes[i].req
        out.append(req)
        for item in runner.complete(i, t + (req.api_time or 0.0)):
            heapq.heappush(heap, item)
    return out
