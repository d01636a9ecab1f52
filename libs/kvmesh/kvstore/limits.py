"""What the offload store accepts as a namespace, session id and block key.

Why one module: the client checks what its caller passes and the store checks
every request at the door with the same rules, so a value one side accepts can
never break the other later (a 1 MB namespace in every event, a key that no
longer packs into 64 bits). Namespaces are printable ASCII without spaces
(model ids and paths fit), at most ``MAX_NAMESPACE_BYTES``.
"""

from __future__ import annotations

import hashlib
import re

MAX_U64 = (1 << 64) - 1
MAX_U32 = (1 << 32) - 1
MAX_NAMESPACE_BYTES = 256
MAX_SESSION_BYTES = 256
NAMESPACE_RE = re.compile(r"^[\x21-\x7e]{1," + str(MAX_NAMESPACE_BYTES) + r"}\Z")
SESSION_RE = re.compile(r"^[\x20-\x7e]{0," + str(MAX_SESSION_BYTES) + r"}\Z")


def namespace_problem(namespace: object) -> str | None:
    """Why ``namespace`` is refused, or None when it is fine."""
    if not isinstance(namespace, str) or not namespace:
        return "namespace is required"
    if len(namespace) > MAX_NAMESPACE_BYTES:
        return f"namespace of {len(namespace)} characters exceeds {MAX_NAMESPACE_BYTES}"
    if not NAMESPACE_RE.match(namespace):
        return "namespace must be printable ASCII without spaces"
    return None


def session_problem(session_id: object) -> str | None:
    """Why a Put's ``session_id`` (an eviction hint) is refused, or None."""
    if not isinstance(session_id, str):
        return "session_id must be a string"
    if len(session_id) > MAX_SESSION_BYTES:
        return f"session_id of {len(session_id)} characters exceeds {MAX_SESSION_BYTES}"
    if not SESSION_RE.match(session_id):
        return "session_id must be printable ASCII"
    return None


def session_hint(session_id: str) -> str:
    """``session_id`` as a Put may carry it. The id is the client's choice (a chat ``user``, a
    header), and only groups blocks for eviction, so one the store would refuse (over-long, not
    printable ASCII) is sent as its digest, which groups the same blocks, instead of failing
    the save."""
    if SESSION_RE.match(session_id):
        return session_id
    return "sha256:" + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a block key (a uint64), or None."""
    if not isinstance(key, int) or isinstance(key, bool) or key < 0 or key > MAX_U64:
        return f"block key {key!r} is not a uint64"
    return None
