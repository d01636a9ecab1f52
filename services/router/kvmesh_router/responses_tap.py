"""An external engine's Responses answer, kept in the router's store on its way to the client.

Why it exists: with ``vllm serve`` endpoints the router forwards ``/v1/responses`` to the engine
and passes its answer through. The engine must not keep the conversation itself: the next turn
may go to another engine (or another replica of the router). So the router puts stored state
back into the body before forwarding (``previous_response_id``, ``item_reference``), sends
``store: false``, and keeps the engine's ``response`` itself as it goes by. The answer the
client sees then says what the router did: ``store``, the ``previous_response_id`` it resolved
and the ``conversation`` it adds to. The response is kept before the event (or JSON) that completes it goes out, as for
the router's own workers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)
MAX_HELD_BYTES = 16 * 1024 * 1024   # a JSON answer held whole to be kept; larger ones pass unkept
Keep = Callable[[dict[str, Any]], Awaitable[None]]   # keeps a finished response (it reads its status)


class StoreTap:
    """``AnswerTap`` of one stored Responses request (``kvmesh_router.passthrough``)."""

    def __init__(self, echo: dict[str, Any], keep: Keep) -> None:
        self.echo = echo   # what the router did: store, previous_response_id, conversation
        self.keep = keep
        self._tail = b""   # a stream's unfinished line
        self._held: bytearray | None = bytearray()   # a JSON answer so far (None: too large, passed on)

    def _echo(self, response: dict[str, Any]) -> None:
        response.update(self.echo)

    async def body(self, raw: bytes) -> bytes:
        try:
            doc = json.loads(raw)
        except ValueError:
            return raw
        if not isinstance(doc, dict) or doc.get("object") != "response":
            return raw
        self._echo(doc)
        await self.keep(doc)
        return json.dumps(doc, ensure_ascii=False).encode()

    async def _line(self, line: bytes) -> bytes:
        """An SSE line; a ``data:`` event that carries the ``response`` gets the router's echo."""
        if not line.startswith(b"data: {") or b'"response"' not in line:
            return line
        try:
            doc = json.loads(line[6:])
        except ValueError:
            return line
        r = doc.get("response") if isinstance(doc, dict) else None
        if not isinstance(r, dict):
            return line
        self._echo(r)
        if doc.get("type") == "response.completed":   # the one event whose response is finished
            await self.keep(r)
        return b"data: " + json.dumps(doc, ensure_ascii=False).encode()

    async def feed(self, chunk: bytes, eos: bool, sse: bool) -> bytes:
        """The next piece of the answer's bytes, pushed (the gateway's picker sees them this way); what to
        send on in its place. A JSON answer is held until its end (at most ``MAX_HELD_BYTES``, then it
        passes as it is, and is not kept); a stream goes on a whole line at a time."""
        if not sse:
            if self._held is None:
                return chunk
            self._held += chunk
            if len(self._held) > MAX_HELD_BYTES:
                held, self._held = bytes(self._held), None
                return held
            if not eos:
                return b""
            held = bytes(self._held)
            try:
                return await self.body(held)
            except Exception:   # keeping it failed: the client still gets the answer as it came
                log.exception("a JSON answer could not be kept")
                return held
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        out = b"\n".join([await self._line(x) for x in lines]) + b"\n" if lines else b""
        if eos and self._tail:
            out += await self._line(self._tail)
            self._tail = b""
        return out

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The engine's bytes a whole line at a time (an event can span chunks)."""
        async for chunk in chunks:
            if out := await self.feed(chunk, False, True):
                yield out
        if tail := await self.feed(b"", True, True):
            yield tail
