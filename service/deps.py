"""Route dependencies: the app's runtime, and the key checks of inference and admin routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.params import Depends as Dependency
from fastapi.security import APIKeyHeader, HTTPBearer

from service import keys
from service.errors import ForbiddenError
from service.runtime import Runtime


def runtime_of(request: Request) -> Runtime:
    """The app's :class:`Runtime` (the hot routes call it directly, resolving no dependency)."""
    runtime: Runtime = request.app.state.runtime
    return runtime


# The dependencies are ``async def`` although they never await: FastAPI runs a plain ``def``
# dependency in its thread pool, a thread hop per request and dependency (measured: ~6% of the
# event loop's time under 32 clients, in CPU taken from the network on 2 cores).
async def get_runtime(request: Request) -> Runtime:
    """:func:`runtime_of` as a route dependency."""
    return runtime_of(request)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]

_WHICH_KEY = (
    "LAPGUARD_API_KEY (admin routes: LAPGUARD_ADMIN_KEY when set); "
    "needed only when the server is configured with one"
)
#: The two ways to present a key, as the OpenAPI document's security schemes (either will do).
#: They only document: they never refuse, :func:`service.keys.verify_key` does.
_KEY_SCHEMES = [
    Security(
        APIKeyHeader(
            name="X-API-Key", scheme_name="ApiKey", description=_WHICH_KEY, auto_error=False
        )
    ),
    Security(HTTPBearer(scheme_name="Bearer", description=_WHICH_KEY, auto_error=False)),
]


def client_of(request: Request, runtime: Runtime) -> str:
    """The client whose query history a request joins (see :func:`service.keys.client_of`)."""
    address = request.client.host if request.client is not None else None
    return keys.client_of(request.headers, address, runtime.settings)


def check_api_key(request: Request, runtime: Runtime) -> None:
    """When ``LAPGUARD_API_KEY`` is set, inference needs ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``."""
    keys.check_api_key(request.headers, runtime.settings)


async def require_api_key(request: Request, runtime: RuntimeDep) -> None:
    """:func:`check_api_key` as a route dependency."""
    check_api_key(request, runtime)


async def require_admin_key(request: Request, runtime: RuntimeDep) -> None:
    """Admin routes need ``LAPGUARD_ADMIN_KEY`` (or, when unset, ``LAPGUARD_API_KEY``), sent like
    the API key; with neither configured they are refused (403)."""
    settings = runtime.settings
    expected = settings.admin_key or settings.api_key
    if expected is None:
        raise ForbiddenError(
            "admin calls are off: set LAPGUARD_ADMIN_KEY (or LAPGUARD_API_KEY) and send it, "
            "or send the server SIGHUP to reload its bundle"
        )
    name = "admin key" if settings.admin_key else "API key"
    keys.verify_key(keys.presented_key(request.headers), expected, name)


#: ``dependencies=`` of the routes behind the API key, and of the admin routes.
API_KEY_REQUIRED: list[Dependency] = [*_KEY_SCHEMES, Depends(require_api_key)]
#: The OpenAPI ``security`` of a route behind the API key (the schemes of ``_KEY_SCHEMES``), for
#: the inference routes, which call :func:`check_api_key` themselves: resolving dependencies
#: cost ~20% of the event loop's time per single-image request.
API_KEY_SECURITY: list[dict[str, list[str]]] = [{"ApiKey": []}, {"Bearer": []}]
ADMIN_KEY_REQUIRED: list[Dependency] = [*_KEY_SCHEMES, Depends(require_admin_key)]
#: The OpenAPI tag of the routes behind the admin key (the document drops their ``security``
#: when neither key is configured, as it does the API key's when that is not).
ADMIN_TAG = "admin"
