"""What a failed client request was: its exception chain, errno, and the phase it failed in.

Why it exists: a 30-minute soak lost 35 requests as bare ``ReadError`` with nothing else to go
on. httpx keeps the cause two links down (httpx.ReadError <- httpcore.ReadError <- anyio's
BrokenResourceError <- ConnectionResetError [errno 104]) and ``str()`` of the outer ones is
empty, so a record of ``type: message`` said nothing. This walks the chain and keeps every
link, the first errno, and, from httpx's trace events, where the request was (connecting,
sending, waiting for headers, reading the body) and whether it rode a reused connection.
"""

from __future__ import annotations

from typing import Any

# httpcore trace event prefix -> phase name a reader understands.
_PHASES = (
    ("connection.connect_tcp", "connect"),
    ("connection.start_tls", "connect"),
    ("http11.send_request_headers", "send_headers"),
    ("http11.send_request_body", "send_body"),
    ("http11.receive_response_headers", "wait_headers"),
    ("http11.receive_response_body", "read_body"),
)


def phase_of(event: str) -> str | None:
    """The phase a ``*.started`` trace event begins (None for others: the response's close is
    traced after a failure too, and must not hide where it failed)."""
    if not event.endswith(".started"):
        return None
    for prefix, name in _PHASES:
        if event.startswith(prefix):
            return name
    return None


def exception_chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """``exc`` and its causes (``__cause__``, else ``__context__``), outermost first."""
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(out) < limit:
        seen.add(id(cur))
        out.append(cur)
        # The context too, even where a library raised ``from None``: httpcore and anyio keep the
        # OS error only there (an IndexError there means anyio found the stream closed).
        cur = cur.__cause__ if cur.__cause__ is not None else cur.__context__
    return out


def describe_error(exc: BaseException) -> dict[str, Any]:
    """``{"type", "message", "chain", "errno"}``: ``type``/``message`` of the outermost exception,
    ``chain`` every link as ``module.Type: message``, ``errno`` the first OS error number found."""
    chain = exception_chain(exc)
    errno = next((e.errno for e in chain if isinstance(e, OSError) and e.errno is not None), None)
    return {"type": type(exc).__name__, "message": str(exc),
            "chain": [f"{type(e).__module__}.{type(e).__name__}: {e}" for e in chain], "errno": errno}


def summary(exc: BaseException) -> str:
    """One line: the outer ``Type: message`` and, when it says nothing, the innermost cause."""
    d = describe_error(exc)
    line = f"{d['type']}: {d['message']}"
    if len(d["chain"]) > 1:
        line += f" (cause: {d['chain'][-1]})"
    return line
