"""Incremental block hashing for append-only agent contexts.

An agent's next turn is its previous prompt plus ~600 new tokens, on top of
100k–200k tokens of context. Re-hashing the whole chain every turn costs tens
of milliseconds; this cache keeps recent chains (tokens, digests, event keys)
and, for a new prompt, reuses the longest verified common prefix and hashes
only the blocks after it — resuming the hash chain from the last reused digest
with the right global block index, so ``cache_salt`` (first block only), LoRA
and the seed give exactly the engine's hashes.

A previous chain is found by session id (the fast path) or by content: chains
are also indexed by the digest of their first block, which already folds in the
tenant salt and LoRA, so two tenants never share an entry. Memory is bounded
by ``max_bytes`` (an estimate: a chain keeps its prompt's token ids by reference, 36 bytes
a token in a Python list) and by ``max_blocks``, across all chains, least recently used
dropped first. A session that ended keeps its last chain until it is the oldest: without
the byte bound, a router serving short-lived agent sessions grew by gigabytes before the
block bound was reached.

Verifying that the old prefix is really unchanged is the only O(n) step left.
``verify="full"`` compares every token (≈2 ms for 200k tokens in CPython);
``verify="sampled"`` (default) compares the whole last block of the prefix plus
``verify_samples`` positions spread across it at a random phase, then binary
searches the divergence point the same way. Agent frameworks either append or
rewrite large spans (compaction), both of which sampling catches; a single
token edited in the middle of an unchanged-length context may be missed, and
would show up as a predicted-vs-actual cached-tokens mismatch in the metrics.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.hashing import BlockHasher, ExtraKeys, event_key


@dataclass
class HashCacheConfig:
    enabled: bool = field(default=True, metadata={"help": "reuse hashes of earlier prompts (incremental hashing)"})
    max_blocks: int = field(default=2_000_000, metadata={"help": "blocks kept across all cached chains"})
    max_bytes: int = field(default=256 << 20, metadata={
        "help": "estimated memory of all cached chains (token ids, digests, keys)"})
    max_per_head: int = field(default=32, metadata={"help": "chains kept per first-block digest"})
    verify: str = field(default="sampled", metadata={"help": "prefix check: sampled | full"})
    verify_samples: int = field(default=64, metadata={"help": "token positions compared when sampled"})
    max_content_checks: int = field(default=4, metadata={"help": "recent same-head chains tried by content"})

    def validate(self) -> None:
        if self.verify not in ("sampled", "full"):
            raise ValueError(f"hash cache verify must be 'sampled' or 'full', got {self.verify!r}")


class ConcatTokens(Sequence[int]):
    """``a + b`` without copying: a prompt (list or protobuf repeated field) plus its output.

    Copying a 200k-token protobuf field into a list costs ~10 ms; the hash cache only
    needs ``len``, indexing and short slices, which this view gives in O(slice).
    """

    __slots__ = ("a", "b", "_na")

    def __init__(self, a: Sequence[int], b: Sequence[int]) -> None:
        self.a, self.b, self._na = a, b, len(a)

    def __len__(self) -> int:
        return self._na + len(self.b)

    def __getitem__(self, i):  # type: ignore[override]
        na = self._na
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            out = list(self.a[start:min(stop, na)]) if start < na else []
            if stop > na:
                out += list(self.b[max(start - na, 0): stop - na])
            return out
        if i < 0:
            i += len(self)
        return self.a[i] if i < na else self.b[i - na]


# Per block: a 32-byte digest (bytes object), a 64-bit key (int object), two list slots.
_BLOCK_BYTES = 65 + 36 + 16
# Per token: a Python list holds an int object (28 bytes) and a slot (8) for each; a protobuf
# repeated field or an array packs them (4 bytes, rounded up for the message around them).
_LIST_TOKEN_BYTES = 36
_PACKED_TOKEN_BYTES = 8


def token_bytes(tokens: Sequence[int]) -> int:
    """Estimated memory a sequence of token ids keeps alive."""
    if isinstance(tokens, ConcatTokens):
        return token_bytes(tokens.a) + token_bytes(tokens.b)
    per = _LIST_TOKEN_BYTES if isinstance(tokens, list | tuple) else _PACKED_TOKEN_BYTES
    return per * len(tokens)


class _Chain:
    __slots__ = ("tokens", "n_blocks", "digests", "keys", "head", "session", "nbytes")

    def __init__(self, tokens: Sequence[int], n_blocks: int, digests: list[bytes], keys: list[int],
                 head: bytes, session: tuple | None) -> None:
        self.tokens = tokens
        self.n_blocks = n_blocks
        self.digests = digests
        self.keys = keys
        self.head = head
        self.session = session
        self.nbytes = token_bytes(tokens) + n_blocks * _BLOCK_BYTES


@dataclass
class ChainResult:
    keys: list[int]
    digests: list[bytes]
    reused_blocks: int
    hashed_blocks: int
    source: str   # session | content | none | disabled


class HashCache:
    """Block-key chains of recent prompts, reused for prompts that extend them."""

    def __init__(self, hasher: BlockHasher, cfg: HashCacheConfig | None = None, seed: int | None = None) -> None:
        self.hasher = hasher
        self.cfg = cfg or HashCacheConfig()
        self.cfg.validate()
        self._lru: OrderedDict[int, _Chain] = OrderedDict()
        self._heads: dict[bytes, list[_Chain]] = {}
        self._sessions: dict[tuple, _Chain] = {}
        self._blocks = 0
        self._bytes = 0
        # Superseded chains, freed by release() off the decision path: dropping the last
        # reference to a 200k-token list costs ~0.5 ms of decrefs.
        self._graveyard: list[_Chain] = []
        self._rng = random.Random(seed)
        self.stats = {"lookups": 0, "reused_blocks": 0, "hashed_blocks": 0}

    @property
    def blocks(self) -> int:
        return self._blocks

    @property
    def nbytes(self) -> int:
        """Estimated memory of the cached chains."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    # -- public ---------------------------------------------------------------
    def chain(self, tokens: Sequence[int], extra: ExtraKeys | None = None, session_id: str = "") -> ChainResult:
        """Digests and event keys of every full block of ``tokens`` (as the engine computes them).

        ``tokens`` may be a list, a protobuf repeated field or a :class:`ConcatTokens`; it is
        kept by reference (not copied) for later prefix checks, so it must not be mutated.
        """
        bs = self.hasher.block_size
        n_full = len(tokens) // bs
        self.stats["lookups"] += 1
        if not self.cfg.enabled or (extra is not None and extra.mm):
            # Multimodal offsets are global positions over the whole prompt; not worth caching.
            digests = self.hasher.block_digests(tokens[: n_full * bs], extra)
            return ChainResult([event_key(d) for d in digests], digests, 0, len(digests), "disabled")
        if n_full == 0:
            return ChainResult([], [], 0, 0, "none")
        head = self.hasher.block_digests(tokens[:bs], extra)[0]
        ns = (extra.cache_salt, extra.lora_name, extra.lora_path) if extra else (None, None, None)
        skey = (ns, session_id) if session_id else None

        best: _Chain | None = None
        best_len = 0
        source = "none"
        cands: list[tuple[str, _Chain]] = []
        if skey is not None and skey in self._sessions:
            cands.append(("session", self._sessions[skey]))
        # Most recent first, and only a few: each check is O(log n) but not free.
        cands += [("content", c) for c in self._heads.get(head, ())[: self.cfg.max_content_checks]]
        seen: set[int] = set()
        for src, c in cands:
            if id(c) in seen or c.head != head:
                continue
            seen.add(id(c))
            n = self._common_blocks(c, tokens, n_full)
            if n > best_len:
                best, best_len, source = c, n, src
                if n == n_full:
                    break

        if best is not None and best_len > 0:
            new = self.hasher.block_digests(tokens[best_len * bs: n_full * bs], extra,
                                            parent=best.digests[best_len - 1], first_block_index=best_len)
            digests = best.digests[:best_len] + new
            keys = best.keys[:best_len] + [event_key(d) for d in new]
        else:
            rest = self.hasher.block_digests(tokens[bs: n_full * bs], extra, parent=head, first_block_index=1)
            digests = [head, *rest]
            keys = [event_key(d) for d in digests]
            source = "none"
        hashed = n_full - best_len
        self.stats["reused_blocks"] += best_len
        self.stats["hashed_blocks"] += hashed
        # A chain fully contained in the new one is superseded by it; so is the session's
        # previous chain when the session moved on (e.g. a re-rendered assistant turn).
        if best is not None and (best_len == best.n_blocks or source == "session"):
            self._drop(best)
        elif best is not None:
            self._lru.move_to_end(id(best))
        self._add(_Chain(tokens, n_full, digests, keys, head, skey))
        return ChainResult(keys, digests, best_len, hashed, source)

    def release(self) -> None:
        """Free superseded chains (call after the request was routed, e.g. on completion)."""
        self._graveyard.clear()

    def clear(self) -> None:
        self._lru.clear()
        self._heads.clear()
        self._sessions.clear()
        self._blocks = 0
        self._bytes = 0

    # -- internals -------------------------------------------------------------
    def _common_blocks(self, c: _Chain, tokens: Sequence[int], n_full: int) -> int:
        limit = min(c.n_blocks, n_full)
        if limit == 0:
            return 0
        if self._equal_upto(c.tokens, tokens, limit):
            return limit
        # Binary search the last block count for which the prefixes agree.
        lo, hi = 0, limit - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._equal_upto(c.tokens, tokens, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _equal_upto(self, a: Sequence[int], b: Sequence[int], n_blocks: int) -> bool:
        """Do ``a`` and ``b`` agree on their first ``n_blocks`` blocks?"""
        bs = self.hasher.block_size
        end = n_blocks * bs
        if self.cfg.verify == "full":
            return a[:end] == b[:end]
        if a[end - bs: end] != b[end - bs: end]:
            return False
        k = min(self.cfg.verify_samples, end)
        if k <= 0:
            return True
        step = end / k
        phase = self._rng.random() * step
        for i in range(k):
            p = int(phase + i * step)
            if a[p] != b[p]:
                return False
        return True

    def _add(self, c: _Chain) -> None:
        self._lru[id(c)] = c
        lst = self._heads.setdefault(c.head, [])
        lst.insert(0, c)
        if len(lst) > self.cfg.max_per_head:
            self._drop(lst[-1])
        if c.session is not None:
            old = self._sessions.get(c.session)
            self._sessions[c.session] = c
            if old is not None and old is not c and id(old) in self._lru:
                # The session moved on (e.g. after a compaction); its old chain is only content-reachable.
                old.session = None
        self._blocks += c.n_blocks
        self._bytes += c.nbytes
        while (self._blocks > self.cfg.max_blocks or self._bytes > self.cfg.max_bytes) and len(self._lru) > 1:
            _, victim = next(iter(self._lru.items()))
            self._drop(victim)

    def _drop(self, c: _Chain) -> None:
        if self._lru.pop(id(c), None) is None:
            return
        self._graveyard.append(c)
        if len(self._graveyard) > 64:
            del self._graveyard[:32]
        self._blocks -= c.n_blocks
        self._bytes -= c.nbytes
        lst = self._heads.get(c.head)
        if lst is not None:
            try:
                lst.remove(c)
            except ValueError:
                pass
            if not lst:
                del self._heads[c.head]
        if c.session is not None and self._sessions.get(c.session) is c:
            del self._sessions[c.session]
