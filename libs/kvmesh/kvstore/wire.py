"""Hand-rolled protobuf encoding of the bulk offload messages (Get responses, Put chunks).

The bytes are exactly what ``offload_pb2`` would produce, so any protobuf client
interoperates; we only skip the generic path's extra copies. Generic protobuf
copies a multi-MiB ``data`` field on assignment, again on serialisation, and
again on parse and attribute access; here the payload is copied once into the
message on the way out and is handed out as a zero-copy ``memoryview`` of the
received message on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh_api.offload.v1 import offload_pb2

_MAX_U64 = (1 << 64) - 1
_MAX_U32 = (1 << 32) - 1


def _u32(value: int, what: str) -> int:
    if value > _MAX_U32:
        raise ValueError(f"{what} exceeds 32 bits")
    return value


def encode_varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (no bound: the fuzzer uses over-long ones)."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    shift = 0
    result = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result > _MAX_U64:
                raise ValueError("varint exceeds 64 bits")
            return result, pos
        shift += 7


def _skip(buf: memoryview, pos: int, end: int, wtype: int) -> int:
    if wtype == 0:
        return _read_varint(buf, pos, end)[1]
    if wtype == 1:
        pos += 8
    elif wtype == 2:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wtype == 5:
        pos += 4
    else:
        raise ValueError(f"unsupported wire type {wtype}")
    if pos > end:
        raise ValueError("truncated field")
    return pos


@dataclass(slots=True)
class Chunk:
    """A decoded ``BlockChunk``; ``data`` is a view of the received message."""

    key: int = 0
    data: memoryview = field(default_factory=lambda: memoryview(b""))
    last: bool = False
    checksum: int = 0
    token_ids: list[int] = field(default_factory=list)
    tier: int = 0


def encode_chunk_parts(key: int, data_len: int, last: bool, checksum: int,
                       token_ids: list[int] | tuple[int, ...] = ()) -> tuple[bytes, bytes]:
    """(prefix, suffix) of a ``BlockChunk`` around ``data_len`` bytes of payload."""
    prefix = b"\x08" + encode_varint(key) + b"\x12" + encode_varint(data_len)
    suffix = bytearray()
    if last:
        suffix += b"\x18\x01"
    if checksum:
        suffix += b"\x20" + encode_varint(checksum)
    if token_ids:
        packed = b"".join(encode_varint(t) for t in token_ids)
        suffix += b"\x2a" + encode_varint(len(packed)) + packed
    return prefix, bytes(suffix)


def encode_get_response(key: int, data: bytes | memoryview, last: bool, checksum: int, tier: int) -> bytes:
    prefix, suffix = encode_chunk_parts(key, len(data), last, checksum)
    clen = len(prefix) + len(data) + len(suffix)
    tail = suffix + (b"\x10" + encode_varint(tier) if tier else b"")
    return b"".join((b"\x0a", encode_varint(clen), prefix, data, tail))


def encode_put_chunk(key: int, data: bytes | memoryview, last: bool, checksum: int,
                     token_ids: list[int] | tuple[int, ...] = ()) -> bytes:
    prefix, suffix = encode_chunk_parts(key, len(data), last, checksum, token_ids)
    clen = len(prefix) + len(data) + len(suffix)
    return b"".join((b"\x12", encode_varint(clen), prefix, data, suffix))


def _decode_chunk(buf: memoryview, pos: int, end: int, out: Chunk) -> None:
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        fnum, wtype = tag >> 3, tag & 7
        if fnum == 1 and wtype == 0:
            out.key, pos = _read_varint(buf, pos, end)
        elif fnum == 2 and wtype == 2:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise ValueError("truncated data field")
            out.data = buf[pos:pos + n]
            pos += n
        elif fnum == 3 and wtype == 0:
            v, pos = _read_varint(buf, pos, end)
            out.last = bool(v)
        elif fnum == 4 and wtype == 0:
            out.checksum, pos = _read_varint(buf, pos, end)   # uint64: _read_varint bounds it
        elif fnum == 5 and wtype == 2:
            n, pos = _read_varint(buf, pos, end)
            stop = pos + n
            if stop > end:
                raise ValueError("truncated token_ids")
            while pos < stop:
                t, pos = _read_varint(buf, pos, stop)
                out.token_ids.append(_u32(t, "token id"))
        elif fnum == 5 and wtype == 0:
            t, pos = _read_varint(buf, pos, end)
            out.token_ids.append(_u32(t, "token id"))
        else:
            pos = _skip(buf, pos, end, wtype)


def decode_get_response(raw: bytes) -> Chunk:
    buf = memoryview(raw)
    end = len(buf)
    pos = 0
    out = Chunk()
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        fnum, wtype = tag >> 3, tag & 7
        if fnum == 1 and wtype == 2:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise ValueError("truncated chunk")
            _decode_chunk(buf, pos, pos + n, out)
            pos += n
        elif fnum == 2 and wtype == 0:
            out.tier, pos = _read_varint(buf, pos, end)
        else:
            pos = _skip(buf, pos, end, wtype)
    return out


def decode_put_request(raw: bytes) -> offload_pb2.PutHeader | Chunk | None:
    """A PutRequest: its header (protobuf), its chunk (zero-copy ``Chunk``) or None if empty."""
    buf = memoryview(raw)
    end = len(buf)
    pos = 0
    result: offload_pb2.PutHeader | Chunk | None = None
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        fnum, wtype = tag >> 3, tag & 7
        if fnum in (1, 2) and wtype == 2:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise ValueError("truncated PutRequest")
            if fnum == 1:
                result = offload_pb2.PutHeader.FromString(bytes(buf[pos:pos + n]))
            else:
                result = Chunk()
                _decode_chunk(buf, pos, pos + n, result)
            pos += n
        else:
            pos = _skip(buf, pos, end, wtype)
    return result
