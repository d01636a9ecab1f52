"""Apply KV-event batches to the index, per endpoint and in sequence order.

Why a separate, synchronous core: the rules that keep the index truthful
(sequence gaps, engine restarts, AllBlocksCleared, bad input) are the same for
ZMQ, gRPC ingest and the cluster simulator, and they are easiest to test
without sockets. The async pump (``kvmesh_indexer.pump``) feeds this core; the
simulator may call it directly.

Sequence rules, per endpoint:
- ``seq == last + 1``: apply.
- ``seq > last + 1`` (a gap): ask the engine's replay socket for
  ``last + 1 ..`` when one is configured and apply what it returns; if replay
  is not configured or does not cover the gap, clear the endpoint (metric +
  log) and continue from this batch.
- ``seq <= last`` (a sequence reset = engine restart): clear the endpoint.
- first batch seen with ``seq > 0`` and a replay socket: replay from 0 so an
  indexer that subscribed late (or restarted) catches up.
- a batch that failed because the backend was down marks the endpoint for
  re-sync; the next batch repairs it like a gap (replay, else clear).
- a quiet endpoint is probed (``probe_tail``): a message lost on the event socket
  with nothing after it (ZMQ's slow joiner right after an engine restart, a
  publisher high-water-mark drop of the last batch) leaves no gap for the rules
  above to see. The probe asks the replay buffer for the last seq seen: the same
  events there means in sync (newer batches are applied); a missing or different
  batch means the engine restarted, so the endpoint is cleared and rebuilt from
  the buffer. Batches a probe applied may still arrive live; they are skipped as
  duplicates, not read as a reset.

Hostile input (issue #20): a forged message must not wipe or jump an endpoint.
When the engine has a replay socket, the suspicious cases -- a sequence reset,
a jump of more than ``max_seq_jump`` batches, a batch carrying AllBlocksCleared
-- are checked against it: the engine's buffer must hold that seq with the same
events, else the batch is refused (``forged_seq``) and changes nothing. Without
replay, a reset is believed (nothing can tell a restart apart) but an absurd
jump (e.g. 10^12) is refused unless ``confirm_jump`` consecutive batches
continue it (a real long outage does that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventError, KVEventBatch
from kvmesh.index.base import BlockIndex, IndexUnavailable, Tier
from kvmesh_indexer.keys import EngineHashing, KeyError_, KeyMapper, ModelSpec

log = logging.getLogger(__name__)

# Batches applied by a tail probe whose live copies may still be in flight.
PROBE_DUPLICATE_WINDOW = 64

# Returns the buffered batches with seq >= start, in order: [(seq, batch), ...].
ReplayFn = Callable[[int], Sequence[tuple[int, KVEventBatch]]]


class IngestObserver(Protocol):
    def on_events(self, endpoint: str, kind: str, n: int) -> None: ...
    def on_rejected(self, endpoint: str, reason: str, n: int) -> None: ...
    def on_gap(self, endpoint: str, missing: int) -> None: ...
    def on_replay(self, endpoint: str, outcome: str) -> None: ...
    def on_clear(self, endpoint: str, reason: str, blocks: int) -> None: ...
    def on_probe(self, endpoint: str, outcome: str) -> None: ...


class NullObserver:
    def on_events(self, endpoint: str, kind: str, n: int) -> None:
        pass

    def on_rejected(self, endpoint: str, reason: str, n: int) -> None:
        pass

    def on_gap(self, endpoint: str, missing: int) -> None:
        pass

    def on_replay(self, endpoint: str, outcome: str) -> None:
        pass

    def on_clear(self, endpoint: str, reason: str, blocks: int) -> None:
        pass

    def on_probe(self, endpoint: str, outcome: str) -> None:
        pass


@dataclass
class EndpointState:
    endpoint: str
    model: str
    mapper: KeyMapper
    last_seq: int | None = None
    last_event_at: float | None = None
    needs_resync: bool = False
    resync_upto: int | None = None   # first seq after the batches lost to a backend outage
    jump_seq: int | None = None      # last refused implausible seq, and how many in a row
    jump_run: int = 0
    last_events: list | None = None  # events of batch ``last_seq``: what a tail probe compares
    # The last batches a tail probe applied (seq -> events): their live copies are duplicates.
    probed: dict[int, list] | None = None
    batches: int = 0
    events_applied: int = 0
    events_rejected: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


@dataclass
class BatchResult:
    applied: int = 0
    rejected: int = 0
    accepted: bool = True


class _Refused(Exception):
    """A batch whose sequence number cannot be the engine's; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Ingestor:
    """Synchronous ingest core shared by the service and the simulator."""

    def __init__(self, index: BlockIndex, models: dict[str, ModelSpec], observer: IngestObserver | None = None,
                 now: Callable[[], float] = time.monotonic, max_events_per_batch: int = 10_000,
                 max_seq_jump: int = 1_000_000, confirm_jump: int = 3) -> None:
        self.max_seq_jump = max_seq_jump
        self.confirm_jump = confirm_jump
        self.index = index
        self.models = models
        self.observer: IngestObserver = observer or NullObserver()
        self.now = now
        self.max_events_per_batch = max_events_per_batch
        self.endpoints: dict[str, EndpointState] = {}

    # ---- endpoints -----------------------------------------------------------------
    def ensure_endpoint(self, endpoint: str, model: str, engine: EngineHashing | None = None) -> EndpointState:
        """The endpoint's state, created on first use; raises ValueError for an unknown model."""
        st = self.endpoints.get(endpoint)
        if st is not None and st.model == model:
            return st
        spec = self.models.get(model)
        if spec is None:
            raise ValueError(f"unknown model {model!r} for endpoint {endpoint!r} (configured: "
                             f"{', '.join(sorted(self.models)) or 'none'})")
        st = EndpointState(endpoint, model, KeyMapper(spec, engine))
        self.endpoints[endpoint] = st
        log.info("endpoint ingest state created", extra={"endpoint": endpoint, "model": model,
                                                          "key_mode": st.mapper.mode})
        return st

    def forget_endpoint(self, endpoint: str) -> int:
        """Purge an endpoint (dead or deregistered): its entries and its state."""
        st = self.endpoints.pop(endpoint, None)
        blocks = self.index.clear_endpoint(endpoint)
        if st is not None:
            st.mapper.reset()
        self.observer.on_clear(endpoint, "purged", blocks)
        return blocks

    def clear(self, st: EndpointState, reason: str) -> int:
        blocks = self.index.clear_endpoint(st.endpoint)
        st.mapper.reset()
        st.bump(f"clear_{reason}")
        self.observer.on_clear(st.endpoint, reason, blocks)
        log.warning("endpoint cleared", extra={"endpoint": st.endpoint, "reason": reason, "blocks": blocks})
        return blocks

    # ---- batches -------------------------------------------------------------------
    def process(self, endpoint: str, model: str, seq: int | None, batch: KVEventBatch | None,
                errors: Iterable[EventError] = (), replay: ReplayFn | None = None,
                engine: EngineHashing | None = None) -> BatchResult:
        """Apply one batch with sequence checks. ``batch=None`` means it could not be decoded.

        Raises ``IndexUnavailable`` when the backend is down; the endpoint is then
        marked for re-sync and the batch is not counted as seen.
        """
        st = self.ensure_endpoint(endpoint, model, engine)
        res = BatchResult()
        errs = list(errors)
        if errs:
            res.rejected += len(errs)
            self._reject(st, "bad_event", len(errs), errs[0].message)
        if seq is not None and st.probed is not None:
            if batch is not None and seq in st.probed and _events_equal(st.probed[seq], batch.events):
                st.bump("duplicate")
                return res  # already applied by a tail probe
            if seq > max(st.probed):
                st.probed = None
        if seq is not None:
            try:
                self._check_seq(st, seq, replay, batch)
            except _Refused as exc:
                n = len(batch.events) if batch is not None else 1
                res.accepted = False
                res.rejected += n
                self._reject(st, exc.reason, n, str(exc))
                return res
            except IndexUnavailable:
                self._mark_resync(st, seq)
                raise
        st.last_event_at = self.now()
        if batch is None:
            res.accepted = False
            if seq is not None:
                st.last_seq, st.last_events = seq, None
            return res
        if len(batch.events) > self.max_events_per_batch:
            res.accepted = False
            res.rejected += len(batch.events)
            self._reject(st, "oversize_batch", len(batch.events),
                         f"{len(batch.events)} events > limit {self.max_events_per_batch}")
            if seq is not None:
                st.last_seq, st.last_events = seq, None
            return res
        try:
            applied, rejected = self._apply(st, batch)
        except IndexUnavailable:
            self._mark_resync(st, seq)
            raise
        res.applied += applied
        res.rejected += rejected
        if seq is not None:
            st.last_seq = seq
            st.last_events = batch.events
        st.batches += 1
        return res

    def _mark_resync(self, st: EndpointState, seq: int | None) -> None:
        st.needs_resync = True
        if seq is not None:
            st.resync_upto = max(st.resync_upto or 0, seq + 1)

    def pending_resync(self) -> list[EndpointState]:
        return [st for st in self.endpoints.copy().values() if st.needs_resync]

    def resync(self, endpoint: str, replay: ReplayFn | None) -> None:
        """Repair an endpoint whose batches were lost while the backend was down.

        Replays ``last+1 .. resync_upto`` when the engine still buffers them;
        otherwise clears the endpoint (it refills from new events).
        """
        st = self.endpoints.get(endpoint)
        if st is None or not st.needs_resync:
            return
        start = 0 if st.last_seq is None else st.last_seq + 1
        upto = st.resync_upto if st.resync_upto is not None else start
        if upto > start:
            self._fill(st, start, upto, replay, reason="resync")
        st.needs_resync = False
        st.resync_upto = None

    def backend_reset(self) -> None:
        """The backend lost its data (e.g. Redis restarted): rebuild every endpoint from replay."""
        for st in self.endpoints.copy().values():
            upto = (st.last_seq + 1) if st.last_seq is not None else 0
            st.last_seq = None
            st.mapper.reset()
            self._mark_resync(st, upto - 1 if upto else None)

    def _engine_sent(self, seq: int, batch: KVEventBatch | None, replay: ReplayFn | None) -> bool | None:
        """Does the engine's replay buffer hold ``seq`` with these events? None = cannot tell
        (no replay socket, or it did not answer). The engine buffers a batch as it publishes it,
        so an answer without ``seq`` means the engine never sent it."""
        if replay is None:
            return None
        try:
            got = list(replay(seq))
        except IndexUnavailable:
            raise
        except Exception:  # noqa: BLE001 - an unreachable replay socket proves nothing
            return None
        for s, b in got:
            if s == seq:
                if batch is None:
                    return True
                try:
                    return bool(b.events == batch.events)
                except Exception:  # noqa: BLE001 - incomparable events: the seq alone decides
                    return True
        return False

    def _check_seq(self, st: EndpointState, seq: int, replay: ReplayFn | None,
                   batch: KVEventBatch | None = None) -> None:
        last = st.last_seq
        if last is not None and (seq <= last or seq - last - 1 > self.max_seq_jump) or (
                batch is not None and any(isinstance(e, AllBlocksCleared) for e in batch.events)):
            self._check_plausible(st, seq, replay, batch)
        if st.needs_resync:
            start = 0 if last is None else last + 1
            log.warning("re-syncing endpoint after backend outage", extra={"endpoint": st.endpoint,
                                                                             "from_seq": start})
            if seq > start:
                self._fill(st, start, seq, replay, reason="resync")
            elif seq < start:
                self.clear(st, "resync_seq_reset")
                st.last_seq = None
            st.needs_resync = False
            st.resync_upto = None
            return
        if last is None:
            if seq > 0 and replay is not None:
                self._fill(st, 0, seq, replay, reason="late_join", clear_on_miss=False)
            return
        if seq == last + 1:
            return
        if seq <= last:
            st.bump("seq_reset")
            log.warning("sequence reset (engine restart)", extra={"endpoint": st.endpoint, "last_seq": last,
                                                                  "seq": seq})
            self.clear(st, "seq_reset")
            st.last_seq = None
            if seq > 0 and replay is not None:
                self._fill(st, 0, seq, replay, reason="restart", clear_on_miss=False)
            return
        missing = seq - last - 1
        st.bump("gaps")
        self.observer.on_gap(st.endpoint, missing)
        log.warning("sequence gap", extra={"endpoint": st.endpoint, "last_seq": last, "seq": seq,
                                           "missing": missing})
        self._fill(st, last + 1, seq, replay, reason="gap")

    def _check_plausible(self, st: EndpointState, seq: int, replay: ReplayFn | None,
                         batch: KVEventBatch | None) -> None:
        """Raise ``_Refused`` for a reset, an absurd jump or a clear that the engine did not send."""
        sent = self._engine_sent(seq, batch, replay)
        if sent is False:
            raise _Refused("forged_seq", f"seq {seq} (last {st.last_seq}) is not in the engine's replay buffer")
        last = st.last_seq
        if sent is None and last is not None and seq - last - 1 > self.max_seq_jump:
            st.jump_run = st.jump_run + 1 if st.jump_seq is not None and seq == st.jump_seq + 1 else 1
            st.jump_seq = seq
            if st.jump_run < self.confirm_jump:
                raise _Refused("implausible_seq", f"seq {seq} jumps {seq - last - 1} batches past {last} "
                                                  f"(max {self.max_seq_jump} unless {self.confirm_jump} in a row)")
        st.jump_seq, st.jump_run = None, 0

    def _fill(self, st: EndpointState, start: int, upto: int, replay: ReplayFn | None, reason: str,
              clear_on_miss: bool = True) -> None:
        """Apply batches [start, upto) from replay; clear the endpoint if they are not all there."""
        got: list[tuple[int, KVEventBatch]] = []
        if replay is not None:
            try:
                got = [(s, b) for s, b in replay(start) if start <= s < upto]
            except IndexUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken replay socket must not stop ingest
                log.warning("replay failed", extra={"endpoint": st.endpoint, "error": str(exc)})
                got = []
            got.sort(key=lambda x: x[0])
        complete = bool(got) and got[0][0] == start and all(
            got[i + 1][0] == got[i][0] + 1 for i in range(len(got) - 1)) and got[-1][0] == upto - 1
        if replay is not None:
            outcome = "complete" if complete else ("partial" if got else "empty")
            st.bump(f"replay_{outcome}")
            self.observer.on_replay(st.endpoint, outcome)
            log.info("replay", extra={"endpoint": st.endpoint, "reason": reason, "start": start, "upto": upto,
                                      "batches": len(got), "outcome": outcome})
        if not complete and clear_on_miss:
            self.clear(st, reason if replay is None else f"{reason}_unrepaired")
            # Keep only the contiguous tail ending right before ``upto``; older batches
            # would re-add blocks whose removals we may have missed.
            tail: list[tuple[int, KVEventBatch]] = []
            expect = upto - 1
            for s, b in reversed(got):
                if s != expect:
                    break
                tail.append((s, b))
                expect -= 1
            got = list(reversed(tail))
        for s, b in got:
            if len(b.events) <= self.max_events_per_batch:
                self._apply(st, b)
            st.last_seq, st.last_events = s, b.events
        if upto > 0 and st.last_seq != upto - 1:
            st.last_seq, st.last_events = upto - 1, None

    # ---- tail probe ------------------------------------------------------------------
    def probe_tail(self, endpoint: str, model: str, replay: ReplayFn | None,
                   engine: EngineHashing | None = None) -> str:
        """Check a quiet endpoint against its engine's replay buffer; returns the outcome.

        ``in_sync``: the buffer's batch at the last seq seen is the one applied, nothing newer.
        ``caught_up``: newer batches were there and are applied now (messages were lost).
        ``restarted``: the buffer does not hold the batch applied last, so the engine is a new
        process: the endpoint is cleared and rebuilt from the buffer.
        ``unreachable``: no answer; nothing changes.
        """
        if replay is None:
            return "skipped"
        st = self.ensure_endpoint(endpoint, model, engine)
        last = st.last_seq
        try:
            got = sorted(replay(0 if last is None else last), key=lambda x: x[0])
        except IndexUnavailable:
            raise
        except Exception:  # noqa: BLE001 - an engine that is down proves nothing
            return "unreachable"
        if last is not None:
            head = got[0] if got else None
            same = head is not None and head[0] == last and (
                st.last_events is None or _events_equal(head[1].events, st.last_events))
            if head is not None and head[0] > last:
                # Missed more than the buffer holds since: a gap, repaired (or cleared) as live.
                self._fill(st, last + 1, got[-1][0] + 1, _from_list(got), reason="probe_gap")
                return self._probed(st, "caught_up", got)
            if not same:
                st.bump("seq_reset")
                log.warning("engine restarted (tail probe)", extra={"endpoint": st.endpoint, "last_seq": last})
                self.clear(st, "probe_restart")
                st.last_seq, st.last_events = None, None
                try:
                    got = sorted(replay(0), key=lambda x: x[0])
                except IndexUnavailable:
                    raise
                except Exception:  # noqa: BLE001
                    got = []
                if got:
                    self._fill(st, got[0][0], got[-1][0] + 1, _from_list(got), reason="restart",
                               clear_on_miss=False)
                return self._probed(st, "restarted", got)
            got = got[1:]
        if not got:
            return self._probed(st, "in_sync", got)
        self._fill(st, got[0][0], got[-1][0] + 1, _from_list(got), reason="probe", clear_on_miss=False)
        return self._probed(st, "caught_up", got)

    def _probed(self, st: EndpointState, outcome: str, applied: Sequence[tuple[int, KVEventBatch]]) -> str:
        if applied and outcome != "in_sync":
            st.probed = {s: b.events for s, b in applied[-PROBE_DUPLICATE_WINDOW:]}
        st.bump(f"probe_{outcome}")
        self.observer.on_probe(st.endpoint, outcome)
        return outcome

    def _reject(self, st: EndpointState, reason: str, n: int, detail: str) -> None:
        st.events_rejected += n
        st.bump(f"rejected_{reason}", n)
        self.observer.on_rejected(st.endpoint, reason, n)
        log.warning("rejected kv events", extra={"endpoint": st.endpoint, "reason": reason, "events": n,
                                                 "detail": detail[:300]})

    def _apply(self, st: EndpointState, batch: KVEventBatch) -> tuple[int, int]:
        """Apply events in order, merging runs of same-tier stores/removes into one index call."""
        applied = rejected = 0
        pending_kind: str | None = None
        pending_tier: Tier | None = None
        pending: list[int] = []
        starts: list[tuple[int, int | None]] = []
        pending_events = 0
        index, model, ep = self.index, st.model, st.endpoint

        def flush() -> None:
            nonlocal pending, pending_kind, pending_events, starts
            if pending_kind == "stored":
                index.add(model, ep, pending_tier, pending, chain_starts=starts)  # type: ignore[arg-type]
            elif pending_kind == "removed":
                index.remove(model, ep, pending_tier, pending)  # type: ignore[arg-type]
            if pending_kind is not None:
                self.observer.on_events(ep, pending_kind, pending_events)
            pending, pending_kind, pending_events, starts = [], None, 0, []

        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    tier = Tier.from_medium(ev.medium)
                    keys = st.mapper.stored_keys(ev)
                    parent = st.mapper.parent_key(ev)
                    kind = "stored"
                elif isinstance(ev, BlockRemoved):
                    tier = Tier.from_medium(ev.medium)
                    keys, unknown = st.mapper.removed_keys(ev.block_hashes)
                    if unknown:
                        st.bump("remove_unknown_hash", unknown)
                    kind = "removed"
                elif isinstance(ev, AllBlocksCleared):
                    flush()
                    self.clear(st, "all_blocks_cleared")
                    self.observer.on_events(ep, "cleared", 1)
                    applied += 1
                    continue
                else:
                    raise KeyError_(f"unknown event type {type(ev).__name__}")
            except (KeyError_, ValueError) as exc:
                rejected += 1
                self._reject(st, "bad_event", 1, str(exc))
                continue
            if kind != pending_kind or tier != pending_tier:
                flush()
                pending_kind, pending_tier = kind, tier
            if kind == "stored":
                starts.append((len(pending), parent))
            pending.extend(keys)
            pending_events += 1
            applied += 1
        flush()
        st.events_applied += applied
        return applied, rejected


def _from_list(got: Sequence[tuple[int, KVEventBatch]]) -> ReplayFn:
    """A replay function answering from batches already fetched (no second request)."""
    return lambda start: [(s, b) for s, b in got if s >= start]


def _events_equal(a: Sequence, b: Sequence) -> bool:
    try:
        return bool(list(a) == list(b))
    except Exception:  # noqa: BLE001 - incomparable events: the seq alone decides
        return True
