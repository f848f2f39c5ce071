"""ASGI middleware: request ids + request log + HTTP metrics, and the request body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from detector.errors import InputTooLargeError
from service.errors import error_response
from service.logs import request_id_var
from service.metrics import Metrics

logger = logging.getLogger("lapguard.service.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_QUIET_ROUTES = {"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"}


class HttpMiddleware:
    """An ASGI middleware that passes everything but HTTP (lifespan, websockets) straight through
    and hands HTTP requests to ``handle``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestContextMiddleware(HttpMiddleware):
    """Gives every request an id (``X-Request-ID`` in, or a new one; always echoed out), logs one
    JSON line per request and records request count and latency by route template and status."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                MutableHeaders(scope=message)["X-Request-ID"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = scope.get("route")
            template = (
                getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
            )
            method = scope.get("method", "")
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template, method, str(status)).observe(seconds)
            level = logging.DEBUG if template in _QUIET_ROUTES and status < 400 else logging.INFO
            if logger.isEnabledFor(level):
                client = scope.get("client")
                logger.log(
                    level,
                    "request",
                    extra={
                        "request_id": request_id,
                        "method": method,
                        "path": scope.get("path", ""),
                        "route": template,
                        "status": status,
                        "duration_ms": round(seconds * 1000, 3),
                        "client": client[0] if client else None,
                    },
                )
            request_id_var.reset(token)


class BodyLimitMiddleware(HttpMiddleware):
    """Refuses bodies over ``max_bytes`` with 413: at once from ``Content-Length``, or while the
    body streams in (chunked uploads), so a huge upload is never buffered."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await error_response(
                    400, "bad_request", "invalid Content-Length header", path=scope["path"]
                )(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise InputTooLargeError(self._message())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except InputTooLargeError:
            if started:
                raise
            await self._too_large(scope, receive, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes; send fewer or smaller images"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, "payload_too_large", self._message(), {"Connection": "close"}, path=scope["path"]
        )
        await response(scope, receive, send)
