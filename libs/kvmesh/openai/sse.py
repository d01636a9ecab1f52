"""Server-sent-events framing of a streamed OpenAI answer.

Why it exists: OpenAI streams are ``data: <json>\\n\\n`` events ending with
``data: [DONE]``, served as ``text/event-stream`` with buffering off so each
token reaches the client (through nginx/Envoy) as it is made; both HTTP apps
stream this way.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(doc: dict[str, Any]) -> bytes:
    """One SSE event carrying a JSON document."""
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    """A streaming response over already framed events (``event`` ... ``DONE``)."""
    return StreamingResponse(events, media_type="text/event-stream", headers={**STREAM_HEADERS, **(headers or {})})
