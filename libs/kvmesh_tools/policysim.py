"""Replays agent traces against the RAM tier to compare eviction policies by prefix hit rate.

The model: the offload store sees every request's block chain (engines spill or
write through). For each request, in time order, the leading blocks already in
the tier are hits; then the whole chain is stored. This drives the very
``RamTier`` and policies the service uses, in metadata-only mode (capacity in
blocks), so what is measured is what runs.

Claude Code traces (``../shared/traces/claude-code``): one JSON(.gz) per session,
``hash_ids`` per 64-token block, ids scoped per file, sub-agents nested with
their own relative clocks. Each file's ids get their own namespace; the main
agent and each sub-agent are separate sessions (the eviction hint).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvmesh.kvstore.block import CapacityError, StoredBlock
from kvmesh.kvstore.eviction_registry import is_timed, make_eviction_policy
from kvmesh.kvstore.ram_tier import RamTier


@dataclass(slots=True)
class TraceRequest:
    t: float
    namespace: str
    session: str
    blocks: list[int]


def _walk(reqs: list[dict], ns: str, session: str, t0: float, out: list[TraceRequest]) -> None:
    for r in reqs:
        if r.get("type") == "subagent":
            _walk(r.get("requests", []), ns, f"{session}/{r.get('agent_id', len(out))}", t0 + float(r.get("t", 0)),
                  out)
        elif r.get("hash_ids"):
            out.append(TraceRequest(t0 + float(r.get("t", 0)), ns, session, [int(h) for h in r["hash_ids"]]))


def load_claude_code(folder: str | Path, max_sessions: int = 0, stagger_s: float = 60.0) -> list[TraceRequest]:
    """All requests of the sessions in ``folder``, merged in time order (session i starts at i*stagger)."""
    files = sorted(Path(folder).glob("*.json*"))
    if max_sessions:
        files = files[:max_sessions]
    out: list[TraceRequest] = []
    for i, f in enumerate(files):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            doc = json.load(fh)
        ns = str(doc.get("id", f.stem))
        _walk(doc.get("requests", []), ns, ns, i * stagger_s, out)
    out.sort(key=lambda r: r.t)
    return out


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    hit_blocks: int
    total_blocks: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def replay(requests: Iterable[TraceRequest], policy: str, capacity_blocks: int, **policy_kw: float) -> ReplayResult:
    tier = RamTier(capacity_blocks, make_eviction_policy(policy, **policy_kw))
    hits = total = 0
    timed = is_timed(policy)  # these take the trace's clock, not the wall clock
    for req in requests:
        if timed:
            tier.policy.new_batch(req.t)  # type: ignore[call-arg]
        else:
            tier.new_batch()
        ns, sess = req.namespace, req.session
        n = len(req.blocks)
        total += n
        i = 0
        while i < n and tier.get((ns, req.blocks[i]), sess) is not None:
            i += 1
        hits += i
        for depth in range(i, min(n, capacity_blocks)):
            bid = (ns, req.blocks[depth])
            if bid in tier:
                tier.touch(bid, sess)
                continue
            if not tier.admits(1, depth):
                break  # the rest of this chain ranks below what it would evict
            try:
                tier.make_room(1)
            except CapacityError:
                break
            tier.add(bid, StoredBlock(size=1, depth=depth, session=sess, block_size=64))
    return ReplayResult(policy, capacity_blocks, hits, total, tier.evictions)


def infinite_hit_rate(requests: Iterable[TraceRequest]) -> tuple[float, int]:
    """(hit rate with unbounded capacity, distinct blocks)."""
    seen: set[tuple[str, int]] = set()
    hits = total = 0
    for req in requests:
        i = 0
        n = len(req.blocks)
        while i < n and (req.namespace, req.blocks[i]) in seen:
            i += 1
        hits += i
        total += n
        seen.update((req.namespace, b) for b in req.blocks)
    return (hits / total if total else 0.0), len(seen)


def iter_capacities(unique: int, fractions: Iterable[float]) -> Iterator[tuple[float, int]]:
    for f in fractions:
        yield f, max(1, int(unique * f))
