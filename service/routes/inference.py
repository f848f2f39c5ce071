"""How an inference endpoint is registered: POST, the API key required, the error answers documented.

The hot routes skip FastAPI's per-request machinery (dependencies, parameter parsing, response
validation: ~40% of the event loop's CPU per single-image request): :class:`LeanRoute` calls the
endpoint with the request and its path parameters, the endpoint reads its own body, calls
:func:`service.deps.check_api_key` first and returns a pydantic model or a ``Response``. FastAPI
still documents the route (``response_model``, ``openapi_extra``, the key's schemes)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from service.deps import API_KEY_SECURITY
from service.schemas import ERROR_RESPONSES

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


class LeanRoute(APIRoute):
    """An API route whose handler is the endpoint itself: ``endpoint(request, **path_params)``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            answer = await endpoint(request, **request.path_params)
            if isinstance(answer, BaseModel):
                return Response(answer.model_dump_json(), media_type="application/json")
            if not isinstance(answer, Response):
                raise TypeError(f"{endpoint.__name__} returned {type(answer).__name__}")
            return answer

        return handle


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
                route_class_override=LeanRoute,
                summary=summary,
            )
        return endpoint

    return register
