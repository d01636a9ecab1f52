"""Hand-assembled pickle (protocol 5) of the block tuple ``(parent, tokens, extra_keys)``.

vLLM's default ``sha256`` algo digests ``pickle.dumps((parent, tuple(tokens), extra), 5)``.
For the common shape (a bytes parent, >= 4 int32 tokens, a frame under 64 KiB) the C
pickler's output is a fixed layout around the tokens' opcodes, which
:mod:`kvmesh.hashing.token_stream` produces for a whole prompt at once:

``PROTO 5 | FRAME len | (SHORT_)BINBYTES parent MEMOIZE | MARK <ints> TUPLE MEMOIZE |
<extra> | TUPLE3 MEMOIZE STOP``

The extra-keys part is context-free apart from memo indices, which always start at 2
(parent and token tuple come first), so it is cut from a template pickle once per
distinct value. Tests compare every output with ``pickle.dumps`` byte for byte.
"""

from __future__ import annotations

import pickle
from typing import Any

PROTO = b"\x80\x05"
FRAME = b"\x95"
MEMO = b"\x94"
MARK = b"("
TUPLE = b"t"
TAIL = b"\x87\x94."  # TUPLE3 MEMOIZE STOP
NONE = b"N"
MIN_TOKENS = 4  # fewer use TUPLE1/2/3 or EMPTY_TUPLE opcodes
MAX_FRAME = 60_000  # the C pickler splits frames past 64 KiB
_FRAGMENTS: dict[Any, bytes] = {}
_TEMPLATE_TOKENS = (0, 0, 0, 0)
_TOKENS_PICKLE = b"(K\x00K\x00K\x00K\x00t\x94"


def parent_part(parent: bytes) -> bytes:
    n = len(parent)
    if n < 256:
        return b"C" + bytes((n,)) + parent + MEMO
    return b"B" + n.to_bytes(4, "little") + parent + MEMO


def extra_part(extra: tuple[Any, ...] | None) -> bytes:
    if extra is None:
        return NONE
    frag = _FRAGMENTS.get(extra)
    if frag is None:
        full = pickle.dumps((b"\x00" * 32, _TEMPLATE_TOKENS, extra), protocol=5)
        i = full.index(_TOKENS_PICKLE) + len(_TOKENS_PICKLE)
        if not full.endswith(TAIL):
            raise AssertionError("unexpected pickle layout")
        frag = full[i : -len(TAIL)]
        if len(_FRAGMENTS) < 4096:
            _FRAGMENTS[extra] = frag
    return frag


def assemble(parent: bytes, token_ops: bytes, extra: tuple[Any, ...] | None) -> bytes:
    """The full pickle for one block, given its tokens' opcodes (from token_stream)."""
    body = b"".join((parent_part(parent), MARK, token_ops, TUPLE, MEMO, extra_part(extra), TAIL))
    return b"".join((PROTO, FRAME, len(body).to_bytes(8, "little"), body))
