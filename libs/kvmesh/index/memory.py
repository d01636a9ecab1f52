"""Embedded in-memory block index (the default backend).

Why this layout: the index must hold millions of block-endpoint entries in a
bounded, predictable amount of RAM, answer a 6,000-block lookup in well under
a millisecond or two of Python, and be reusable unchanged by the virtual-time
cluster simulator (hence a synchronous core and an injectable clock).

- Per model, one ``dict`` maps a block key (int) to a bitmask. Each endpoint
  gets a *slot*; bit ``slot*4 + tier`` says "this endpoint holds the block in
  that tier". Masks are interned, so the millions of dict values share a few
  int objects.
- The dict's insertion order doubles as the LRU list: a store (or, when
  ``touch_on_lookup``, a lookup hit) re-inserts the key at the end, and
  eviction pops from the front in batches once the entry budget is exceeded.
- Clearing one endpoint is O(its blocks): each slot keeps an append-only
  ``array('Q')`` log of the keys it added (8 bytes per entry), compacted when
  it grows twice as long as the live count.
- GPU blocks are counted by copy. vLLM's block pool can hold two blocks with one
  hash (a fully cached prompt's last block is computed again into a new block),
  announces each with a ``BlockStored`` and each eviction with a ``BlockRemoved``. A bit alone would
  drop the block at the first copy's eviction while the engine still serves the
  other, so the extra copies are counted beside the masks (``_copies``, only for
  blocks that have them) and a removal takes a copy before it clears the bit.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

import numpy as np

from kvmesh.index.base import TIERS, BlockIndex, EndpointMatch, IndexStats, LookupResult, Tier

_BITS_PER_SLOT = 4
# Bit 0 of a slot is "any tier"; bits 1-3 are the tiers. A lookup table, because calling the
# enum per matched bit was a visible share of a lookup at fleet scale.
_TIER_OF_BIT: tuple[Tier | None, ...] = (None, Tier.GPU, Tier.CPU, Tier.DISK)


def _bit_array(mask: int) -> np.ndarray:
    """Set bit positions of a non-negative mask, lowest first, by unpacking its bytes."""
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


def _positions(mask: int) -> Iterable[int]:
    """Set bit positions, lowest first."""
    if mask.bit_count() > 32:
        # With hundreds of endpoints a lookup drops hundreds of bits at once (all that share
        # only the system prompt); unpacking the bytes beats peeling bits off a big int.
        return _bit_array(mask).tolist()
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class MemoryIndex(BlockIndex):
    """Bounded LRU block index; thread-safe through one lock."""

    name = "memory"
    blocking = False
    counts_copies = True
    LOCK_CHUNK = 2048

    def __init__(self, max_entries: int = 0, now: Callable[[], float] = time.monotonic,
                 touch_on_lookup: bool = True, evict_batch_fraction: float = 1 / 64,
                 max_speculative_keys: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self.now = now
        self.touch_on_lookup = touch_on_lookup
        self.evict_batch_fraction = evict_batch_fraction
        self.max_speculative_keys = max_speculative_keys
        self._lock = threading.RLock()
        self._models: dict[str, dict[int, int]] = {}
        self._slot_of: dict[str, int] = {}
        self._slot_names: list[str | None] = []
        self._free_slots: list[int] = []
        self._slot_entries: list[int] = []
        self._slot_log: list[dict[str, array]] = []
        self._tier_entries = dict.fromkeys(TIERS, 0)
        self._entries = 0
        self._intern: dict[int, int] = {}
        self._any_cache: dict[int, int] = {}
        self._any_base = 0
        self._spec: dict[str, dict[str, dict[int, float]]] = {}
        self._spec_count = 0
        # (model, slot, key) -> GPU copies beyond the first (see the module docstring).
        self._copies: dict[tuple[str, int, int], int] = {}
        self.evicted = 0
        self.slots_version = 0   # bumped when an endpoint gets or loses a slot

    # ---- slots -----------------------------------------------------------------
    def _slot(self, endpoint: str) -> int:
        slot = self._slot_of.get(endpoint)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_names[slot] = endpoint
                self._slot_entries[slot] = 0
                self._slot_log[slot] = {}
            else:
                slot = len(self._slot_names)
                self._slot_names.append(endpoint)
                self._slot_entries.append(0)
                self._slot_log.append({})
                self._any_base |= 1 << (slot * _BITS_PER_SLOT)
            self._slot_of[endpoint] = slot
            self.slots_version += 1
        return slot

    def _release_slot(self, slot: int) -> None:
        name = self._slot_names[slot]
        if name is not None:
            self._slot_of.pop(name, None)
        self._slot_names[slot] = None
        self.slots_version += 1
        self._slot_log[slot] = {}
        self._slot_entries[slot] = 0
        self._free_slots.append(slot)

    def _interned(self, mask: int) -> int:
        got = self._intern.get(mask)
        if got is None:
            if len(self._intern) > 200_000:
                self._intern.clear()
                self._any_cache.clear()
            self._intern[mask] = mask
            got = mask
        return got

    def _any(self, mask: int) -> int:
        got = self._any_cache.get(mask)
        if got is None:
            got = ((mask >> 1) | (mask >> 2) | (mask >> 3)) & self._any_base
            if len(self._any_cache) > 200_000:
                self._any_cache.clear()
            self._any_cache[mask] = got
        return got

    def _drop_bits(self, mask: int) -> None:
        for pos in _positions(mask):
            self._slot_entries[pos >> 2] -= 1
            self._tier_entries[_TIER_OF_BIT[pos & 3]] -= 1
        self._entries -= mask.bit_count()

    # ---- updates ---------------------------------------------------------------
    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        # The in-memory walk is already cheap per block; parent links are not needed.
        tier = Tier(tier)
        if len(keys) <= self.LOCK_CHUNK:
            return self._add(model, endpoint, tier, keys)
        # Release the lock between chunks so a big batch never stalls lookups for long.
        return sum(self._add(model, endpoint, tier, keys[i:i + self.LOCK_CHUNK])
                   for i in range(0, len(keys), self.LOCK_CHUNK))

    def _add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        with self._lock:
            d = self._models.get(model)
            if d is None:
                d = self._models[model] = {}
            slot = self._slot(endpoint)
            bit = 1 << (slot * _BITS_PER_SLOT + tier)
            logs = self._slot_log[slot]
            log = logs.get(model)
            if log is None:
                log = logs[model] = array("Q")
            intern = self._intern
            pop = d.pop
            copies = self._copies if tier == Tier.GPU else None
            added = 0
            for k in keys:
                m = pop(k, 0)
                if not m & bit:
                    m |= bit
                    added += 1
                    log.append(k)
                    m = intern.get(m) or self._interned(m)
                elif copies is not None:
                    c = (model, slot, k)
                    copies[c] = copies.get(c, 0) + 1
                d[k] = m
            if added:
                self._entries += added
                self._slot_entries[slot] += added
                self._tier_entries[tier] += added
                if len(log) > 2 * self._slot_entries[slot] + 4096:
                    self._compact_log(slot)
            if self.max_entries and self._entries > self.max_entries:
                self._evict()
            return added

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        tier = Tier(tier)
        with self._lock:
            d = self._models.get(model)
            slot = self._slot_of.get(endpoint)
            if d is None or slot is None:
                return 0
            bit = 1 << (slot * _BITS_PER_SLOT + tier)
            copies = self._copies if tier == Tier.GPU and self._copies else None
            removed = 0
            for k in keys:
                m = d.get(k)
                if m is not None and m & bit:
                    if copies is not None and (n := copies.get(c := (model, slot, k))):
                        # Another copy of the block is still in the engine's cache.
                        if n > 1:
                            copies[c] = n - 1
                        else:
                            del copies[c]
                        continue
                    m &= ~bit
                    removed += 1
                    if m:
                        d[k] = self._interned(m)
                    else:
                        del d[k]
            if removed:
                self._entries -= removed
                self._slot_entries[slot] -= removed
                self._tier_entries[tier] -= removed
            return removed

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        with self._lock:
            slot = self._slot_of.get(endpoint)
            removed = 0
            if slot is not None:
                shift = slot * _BITS_PER_SLOT
                clear = (0xF << shift) if tier is None else (1 << (shift + Tier(tier)))
                for model, log in self._slot_log[slot].items():
                    d = self._models.get(model)
                    if not d:
                        continue
                    for k in log:
                        m = d.get(k)
                        if m is not None and m & clear:
                            gone = m & clear
                            self._drop_bits(gone)
                            removed += gone.bit_count()
                            m &= ~clear
                            if m:
                                d[k] = self._interned(m)
                            else:
                                del d[k]
                if self._copies and (tier is None or tier == Tier.GPU):
                    self._copies = {c: n for c, n in self._copies.items() if c[1] != slot}
                if tier is None:
                    self._release_slot(slot)
            if tier is None:
                # The whole endpoint is gone or its engine was reset: the picks made for it are void.
                for per_model in self._spec.values():
                    dropped = per_model.pop(endpoint, None)
                    if dropped:
                        self._spec_count -= len(dropped)
            return removed

    def _compact_log(self, slot: int) -> None:
        shift = slot * _BITS_PER_SLOT
        mine = 0xF << shift
        for model, log in list(self._slot_log[slot].items()):
            held = self._models.get(model, {}).get
            # Each key once, at its first place in the log, if the slot still holds it.
            self._slot_log[slot][model] = array("Q", [k for k in dict.fromkeys(log) if held(k, 0) & mine])

    def _evict(self) -> None:
        target = self.max_entries - max(1, int(self.max_entries * self.evict_batch_fraction))
        while self._entries > target:
            total_keys = sum(len(d) for d in self._models.values()) or 1
            progressed = False
            for d in list(self._models.values()):
                if not d:
                    continue
                excess = self._entries - target
                if excess <= 0:
                    break
                # Spread the batch over the models by their share of keys.
                n = max(1, min(len(d), int(excess * len(d) / total_keys) + 1))
                gone = list(islice(iter(d), n))
                for k in gone:
                    m = d.pop(k)
                    self._drop_bits(m)
                    self.evicted += m.bit_count()
                    progressed = True
                if self._copies:
                    dropped = set(gone)
                    self._copies = {c: n for c, n in self._copies.items() if c[2] not in dropped}
            if not progressed:
                break

    # ---- speculative -----------------------------------------------------------
    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        with self._lock:
            now = self.now()
            expiry = now + ttl_s
            per_model = self._spec.setdefault(model, {})
            entries = per_model.setdefault(endpoint, {})
            before = len(entries)
            for k in keys:
                entries[k] = expiry
            self._spec_count += len(entries) - before
            if self._spec_count > self.max_speculative_keys:
                self._sweep_speculative(now)

    def _sweep_speculative(self, now: float) -> None:
        count = 0
        for per_model in self._spec.values():
            for ep in list(per_model):
                live = {k: e for k, e in per_model[ep].items() if e > now}
                if live:
                    per_model[ep] = live
                    count += len(live)
                else:
                    del per_model[ep]
        self._spec_count = count

    # ---- lookup ----------------------------------------------------------------
    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        with self._lock:
            result = LookupResult(chain_length=len(keys))
            allowed = -1
            if endpoint_filter:
                allowed = 0
                for ep in endpoint_filter:
                    slot = self._slot_of.get(ep)
                    if slot is not None:
                        allowed |= 0xF << (slot * _BITS_PER_SLOT)
            if exclude:
                for ep in exclude:
                    slot = self._slot_of.get(ep)
                    if slot is not None:
                        allowed &= ~(0xF << (slot * _BITS_PER_SLOT))
            for name in dict.fromkeys((model, *extra_models)):
                d = self._models.get(name)
                if d and keys and allowed:
                    self._fill(self._walk(d, keys, allowed), result)
            if include_speculative and keys:
                self._spec_lookup(model, keys, endpoint_filter, exclude, result)
            return result

    def lookup_rows(self, model: str, keys: Sequence[int]) -> np.ndarray:
        """Leading matched blocks of ``keys`` per endpoint slot, as rows ``[any tier, GPU, CPU,
        DISK]`` indexed by :meth:`slot_of` (no filters, no speculative entries).

        The same walk as :meth:`lookup`, answered as one array: at fleet scale every endpoint
        holds the shared system prompt, and building a match object per endpoint was most of
        a lookup.
        """
        with self._lock:
            out = np.zeros(len(self._slot_names) * _BITS_PER_SLOT, dtype=np.int64)
            d = self._models.get(model)
            if d and keys:
                for mask, length in self._walk(d, keys, -1):
                    out[_bit_array(mask)] = length
            return out.reshape(-1, _BITS_PER_SLOT)

    def slot_of(self, endpoint: str) -> int | None:
        """The row of ``endpoint`` in :meth:`lookup_rows`; rows change only when
        :attr:`slots_version` does."""
        return self._slot_of.get(endpoint)

    def _walk(self, d: dict[int, int], keys: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """How far each bit (slot and tier) matches ``keys``: ``(bits, length)`` pairs, every
        matching bit in exactly one, in the order they stopped matching."""
        any_of = self._any
        drops: list[tuple[int, int]] = []
        cur = cur_any = 0
        prev: int | None = -1
        i = 0
        # Runs of blocks share one interned mask object, so ``m is prev`` skips
        # most of the bit work; ``map`` stops at the first miss via ``break``.
        for m in map(d.get, keys):
            if m is prev:
                i += 1
                continue
            if m is None:
                break
            prev = m
            if allowed != -1:
                m &= allowed
            if i == 0:
                cur = m
                cur_any = any_of(m)
                if not cur_any:
                    break
                i = 1
                continue
            nxt = cur & m
            if nxt != cur:
                drops.append((cur ^ nxt, i))
                cur = nxt
            nxt_a = cur_any & any_of(m)
            if nxt_a != cur_any:
                drops.append((cur_any ^ nxt_a, i))
                cur_any = nxt_a
                if not cur_any:
                    break
            i += 1
        drops.append((cur | cur_any, i))
        # Keeping LRU order costs a re-insert per matched key; it only matters
        # once eviction is near, so skip it while the index is under half its budget.
        if i and self.touch_on_lookup and self.max_entries and self._entries * 2 > self.max_entries:
            pop = d.pop
            for k in keys[:i]:
                d[k] = pop(k)
        return drops

    def _fill(self, drops: list[tuple[int, int]], result: LookupResult) -> None:
        names = self._slot_names
        for mask, length in drops:
            for pos in _positions(mask):
                slot, tier = pos >> 2, pos & 3
                name = names[slot]
                if name is None:
                    continue
                em = result.matches.get(name)
                if em is None:
                    em = result.matches[name] = EndpointMatch(name)
                if tier == 0:
                    em.combined = max(em.combined, length)
                else:
                    t = _TIER_OF_BIT[tier]
                    em.tiers[t] = max(em.tiers.get(t, 0), length)

    def _spec_lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None,
                     exclude: Iterable[str] | None, result: LookupResult) -> None:
        per_model = self._spec.get(model)
        if not per_model:
            return
        now = self.now()
        allow = set(endpoint_filter) if endpoint_filter else None
        deny = set(exclude) if exclude else set()
        for ep, entries in per_model.items():
            if (allow is not None and ep not in allow) or ep in deny:
                continue
            n = 0
            ttl = float("inf")
            for k in keys:
                e = entries.get(k)
                if e is None or e <= now:
                    break
                ttl = min(ttl, e - now)
                n += 1
            if n:
                em = result.matches.get(ep)
                if em is None:
                    em = result.matches[ep] = EndpointMatch(ep)
                em.speculative = n
                em.speculative_ttl_s = ttl

    # ---- introspection -----------------------------------------------------------
    def endpoint_blocks(self, endpoint: str) -> int:
        with self._lock:
            slot = self._slot_of.get(endpoint)
            return 0 if slot is None else self._slot_entries[slot]

    def endpoints(self) -> list[str]:
        with self._lock:
            return [n for i, n in enumerate(self._slot_names) if n is not None and self._slot_entries[i] > 0]

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                backend=self.name,
                entries=self._entries,
                keys=sum(len(d) for d in self._models.values()),
                endpoints=sum(1 for i, n in enumerate(self._slot_names) if n is not None and self._slot_entries[i] > 0),
                entries_by_tier=dict(self._tier_entries),
                counters={"evicted": self.evicted, "speculative_keys": self._spec_count,
                          "gpu_extra_copies": sum(self._copies.values())},
            )
