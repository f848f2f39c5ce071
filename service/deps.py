"""Route dependencies: the app's runtime, and the API key check for inference routes."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from service.errors import UnauthorizedError
from service.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def require_api_key(request: Request, runtime: RuntimeDep) -> None:
    """When ``LAPGUARD_API_KEY`` is set, inference needs ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``."""
    expected = runtime.settings.api_key
    if expected is None:
        return
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    if not given:
        raise UnauthorizedError(
            "an API key is required: send X-API-Key: KEY or Authorization: Bearer KEY"
        )
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise UnauthorizedError("the API key is not valid")
