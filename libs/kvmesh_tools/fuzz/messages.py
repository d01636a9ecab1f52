"""Random and mutated protobuf messages for any message type, from its descriptor.

Why: a hostile client sends whatever bytes it likes. The generator fills every
kind of field (scalars at their edges, long and odd strings, big repeated
fields, unknown enum values, nested messages, maps, oneofs), and the mutator
damages the serialized form (bit flips, truncation, junk, varints over 64
bits, wrong wire types), so servers see both well-formed nonsense and bytes
that do not parse.
"""

from __future__ import annotations

import random
from typing import Any

from google.protobuf import descriptor as _d
from google.protobuf import message as _message
from google.protobuf import message_factory

from kvmesh.kvstore.wire import encode_varint

_INT_EDGES = {
    "i32": [0, 1, -1, 2**31 - 1, -(2**31)],
    "i64": [0, 1, -1, 2**63 - 1, -(2**63), 10**12],
    "u32": [0, 1, 2**32 - 1, 2**31],
    "u64": [0, 1, 2**64 - 1, 2**63, 10**12],
}
_STRINGS = ["", "a", "any", "*", "kvmesh-slab-1-0", "../../etc/passwd", "kv@e0@m", "\x00\x01", "é漢字🙂",
            "tcp://*:1", "tcp://0.0.0.0:1", "x" * 300, " "]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e308, -1e308, float("inf"), float("-inf"), float("nan"), 1e-300]

_KIND: dict[int, str] = {
    _d.FieldDescriptor.TYPE_INT32: "i32", _d.FieldDescriptor.TYPE_SINT32: "i32", _d.FieldDescriptor.TYPE_SFIXED32: "i32",
    _d.FieldDescriptor.TYPE_INT64: "i64", _d.FieldDescriptor.TYPE_SINT64: "i64", _d.FieldDescriptor.TYPE_SFIXED64: "i64",
    _d.FieldDescriptor.TYPE_UINT32: "u32", _d.FieldDescriptor.TYPE_FIXED32: "u32",
    _d.FieldDescriptor.TYPE_UINT64: "u64", _d.FieldDescriptor.TYPE_FIXED64: "u64",
}
_RANGES = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1), "u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1)}


class MessageGenerator:
    """Random instances of message types; ``max_repeated`` bounds list lengths, ``max_bytes`` blobs."""

    def __init__(self, rng: random.Random, max_depth: int = 4, max_repeated: int = 64,
                 max_bytes: int = 64 * 1024) -> None:
        self.rng = rng
        self.max_depth = max_depth
        self.max_repeated = max_repeated
        self.max_bytes = max_bytes

    def message(self, desc: _d.Descriptor, depth: int = 0) -> _message.Message:
        msg = message_factory.GetMessageClass(desc)()
        self.fill(msg, depth)
        return msg

    def fill(self, msg: _message.Message, depth: int) -> None:
        desc = msg.DESCRIPTOR
        oneof_done: set[str] = set()
        for f in desc.fields:
            if self.rng.random() < 0.35:
                continue  # leave unset: defaults matter too
            oneof = f.containing_oneof
            if oneof is not None:
                if oneof.name in oneof_done:
                    continue
                oneof_done.add(oneof.name)
            try:
                self._set(msg, f, depth)
            except (ValueError, TypeError):
                continue  # e.g. a value the runtime refuses for this type (invalid UTF-8 string)

    def _count(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.randint(0, 3)
        if r < 0.9:
            return self.rng.randint(0, 16)
        return self.rng.randint(0, self.max_repeated)

    def _set(self, msg: _message.Message, f: _d.FieldDescriptor, depth: int) -> None:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            if depth >= self.max_depth:
                return
            container = getattr(msg, f.name)
            key_f, val_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            for _ in range(self._count()):
                k = self.scalar(key_f)
                if val_f.message_type is not None:
                    self.fill(container[k], depth + 1)
                else:
                    container[k] = self.scalar(val_f)
            return
        repeated = f.is_repeated
        if f.message_type is not None:
            if depth >= self.max_depth:
                return
            if repeated:
                container = getattr(msg, f.name)
                for _ in range(min(self._count(), 8 if depth else 32)):
                    self.fill(container.add(), depth + 1)
            else:
                sub = getattr(msg, f.name)
                self.fill(sub, depth + 1)
                sub.SetInParent()
            return
        if repeated:
            getattr(msg, f.name).extend(self.scalar(f) for _ in range(self._count()))
        else:
            setattr(msg, f.name, self.scalar(f))

    def scalar(self, f: _d.FieldDescriptor) -> Any:
        rng = self.rng
        t = f.type
        if t == _d.FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t == _d.FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in f.enum_type.values]
            # Open enums take unknown numbers too.
            return rng.choice(values) if rng.random() < 0.8 else rng.choice([-1, 99, 2**31 - 1])
        if t in (_d.FieldDescriptor.TYPE_FLOAT, _d.FieldDescriptor.TYPE_DOUBLE):
            v = rng.choice(_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6)
            return max(min(v, 3e38), -3e38) if t == _d.FieldDescriptor.TYPE_FLOAT and v == v else v
        if t == _d.FieldDescriptor.TYPE_STRING:
            return self._string()
        if t == _d.FieldDescriptor.TYPE_BYTES:
            n = rng.choice([0, 1, 8, 16, 64, rng.randint(0, self.max_bytes)])
            return rng.randbytes(n)
        kind = _KIND[t]
        if rng.random() < 0.5:
            return rng.choice(_INT_EDGES[kind])
        lo, hi = _RANGES[kind]
        return rng.randint(max(lo, -1000), min(hi, 100_000)) if rng.random() < 0.5 else rng.randint(lo, hi)

    def _string(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.4:
            return rng.choice(_STRINGS)
        if r < 0.8:
            return "".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 40)))
        if r < 0.95:
            return "".join(chr(rng.choice([rng.randint(1, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                           for _ in range(rng.randint(1, 40)))
        return "n" * rng.choice([4096, 65536, 1 << 20])


def mutate(raw: bytes, rng: random.Random) -> bytes:
    """Damaged bytes: the parser may accept them (as other values) or refuse them."""
    op = rng.randrange(7)
    buf = bytearray(raw)
    if op == 0 and buf:                               # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:                             # truncate
        del buf[rng.randrange(len(buf)):]
    elif op == 2:                                     # append junk
        buf += rng.randbytes(rng.randint(1, 64))
    elif op == 3:                                     # an overlong varint (11 bytes: over 64 bits) in field 1..15
        buf += bytes([(rng.randint(1, 15) << 3) | 0]) + b"\xff" * 10 + b"\x01"
    elif op == 4:                                     # a length prefix larger than what follows
        buf += bytes([(rng.randint(1, 15) << 3) | 2]) + encode_varint(rng.randint(1 << 20, 1 << 30))
    elif op == 5:                                     # a varint key just over 2^64 in field 1..8
        buf += bytes([(rng.randint(1, 8) << 3) | 0]) + encode_varint((1 << 64) + rng.randint(0, 1 << 20))
    else:                                             # nothing like a message
        buf = bytearray(rng.randbytes(rng.randint(0, 256)))
    return bytes(buf)
