"""The disk tier: blocks spilled from RAM, with their own capacity, surviving restarts.

Each block is one file ``<root>/<namespace digest>/<key>.kvb``, written to a temp
file and renamed into place, so a crash never leaves a half-written block
visible. A header carries the namespace, key, chain metadata and the checksum
(XXH3-64, ``kvmesh.kvstore.checksum``) of the data; the header has its own XXH3-64 so
a torn or bit-rotten header is found when the directory is scanned at start-up. The
data checksum is verified on *every* read: a corrupt block is deleted and reported
as a miss, never returned. Files of another format version (version 1 held CRC32Cs)
are dropped at start-up like unreadable ones: their checksums cannot be checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

from kvmesh.kvstore.block import BlockId, CapacityError, StoredBlock, buffer_of
from kvmesh.kvstore.checksum import block_checksum
from kvmesh.kvstore.eviction import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

MAGIC = b"KVMB"
VERSION = 2   # 1: CRC32C checksums (uint32); 2: XXH3-64 (uint64)
# magic, version, has_parent, data checksum, data len, key, parent, block size, depth, ns len, n tokens
_HDR = struct.Struct("<4sBBxxQQQQIIHxxI")
_HDR_SUM = struct.Struct("<Q")   # XXH3-64 of the header before it
SUFFIX = ".kvb"


@dataclass(slots=True)
class DiskEntry:
    size: int
    checksum: int
    path: Path
    depth: int = 0
    session: str = ""


def _ns_dir(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()[:20]


def encode_header(namespace: str, key: int, blk: StoredBlock) -> bytes:
    ns = namespace.encode()
    toks = struct.pack(f"<{len(blk.token_ids)}I", *blk.token_ids)
    head = _HDR.pack(MAGIC, VERSION, blk.parent is not None, blk.checksum, len(buffer_of(blk.data)), key,
                     blk.parent or 0, blk.block_size, blk.depth, len(ns), len(blk.token_ids)) + ns + toks
    return head + _HDR_SUM.pack(block_checksum(head))


class CorruptBlock(Exception):
    pass


def decode_header(buf: bytes) -> tuple[str, int, StoredBlock, int]:
    """Parse a header from the start of ``buf``; return (namespace, key, block-without-data, header len)."""
    if len(buf) < _HDR.size:
        raise CorruptBlock("short header")
    if buf[:4] != MAGIC:
        raise CorruptBlock("bad magic")
    if buf[4] != VERSION:   # checked before the layout, which differs between versions
        raise CorruptBlock(f"format version {buf[4]}, this store reads {VERSION}")
    (_, _, has_parent, csum, dlen, key, parent, block_size, depth, ns_len,
     ntok) = _HDR.unpack_from(buf, 0)
    end = _HDR.size + ns_len + 4 * ntok
    if len(buf) < end + _HDR_SUM.size:
        raise CorruptBlock("short header")
    (hsum,) = _HDR_SUM.unpack_from(buf, end)
    if block_checksum(buf[:end]) != hsum:
        raise CorruptBlock("header checksum mismatch")
    ns = buf[_HDR.size:_HDR.size + ns_len].decode()
    toks = struct.unpack_from(f"<{ntok}I", buf, _HDR.size + ns_len)
    blk = StoredBlock(size=dlen, data=None, checksum=csum, parent=parent if has_parent else None,
                      token_ids=tuple(toks), block_size=block_size, depth=depth)
    return ns, key, blk, end + _HDR_SUM.size


class DiskTier:
    def __init__(self, root: str | os.PathLike[str], capacity: int, policy: EvictionPolicy | None = None,
                 fsync: bool = False) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.fsync = fsync
        self.used = 0
        self.evictions = 0
        self.corrupt = 0
        self._index: dict[BlockId, DiskEntry] = {}
        self._tmp = self.root / "tmp"

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, bid: BlockId) -> bool:
        return bid in self._index

    def __iter__(self):  # noqa: ANN204 - iterator of BlockId
        return iter(self._index)

    def new_batch(self) -> None:
        self.policy.new_batch()

    def open(self) -> list[tuple[BlockId, StoredBlock]]:
        """Create the folders and index what a previous run left; return the recovered blocks (no data)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(exist_ok=True)
        for leftover in self._tmp.iterdir():  # writes a crash interrupted
            leftover.unlink(missing_ok=True)
        found: list[tuple[float, BlockId, StoredBlock, Path]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub == self._tmp:
                continue
            for path in sub.glob(f"*{SUFFIX}"):
                try:
                    st = path.stat()
                    with open(path, "rb") as f:
                        head = f.read(64 * 1024)
                    ns, key, blk, hlen = decode_header(head)
                    if st.st_size != hlen + blk.size or _ns_dir(ns) != sub.name:
                        raise CorruptBlock("size or folder mismatch")
                except (OSError, CorruptBlock, UnicodeDecodeError, struct.error) as exc:
                    log.warning("dropping unreadable disk block", extra={"path": str(path), "reason": str(exc)})
                    self.corrupt += 1
                    path.unlink(missing_ok=True)
                    continue
                found.append((st.st_mtime, (ns, key), blk, path))
        found.sort(key=lambda x: x[0])
        recovered = []
        for _, bid, blk, path in found:
            if self.used + blk.size > self.capacity:
                path.unlink(missing_ok=True)  # capacity shrank since the last run
                continue
            self.policy.new_batch()
            self._index[bid] = DiskEntry(blk.size, blk.checksum, path, blk.depth)
            self.policy.insert(bid, blk.depth)
            self.used += blk.size
            recovered.append((bid, blk))
        return recovered

    def path_for(self, bid: BlockId) -> Path:
        return self.root / _ns_dir(bid[0]) / f"{bid[1]:016x}{SUFFIX}"

    def make_room(self, size: int, protect: frozenset[BlockId] | set[BlockId] = frozenset()) -> list[BlockId]:
        if size > self.capacity:
            raise CapacityError(f"{size} exceeds the disk capacity of {self.capacity}")
        victims: list[BlockId] = []
        while self.used + size > self.capacity:
            bid = self.policy.victim()
            if bid is None:
                raise CapacityError(f"disk cannot free {size} (used {self.used}/{self.capacity})")
            self.remove(bid)
            victims.append(bid)
        self.evictions += len(victims)
        return victims

    def write(self, bid: BlockId, blk: StoredBlock) -> None:
        """Atomically write a block (temp file, then rename). The caller made room first."""
        if blk.data is None:
            raise ValueError("disk tier needs block data")
        path = self.path_for(bid)
        path.parent.mkdir(exist_ok=True)
        tmp = self._tmp / f"{secrets.token_hex(8)}.part"
        with open(tmp, "wb") as f:
            f.write(encode_header(bid[0], bid[1], blk))
            f.write(buffer_of(blk.data))
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        old = self._index.get(bid)
        if old is not None:
            self.used -= old.size
        self._index[bid] = DiskEntry(len(blk.data), blk.checksum, path, blk.depth, blk.session)
        self.used += len(blk.data)
        self.policy.insert(bid, blk.depth, blk.session)

    def read(self, bid: BlockId, session: str = "") -> StoredBlock | None:
        """The block with verified data, or None (missing or corrupt; corrupt files are removed)."""
        ent = self._index.get(bid)
        if ent is None:
            return None
        try:
            with open(ent.path, "rb") as f:
                raw = f.read()
            ns, key, blk, hlen = decode_header(raw)
            data = raw[hlen:]
            if (ns, key) != bid or len(data) != blk.size:
                raise CorruptBlock("identity or length mismatch")
            if block_checksum(data) != blk.checksum or blk.checksum != ent.checksum:
                raise CorruptBlock("data checksum mismatch")
        except (OSError, CorruptBlock, UnicodeDecodeError, struct.error) as exc:
            log.warning("corrupt or unreadable disk block is a miss",
                        extra={"namespace": bid[0], "key": bid[1], "reason": str(exc)})
            self.corrupt += 1
            self.remove(bid)
            return None
        blk.data = data
        blk.session = session or ent.session
        self.policy.touch(bid, ent.depth, session)
        return blk

    def depth_of(self, bid: BlockId) -> int | None:
        ent = self._index.get(bid)
        return None if ent is None else ent.depth

    def touch(self, bid: BlockId, session: str = "") -> None:
        ent = self._index.get(bid)
        if ent is not None:
            self.policy.touch(bid, ent.depth, session)

    def remove(self, bid: BlockId) -> bool:
        ent = self._index.pop(bid, None)
        if ent is None:
            return False
        self.used -= ent.size
        self.policy.remove(bid)
        ent.path.unlink(missing_ok=True)
        return True
