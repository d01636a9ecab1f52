"""The RAM tier: a capacity budget over stored blocks with a pluggable eviction policy.

Synchronous and lock-free by design: the store core serialises access, and the
virtual-time cluster simulator drives it directly (with ``data=None`` blocks and
capacity counted in blocks or tokens instead of bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, KeysView, Sequence

from kvmesh.kvstore.block import BlockId, CapacityError, StoredBlock
from kvmesh.kvstore.eviction import EvictionPolicy, LRUPolicy


class RamTier:
    def __init__(self, capacity: int, policy: EvictionPolicy | None = None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.used = 0
        self._blocks: dict[BlockId, StoredBlock] = {}
        self.evictions = 0
        self._max_size = 1   # the largest block ever held: make_room's batch bound

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, bid: BlockId) -> bool:
        return bid in self._blocks

    def __iter__(self) -> Iterator[BlockId]:
        return iter(self._blocks)

    def keys(self) -> KeysView[BlockId]:
        """The held ids, as a live view (membership at dict speed)."""
        return self._blocks.keys()

    def holds(self) -> Callable[[BlockId], bool]:
        """A live membership test to hand to C loops (``takewhile`` over a prompt's ids): the
        dict's own ``__contains__``, a direct call, where a keys view's goes through a slot
        wrapper at about twice the cost."""
        return self._blocks.__contains__

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def new_batch(self) -> None:
        self.policy.new_batch()

    def peek(self, bid: BlockId) -> StoredBlock | None:
        return self._blocks.get(bid)

    def depth_of(self, bid: BlockId) -> int | None:
        blk = self._blocks.get(bid)
        return None if blk is None else blk.depth

    def get(self, bid: BlockId, session: str = "") -> StoredBlock | None:
        """The block (and a recency touch), or None."""
        blk = self._blocks.get(bid)
        if blk is not None:
            self.policy.touch(bid, blk.depth, session)
        return blk

    def touch(self, bid: BlockId, session: str = "") -> None:
        blk = self._blocks.get(bid)
        if blk is not None:
            self.policy.touch(bid, blk.depth, session)

    def touch_many(self, bids: Iterable[BlockId], session: str = "") -> None:
        """``touch`` each held block, in order (the depth each was stored at is the policy's)."""
        self.policy.touch_many(bids, session)

    def admits(self, size: int, depth: int) -> bool:
        """Whether a block of ``size`` at ``depth`` should be stored: always when it fits,
        else when the policy ranks it above the next victim."""
        if self.used + size <= self.capacity:
            return True
        admits = getattr(self.policy, "admits", None)
        return admits is None or bool(admits(depth))

    def can_fit(self, size: int) -> bool:
        return size <= self.capacity

    def make_room(self, size: int, protect: frozenset[BlockId] | set[BlockId] = frozenset(),
                  allow_evict: bool = True) -> list[tuple[BlockId, StoredBlock]]:
        """Evict until ``size`` fits; return the victims (for demotion).

        All or nothing: a request that cannot be met raises CapacityError before anything
        is evicted, so a refused put costs the store no block (the caller has no victims
        to demote or report, and none is lost unreported)."""
        if size > self.capacity:
            raise CapacityError(f"{size} exceeds the tier capacity of {self.capacity}")
        if self.used + size > self.capacity:
            if not allow_evict:
                raise CapacityError(f"tier full ({self.used}/{self.capacity}) and eviction is disabled")
            blocks = self._blocks
            # The put's held blocks weigh at most this; summing them walks the whole put, so
            # only a put large next to the tier pays for it.
            pinned = len(protect) * self._max_size
            if pinned + size > self.capacity:
                pinned = sum(blocks[b].size for b in protect if b in blocks)
            if pinned + size > self.capacity:
                raise CapacityError(f"tier cannot free {size}: {pinned} of its {self.capacity} hold blocks "
                                    "of this same put")
        victims: list[tuple[BlockId, StoredBlock]] = []
        skipped: list[BlockId] = []
        pop_victims = self.policy.pop_victims
        while self.used + size > self.capacity:
            # No block is larger than _max_size, so each of these victims is still needed
            # when its turn comes: the batch evicts exactly what one-by-one eviction would.
            bids = pop_victims(-(-(self.used + size - self.capacity) // self._max_size))
            if not bids:  # the policy lost track of blocks the tier holds: a bug, not a full tier
                self._restore(skipped)
                raise RuntimeError(f"eviction policy ran dry with {self.used}/{self.capacity} used")
            for bid in bids:
                if bid in protect:
                    # Blocks of the put being committed must not push each other out.
                    skipped.append(bid)
                    continue
                victims.append((bid, self._take(bid)))   # out of the policy already
        self._restore(skipped)
        self.evictions += len(victims)
        return victims

    def _restore(self, bids: list[BlockId]) -> None:
        for bid in bids:
            blk = self._blocks[bid]
            self.policy.insert(bid, blk.depth, blk.session)

    def add(self, bid: BlockId, blk: StoredBlock) -> None:
        """Insert a block; the caller made room first."""
        old = self._blocks.get(bid)
        if old is not None:
            self.used -= old.size
            self.policy.remove(bid)
        self._blocks[bid] = blk
        self.used += blk.size
        self._max_size = max(self._max_size, blk.size)
        self.policy.insert(bid, blk.depth, blk.session)

    def add_many(self, bids: Sequence[BlockId], depths: Sequence[int], session: str, size: int = 1) -> None:
        """Insert metadata-only blocks the tier does not hold yet, in order (one put's new
        blocks, as the cluster simulator stores them); the caller made room first."""
        blocks = self._blocks
        held = next((bid for bid in bids if bid in blocks), None)
        if held is not None:
            raise ValueError(f"block {held!r} is already held; add_many takes new blocks only")
        meta = StoredBlock.metadata
        for bid, depth in zip(bids, depths, strict=True):
            blocks[bid] = meta(size, depth, session)
        self.used += size * len(bids)
        self._max_size = max(self._max_size, size)
        self.policy.insert_many(bids, depths, session)

    def _take(self, bid: BlockId) -> StoredBlock:
        """Drop a block from the budget (the policy's order is the caller's business)."""
        blk = self._blocks.pop(bid)
        self.used -= blk.size
        return blk

    def _pop(self, bid: BlockId) -> StoredBlock:
        blk = self._take(bid)
        self.policy.remove(bid)
        return blk

    def remove(self, bid: BlockId) -> StoredBlock | None:
        if bid not in self._blocks:
            return None
        return self._pop(bid)

    def clear(self) -> None:
        for bid in list(self._blocks):
            self._pop(bid)
