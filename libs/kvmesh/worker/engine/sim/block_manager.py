"""A paged KV block manager with prefix caching that evicts exactly like vLLM 0.32.

Why it exists: the sim engine and the virtual-time cluster simulator must hold,
hit and evict the same blocks a real vLLM would, so that the KV events an
indexer sees (and hence routing decisions) are indistinguishable. This module
is synchronous and I/O-free; it mirrors ``vllm/v1/core/block_pool.py`` and the
full-attention path of ``kv_cache_manager.py`` / ``single_type_kv_cache_manager.py``:

- Block 0 is vLLM's *null block*: never allocated, never freed, and excluded
  from the usage figure. ``num_blocks`` therefore includes it, as vLLM's
  ``num_gpu_blocks`` does.
- The free queue starts as blocks 1..N-1 in id order. Allocation pops from the
  front; a popped block that still carries a cached hash is evicted then
  (``BlockRemoved``).
- Freeing a request walks its blocks tail first: blocks that carry a hash
  are *appended* (LRU: evicted last, a request's tail before its head), blocks
  without a hash are *prepended* (reused first).
- A prefix hit *touches* the blocks: a block with ``ref_cnt == 0`` leaves the
  free queue. The hit length is capped at ``num_tokens - 1`` so the last token
  is always recomputed (vLLM needs its logits).
- Blocks are cached (and ``BlockStored`` emitted) when slots are allocated, up
  to ``min(computed + new, num_tokens)`` tokens, not when the step finishes.
- Identical blocks computed concurrently are *not* de-duplicated: the hash maps
  to several blocks and evicting one of them emits ``BlockRemoved`` for it.

Hashes are opaque ``int`` keys (vLLM's 64-bit event form). Hashing tokens is
the caller's job (``kvmesh.hashing``), so the cluster simulator can feed
precomputed chains. Events are small slotted records (``Stored``/``Removed``/
``Cleared``) that carry token *ranges* and the caller's ``meta`` object; the
engine turns them into vLLM wire events only when it publishes them.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, takewhile
from operator import countOf, is_not
from typing import Any

_not_none = partial(is_not, None)

NULL_BLOCK = 0
_HITS_KEPT = 256   # prompts find_longest_hit remembers (a bound on the lists it keeps alive)
_DROP_LOG_MAX = 1 << 14   # evictions find_longest_hit can check (a fleet runs hundreds of managers)
_QUEUE_SLACK = 4096       # stale free-queue entries tolerated on top of one per free block


@dataclass(slots=True)
class Stored:
    """A run of blocks of one request became cached (vLLM ``BlockStored``)."""

    request_id: str
    block_hashes: list[int]
    parent_block_hash: int | None
    token_start: int          # token range [start, end) of the request the blocks hold
    token_end: int
    block_ids: list[int]
    meta: Any = None          # the request's ``meta`` (tokens, lora, salt) as given to ``add_request``


@dataclass(slots=True)
class Removed:
    """One cached block was evicted (vLLM ``BlockRemoved``; one hash per event)."""

    block_hash: int
    block_id: int


@dataclass(slots=True)
class Cleared:
    """The whole prefix cache was reset (vLLM ``AllBlocksCleared``)."""


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class _Req:
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    meta: Any = None


class BlockManager:
    """Prefix-caching paged block pool (one full-attention KV cache group)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_events: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # hash -> the block a lookup returns; further blocks holding the same hash
        # (vLLM does not de-duplicate) wait in _dups, in insertion order.
        self._cached: dict[int, int] = {}
        self._dups: dict[int, list[int]] = {}
        # The free queue, front = next to be handed out (evicted); null block 0 is never in it.
        # vLLM keeps a doubly linked list. Here it is a deque of segments [id, blocks, next
        # position], one per free() call: a request's freed blocks join it as one list, and a
        # touched block leaves it by its ref count alone. A block's entry is live while its
        # ref count is 0 and it is the block's latest (_seg_of); other entries are skipped.
        self._segs: deque[list[Any]] = deque([[0, list(range(1, num_blocks)), 0]])
        self._seg_of = [0] * num_blocks
        self._next_seg = 1
        self._num_free = num_blocks - 1
        self._queued = num_blocks - 1    # entries in the segments not yet passed, stale ones included
        self._ref[NULL_BLOCK] = 1
        self._reqs: dict[str, _Req] = {}
        self._events: list[Event] = []
        # Cumulative prefix-cache counters in tokens (vllm:prefix_cache_queries/hits).
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0        # cached blocks dropped to make room (BlockRemoved count)
        # find_longest_hit's memory. A waiting request's prompt is looked up at every step that
        # reaches it. Its known prefix stays cached in the same blocks until one of those blocks
        # loses its hash, so a lookup checks only the evictions since the last one (each logged
        # with the block's depth in its prompt: one comparison tells whether it was this
        # prefix's), cuts the prefix there, and goes on from its end.
        self._dropped = 0         # hashes removed or remapped so far (the drop log's end)
        self._log_base = 0        # _dropped at the drop log's first entry
        self._drop_blocks = array("i")
        self._drop_depths = array("i")
        self._depth = [0] * num_blocks   # a cached block's index in the prompt that cached it
        self._hits: dict[int, tuple[Sequence[int], int, list[int]]] = {}   # id(prompt) -> (prompt, _dropped, ids)
        # blocks_to_allocate's memory: the last hit list it counted and how many of its blocks
        # were free (ref 0), valid until some block's ref count leaves or reaches 0 elsewhere
        # than a fresh block's allocation (which never holds a listed hit: that would evict it).
        self._ref_epoch = 0
        self._zeros: tuple[Sequence[int] | None, int, int] = (None, -1, 0)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return self._num_free

    @property
    def usage(self) -> float:
        """KV usage in [0, 1], excluding the null block, as vLLM reports it."""
        total = self.num_blocks - 1
        return 1.0 - self._num_free / total if total else 0.0

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def request_blocks(self, request_id: str) -> list[int]:
        r = self._reqs.get(request_id)
        return list(r.blocks) if r else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (front first). For tests and debugging."""
        ref, seg_of = self._ref, self._seg_of
        return [b for sid, blocks, pos in self._segs for b in islice(blocks, pos, None)
                if ref[b] == 0 and seg_of[b] == sid]

    def has_pending_events(self) -> bool:
        """KV events emitted and not yet taken (what an index fed by them has not seen)."""
        return bool(self._events)

    def find_longest_hit(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix, capped so one token is left to compute.

        ``num_tokens`` is the request's current total length (prompt + output so far). The list
        may be the one remembered for the next lookup: callers must not change it. Hashes are
        chained, as vLLM's (each covers its parent), so a hash sits at the same index in every
        prompt that holds it; the remembered prefix relies on that (see ``_drop_depths``).
        """
        if not self.enable_caching:
            return []
        max_blocks = min(len(block_hashes), max(0, (num_tokens - 1) // self.block_size))
        known = self._hits.get(id(block_hashes))
        dropped = self._dropped
        if known is not None and known[0] is block_hashes and known[1] >= self._log_base:
            hit = known[2]
            since = dropped - known[1]
            if since and 2 * since >= len(hit):
                hit = []   # many evictions since: scanning the prompt again costs less
            elif since:
                cut = len(hit)
                base = self._log_base
                blocks = self._drop_blocks
                for j, d in enumerate(islice(self._drop_depths, known[1] - base, dropped - base), known[1] - base):
                    if d < cut and hit[d] == blocks[j]:
                        cut = d
                if cut < len(hit):
                    hit = hit[:cut]
            if len(hit) >= max_blocks:
                if since:
                    self._hits[id(block_hashes)] = (block_hashes, dropped, hit)
                return hit if len(hit) == max_blocks else hit[:max_blocks]
        else:
            hit = []
        # C-speed scan: map lookups until the first miss.
        more = list(takewhile(_not_none, map(self._cached.get, islice(block_hashes, len(hit), max_blocks))))
        if more:
            hit = hit + more   # a new list: a returned one never changes
        if len(self._hits) >= _HITS_KEPT:
            self._hits.clear()
        self._hits[id(block_hashes)] = (block_hashes, dropped, hit)
        return hit

    def count_hit(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Record a lookup for the prefix-cache metrics (vLLM counts prompt tokens)."""
        self.queries_tokens += num_query_tokens
        self.hits_tokens += num_hit_tokens

    # ------------------------------------------------------------------ allocation

    def blocks_to_allocate(self, request_id: str, num_tokens: int, hit_blocks: Sequence[int] = ()) -> int:
        """Free blocks an ``allocate`` of ``num_tokens`` slots would consume."""
        r = self._reqs.get(request_id)
        have = len(r.blocks) if r else len(hit_blocks)
        need = -(-num_tokens // self.block_size) - have
        need = max(need, 0)
        if r is None and hit_blocks:
            # Hit blocks sitting in the free queue (ref 0) leave it when touched. A request that
            # cannot get its blocks asks again at every step with the same hit list.
            zl, epoch, zeros = self._zeros
            if zl is not hit_blocks or epoch != self._ref_epoch:
                zeros = countOf(map(self._ref.__getitem__, hit_blocks), 0)
                self._zeros = (hit_blocks, self._ref_epoch, zeros)
            need += zeros
        return need

    def allocate(self, request_id: str, num_tokens: int, hit_blocks: Sequence[int] = (),
                 reserve: int = 0, meta: Any = None) -> bool:
        """Give the request slots for ``num_tokens`` tokens in total.

        On the request's first allocation ``hit_blocks`` (from
        ``find_longest_hit``) are touched and become its leading blocks. Returns
        False, changing nothing, when fewer than ``needed + reserve`` blocks are free.
        """
        r = self._reqs.get(request_id)
        if r is not None and len(r.blocks) * self.block_size >= num_tokens:
            return True    # decode fast path: the slot already exists
        if self.blocks_to_allocate(request_id, num_tokens, hit_blocks) + reserve > self._num_free:
            return False
        if r is None:
            r = _Req(meta=meta)
            self._reqs[request_id] = r
            if hit_blocks:
                self._touch(hit_blocks)
                r.blocks.extend(hit_blocks)
                r.num_cached_blocks = len(hit_blocks)
        need = -(-num_tokens // self.block_size) - len(r.blocks)
        if need > 0:
            r.blocks.extend(self._get_new_blocks(need))
        return True

    def _touch(self, blocks: Sequence[int]) -> None:
        ref = self._ref
        left = 0   # blocks leaving the free queue (their entries turn stale)
        for b in blocks:
            if ref[b] == 0:
                left += 1
            ref[b] += 1
        if left:
            self._num_free -= left
            self._ref_epoch += 1

    def _get_new_blocks(self, n: int) -> list[int]:
        if n > self._num_free:
            raise IndexError(f"{n} blocks asked of {self._num_free} free")
        ref = self._ref
        seg_of = self._seg_of
        segs = self._segs
        seg = segs[0]
        sid, blocks, pos = seg
        out: list[int] = []
        passed = 0
        while len(out) < n:
            if pos >= len(blocks):
                passed += pos - seg[2]
                segs.popleft()
                seg = segs[0]
                sid, blocks, pos = seg
                continue
            b = blocks[pos]
            pos += 1
            if ref[b] == 0 and seg_of[b] == sid:
                ref[b] = 1
                out.append(b)
        self._queued -= passed + pos - seg[2]
        seg[2] = pos
        self._num_free -= n
        self._evict(out)
        return out

    def _evict(self, blocks: list[int]) -> None:
        """Drop the cached hashes of ``blocks`` (just taken off the free queue), in order."""
        hashes = self._hash
        cached = self._cached
        dups_of = self._dups
        log_blocks = self._drop_blocks
        log_depths = self._drop_depths
        depth = self._depth
        events = self._events if self.enable_events else None
        removed = 0
        for b in blocks:
            h = hashes[b]
            if h is None:
                continue
            hashes[b] = None
            if cached.get(h) == b:
                dups = dups_of.get(h)
                if dups:
                    cached[h] = dups.pop(0)
                    if not dups:
                        del dups_of[h]
                else:
                    del cached[h]
            else:
                dups = dups_of.get(h)
                if not dups or b not in dups:
                    continue
                dups.remove(b)
                if not dups:
                    del dups_of[h]
            removed += 1
            if len(log_blocks) >= _DROP_LOG_MAX:
                # Forget the older half: a prefix remembered before it is looked up from the start.
                half = len(log_blocks) // 2
                del log_blocks[:half]
                del log_depths[:half]
                self._log_base += half
            log_blocks.append(b)
            log_depths.append(depth[b])
            if events is not None:
                events.append(Removed(h, b))
        self.evictions += removed
        self._dropped += removed

    def cache_blocks(self, request_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_tokens`` tokens; emit one ``Stored``.

        ``block_hashes`` must hold at least ``num_tokens // block_size`` keys.
        """
        if not self.enable_caching:
            return
        r = self._reqs[request_id]
        start = r.num_cached_blocks
        end = num_tokens // self.block_size
        if start >= end:
            return
        if len(block_hashes) < end:
            raise ValueError(f"request {request_id}: {len(block_hashes)} block hashes, {end} full blocks")
        blocks = r.blocks
        hashes = self._hash
        cached = self._cached
        new_ids = blocks[start:end]
        new_hashes = list(block_hashes[start:end])
        depth = self._depth
        for i, (b, h) in enumerate(zip(new_ids, new_hashes, strict=True), start):
            hashes[b] = h
            depth[b] = i
            first = cached.get(h)
            if first is None:
                cached[h] = b
            elif first != b:
                dups = self._dups.setdefault(h, [])
                if b not in dups:
                    dups.append(b)
        r.num_cached_blocks = end
        if self.enable_events:
            parent = block_hashes[start - 1] if start > 0 else None
            bs = self.block_size
            self._events.append(Stored(request_id, new_hashes, parent, start * bs, end * bs, new_ids, r.meta))

    def free(self, request_id: str) -> bool:
        """Release the request's blocks, tail first; returns False if unknown."""
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        ref = self._ref
        hashes = self._hash
        first: list[int] = []
        last: list[int] = []
        caching = self.enable_caching
        for b in reversed(r.blocks):
            if b == NULL_BLOCK:
                continue
            n = ref[b] = ref[b] - 1
            if n == 0:
                if hashes[b] is None or not caching:
                    first.append(b)
                else:
                    last.append(b)
        if first or last:
            self._ref_epoch += 1
            self._enqueue(first, front=True)   # vLLM's prepend_n: first[0] at the very front
            self._enqueue(last, front=False)
        return True

    def _enqueue(self, blocks: list[int], front: bool) -> None:
        if not blocks:
            return
        sid = self._next_seg
        self._next_seg += 1
        seg_of = self._seg_of
        for b in blocks:
            seg_of[b] = sid
        if front:
            self._segs.appendleft([sid, blocks, 0])
        else:
            self._segs.append([sid, blocks, 0])
        self._num_free += len(blocks)
        self._queued += len(blocks)
        if self._queued > 2 * self._num_free + _QUEUE_SLACK:
            # Mostly stale entries (blocks hit while free): keep only the live ones, in order.
            live = self.free_queue()
            sid = self._next_seg
            self._next_seg += 1
            for b in live:
                seg_of[b] = sid
            self._segs = deque([[sid, live, 0]])
            self._queued = len(live)

    def reset(self) -> bool:
        """Drop every cached hash (vLLM ``reset_prefix_cache``); only when nothing is in use."""
        if self._num_free != self.num_blocks - 1:
            return False
        self._cached.clear()
        self._dups.clear()
        self._dropped += 1
        self._log_base = self._dropped   # every remembered prefix is gone
        del self._drop_blocks[:]
        del self._drop_depths[:]
        self._hash = [None] * self.num_blocks
        if self.enable_events:
            self._events.append(Cleared())
        return True

    def take_events(self) -> list[Event]:
        ev = self._events
        self._events = []
        return ev
