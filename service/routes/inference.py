"""How an inference endpoint is registered: POST, the API key required, the error answers documented.

The hot routes resolve no FastAPI dependency per request (that machinery cost about a fifth of the
event loop's time per single-image request): the endpoint calls :func:`service.deps.check_api_key`
first, and the key's schemes are documented through ``openapi_extra``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter

from service.deps import API_KEY_SECURITY
from service.schemas import ERROR_RESPONSES

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def inference_route(
    router: APIRouter,
    *paths: str,
    response_model: Any,
    openapi_extra: dict[str, Any],
    summary: str | None = None,
    responses: dict[int | str, dict[str, Any]] = ERROR_RESPONSES,
) -> Callable[[Endpoint], Endpoint]:
    """A decorator registering its endpoint on ``router`` as ``POST`` on each of ``paths``, in
    order, documented as behind the API key (the endpoint must call
    :func:`service.deps.check_api_key` first), with its error answers (``responses``, by default
    ``ERROR_RESPONSES``) in the OpenAPI document."""

    def register(endpoint: Endpoint) -> Endpoint:
        for path in paths:
            router.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                response_model=response_model,
                responses=responses,
                openapi_extra={**openapi_extra, "security": API_KEY_SECURITY},
                summary=summary,
            )
        return endpoint

    return register
