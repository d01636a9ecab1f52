"""Errors of the front doors, each mapped to one gRPC status and one HTTP status."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(RouterError):
    """Bad input; ``param`` names the field."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"


class UnknownModel(BadRequest):
    """The request names a model this router does not serve: 404, as OpenAI, Anthropic and vLLM
    answer it (clients map it to their "not found" error, and some fall back to another model
    on it); gRPC keeps INVALID_ARGUMENT, the contract of ``Generate``."""

    http_status = 404
    error_type = "not_found_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"unknown model {model!r}; this router serves {served!r}", "model")


class Unavailable(RouterError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable"


class StreamBroken(RouterError):
    """The endpoint died after tokens were streamed; says how much was generated."""

    grpc_code = grpc.StatusCode.ABORTED
    http_status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, generated: list[int]) -> None:
        super().__init__(message)
        self.generated = generated


class Overloaded(RouterError):
    """The pool is saturated and the request is sheddable (its InferenceObjective priority < 0)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_exceeded"


class DeadlineExceeded(RouterError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    error_type = "timeout"


class UpstreamError(RouterError):
    """The worker rejected the request (e.g. its own validation); passed through."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.grpc_code = code
        self.http_status = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                            grpc.StatusCode.UNAVAILABLE: 503}.get(code, 500)
        self.error_type = "invalid_request_error" if self.http_status == 400 else "server_error"
