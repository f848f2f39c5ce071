"""API keys, whatever carries them (REST headers, gRPC metadata): which key a request presents,
the constant-time check, and the client a request's query history is kept under."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pydantic import SecretStr

from service.errors import UnauthorizedError
from service.query_memory import client_key
from service.settings import Settings


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in ``x-api-key``, else in ``authorization: Bearer KEY`` (lower-case names)."""
    given = headers.get("x-api-key")
    if given is None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    return given or None


def verify_key(given: str | None, expected: SecretStr, name: str) -> None:
    """``given`` is ``expected`` (the ``name`` in the refusal), else :class:`UnauthorizedError`."""
    if not given:
        raise UnauthorizedError(
            f"the {name} is required: send X-API-Key: KEY or Authorization: Bearer KEY"
        )
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise UnauthorizedError(f"the {name} is not valid")


def check_api_key(headers: Mapping[str, str], settings: Settings) -> None:
    """When ``LAPGUARD_API_KEY`` is set, inference needs it (see :func:`presented_key`)."""
    if settings.api_key is not None:
        verify_key(presented_key(headers), settings.api_key, "API key")


def client_of(headers: Mapping[str, str], address: str | None, settings: Settings) -> str:
    """The client whose query history a request joins: its API key when one is configured (and
    ``query_client`` is auto), else its address."""
    use_key = settings.api_key is not None and settings.query_client == "auto"
    return client_key(presented_key(headers) if use_key else None, address)
