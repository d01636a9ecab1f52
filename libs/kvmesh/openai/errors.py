"""OpenAI's error shape and the mapping of exceptions to JSON error responses.

Why it exists: clients (the official ``openai`` SDK among them) read
``{"error": {"message", "type", "param", "code"}}`` and pick the exception
class from the HTTP status, so every kvmesh HTTP answer that is an error -
validation, unknown route, engine or routing failure, and an error event in
a stream - must have that one shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# OpenAI's ``type`` for a status when the raiser names none.
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error"}


def error_type_for(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status (5xx and unknown ones: ``server_error``)."""
    return _TYPE_BY_STATUS.get(status, "server_error")


def error_body(status: int, message: str, etype: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The error document; ``code`` carries the HTTP status."""
    return {"error": {"message": message, "type": etype or error_type_for(status), "param": param,
                      "code": status}}


def error_response(status: int, message: str, etype: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, etype, param), status_code=status, headers=headers)


class OpenAIError(Exception):
    """An error answer: HTTP status, a message naming the problem, OpenAI type, offending field."""

    status = 500
    etype = "server_error"

    def __init__(self, message: str, param: str | None = None, *, status: int | None = None,
                 etype: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
            self.etype = etype or error_type_for(status)
        elif etype is not None:
            self.etype = etype

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.etype, self.param)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(self.status, self.message, self.etype, self.param, headers)


class BadRequest(OpenAIError):
    """The request is invalid (400); ``param`` names the field."""

    status = 400
    etype = "invalid_request_error"


def install_error_handlers(app: FastAPI, headers: dict[str, str] | None = None) -> None:
    """Answer ``OpenAIError``, unknown routes (404) and wrong methods (405) in OpenAI's shape."""

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response(headers)

    async def not_found(request: Request, _: Exception) -> JSONResponse:
        return error_response(404, f"no route {request.url.path}", "invalid_request_error", headers=headers)

    async def bad_method(request: Request, _: Exception) -> JSONResponse:
        return error_response(405, f"method {request.method} not allowed on {request.url.path}",
                              "invalid_request_error", headers=headers)

    app.add_exception_handler(OpenAIError, on_error)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, bad_method)
