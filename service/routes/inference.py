"""How an inference endpoint is registered: POST, the API key required, the error answers documented."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter

from service.deps import API_KEY_REQUIRED
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
    order, behind the API key, with its error answers (``responses``, by default
    ``ERROR_RESPONSES``) in the OpenAPI document."""

    def register(endpoint: Endpoint) -> Endpoint:
        for path in paths:
            router.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                response_model=response_model,
                responses=responses,
                dependencies=API_KEY_REQUIRED,
                openapi_extra=openapi_extra,
                summary=summary,
            )
        return endpoint

    return register
