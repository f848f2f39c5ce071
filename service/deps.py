"""Route dependencies: the app's runtime, and the API key check for inference routes."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from service.errors import UnauthorizedError
from service.query_memory import client_key
from service.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def _presented_key(request: Request) -> str | None:
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    return given or None


def client_of(request: Request, runtime: Runtime) -> str:
    """The client whose query history a request joins: its API key when one is configured (and
    ``query_client`` is auto), else its address."""
    settings = runtime.settings
    use_key = settings.api_key is not None and settings.query_client == "auto"
    address = request.client.host if request.client is not None else None
    return client_key(_presented_key(request) if use_key else None, address)


def require_api_key(request: Request, runtime: RuntimeDep) -> None:
    """When ``LAPGUARD_API_KEY`` is set, inference needs ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``."""
    expected = runtime.settings.api_key
    if expected is None:
        return
    given = _presented_key(request)
    if not given:
        raise UnauthorizedError(
            "an API key is required: send X-API-Key: KEY or Authorization: Bearer KEY"
        )
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise UnauthorizedError("the API key is not valid")
