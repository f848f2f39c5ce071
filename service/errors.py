"""Service errors and the ONE place where errors become HTTP responses.

Every error answer has the body ``{"error": {"code": "...", "message": "..."}}``
(docs/architecture.md, "Errors"): lapguard's own errors by class, FastAPI's validation errors
(422), Starlette's HTTP errors (404, 405, ...) and anything unexpected (500, without internals).

Under ``/v2`` the Open Inference Protocol's shape wins, ``{"error": "message", "code": "..."}``:
stock KServe/Triton clients read ``error`` as the message text (a nested object made
tritonclient's exception unprintable); the extra ``code`` keeps our machine-readable code.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from detector.errors import (
    ArtefactError,
    ConfigError,
    InputError,
    InputTooLargeError,
    LapguardError,
    UnsupportedMediaError,
)

logger = logging.getLogger("lapguard.service")


class ServiceError(LapguardError):
    """Base of the errors only the service raises."""


class UnauthorizedError(ServiceError):
    """Missing or wrong API key."""


class ForbiddenError(ServiceError):
    """The call is not allowed on this server as configured (e.g. admin calls without a key)."""


class ReloadRefusedError(ServiceError):
    """A bundle to hot-reload failed verification or warm-up; the previous one keeps serving."""


class NotFoundError(ServiceError):
    """A resource the request names does not exist (e.g. a gallery sample past the last)."""


class ModelNotFoundError(ServiceError):
    """A v2 route named a model this server does not serve."""


class RetryableError(ServiceError):
    """The request was not run; the same request may succeed after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OverloadedError(RetryableError):
    """The queue is full (429)."""


class NotReadyError(RetryableError):
    """The model is not loaded/warmed up yet, or the server is shutting down (503)."""


class QueryAttackBlockedError(ServiceError):
    """The client was flagged for a query-based attack and is refused for a cool-down (403)."""


class QueryAttackThrottledError(RetryableError):
    """The client was flagged for a query-based attack; retry after the cool-down (429)."""


# Most specific first: the first matching class decides status and code.
_STATUS: list[tuple[type[BaseException], int, str]] = [
    (UnauthorizedError, 401, "unauthorized"),
    (ForbiddenError, 403, "forbidden"),
    (ReloadRefusedError, 422, "bundle_refused"),
    (ModelNotFoundError, 404, "model_not_found"),
    (NotFoundError, 404, "not_found"),
    (InputTooLargeError, 413, "payload_too_large"),
    (UnsupportedMediaError, 415, "unsupported_media_type"),
    (InputError, 400, "invalid_input"),
    (QueryAttackBlockedError, 403, "query_attack"),
    (QueryAttackThrottledError, 429, "query_attack"),
    (OverloadedError, 429, "overloaded"),
    (NotReadyError, 503, "not_ready"),
    (ArtefactError, 500, "artefact_error"),
    (ConfigError, 500, "config_error"),
    (LapguardError, 500, "internal_error"),
]

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "overloaded",
    503: "not_ready",
}


V2_PREFIX = "/v2"


def error_response(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    path: str = "",
) -> JSONResponse:
    """The error answer for a request to ``path`` (the Open Inference Protocol's shape under /v2)."""
    if path == V2_PREFIX or path.startswith(V2_PREFIX + "/"):
        body: dict[str, object] = {"error": message, "code": code}
    else:
        body = {"error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def status_of(error: BaseException) -> tuple[int, str]:
    """HTTP status and error code of a lapguard error."""
    for cls, status, code in _STATUS:
        if isinstance(error, cls):
            return status, code
    return 500, "internal_error"


def lapguard_error_response(error: LapguardError, *, path: str = "") -> JSONResponse:
    status, code = status_of(error)
    headers: dict[str, str] = {}
    if isinstance(error, RetryableError):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    if isinstance(error, UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="lapguard"'
    if status >= 500 and status != 503:
        logger.error("request failed: %s", error, exc_info=error)
    return error_response(status, code, str(error), headers or None, path=path)


def validation_message(error: RequestValidationError | ValidationError) -> str:
    parts = []
    for item in error.errors()[:10]:
        loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {item.get('msg', 'invalid')}")
    return "request does not match the schema: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the same JSON shape."""

    async def on_lapguard(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, LapguardError)
        return lapguard_error_response(error, path=request.url.path)

    async def on_validation(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError | ValidationError)
        message = validation_message(error)
        return error_response(422, "validation_error", message, path=request.url.path)

    async def on_http(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        code = _HTTP_CODES.get(error.status_code, "http_error")
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        headers = dict(error.headers or {}) or None
        return error_response(error.status_code, code, message, headers, path=request.url.path)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.error("unhandled error: %r", error, exc_info=error)
        message = "internal server error; see the server log"
        return error_response(500, "internal_error", message, path=request.url.path)

    app.add_exception_handler(LapguardError, on_lapguard)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
