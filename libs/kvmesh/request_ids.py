"""The id an engine knows a request by, made from the client's.

A client's request id is not unique: a client may reuse one, and a gateway retries a dropped
try under the same ``x-request-id`` while the first may still run on its engine, which refuses
a second request under an id it holds (``DuplicateRequestError``). vLLM's own front end appends
random characters to the ids it is given for the same reason. The router and the worker's
OpenAI front door both make engine ids here, so the two paths agree.

Engines take ids of at most 128 bytes (``kvmesh.worker.engine.validation``), and the router
appends to an engine id (``-prefill``, ``-r<attempt>``, ``-h<attempt>``), so a long client id
is replaced by a digest prefix: the engine id stays at most 90 bytes.
"""

from __future__ import annotations

import hashlib
import secrets

# Longer client ids go as "sha256:" and 16 hex digits (23 bytes).
MAX_CLIENT_PART_BYTES = 80


def engine_request_id(client_id: str) -> str:
    """``client_id`` (or its digest, when longer than ``MAX_CLIENT_PART_BYTES``) and 8 random hex digits."""
    raw = client_id.encode("utf-8", "surrogatepass")
    part = client_id if len(raw) <= MAX_CLIENT_PART_BYTES else "sha256:" + hashlib.sha256(raw).hexdigest()[:16]
    return f"{part}-{secrets.token_hex(4)}"
