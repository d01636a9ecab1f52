"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}`` with its HTTP status.

Why it exists: the official ``anthropic`` client picks its exception class
from the status and reads ``error.type``/``error.message``; every error a
Messages endpoint gives (validation, routing, engine, an error event inside a
stream) must have this one shape, never OpenAI's or a plain 500.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# Anthropic's error type for each status it documents; 529 is its "overloaded" status.
TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                  500: "api_error", 529: "overloaded_error"}
OVERLOADED = 529


def error_type_for(status: int) -> str:
    """Anthropic's error type for an HTTP status: other 4xx are invalid requests, other 5xx API errors."""
    return TYPE_BY_STATUS.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(status: int, message: str, etype: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": etype or error_type_for(status), "message": message}}


class AnthropicError(Exception):
    """An error answer: HTTP status and a message naming the offending field (``field: problem``)."""

    def __init__(self, message: str, status: int = 400, etype: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.etype = etype or error_type_for(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.etype)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(field: str, problem: str) -> AnthropicError:
    """A 400 whose message starts with the field's path, as Anthropic's do (``messages.0.role: ...``)."""
    return AnthropicError(f"{field}: {problem}" if field else problem, 400)
