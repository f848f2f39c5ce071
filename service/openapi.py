"""The OpenAPI document: FastAPI's, plus the schemas of the request bodies that routes parse
themselves (multipart or JSON images, v2 tensors), which FastAPI cannot see, and what this
server's settings decide: the key only where one is configured, the image count limit."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.deps import ADMIN_TAG
from service.schemas import InferenceRequest, PredictRequest
from service.settings import Settings

COMPONENT = "#/components/schemas/{model}"
#: The request bodies documented by reference in the routes' ``openapi_extra``.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (PredictRequest, InferenceRequest)


def component_ref(model: type[BaseModel]) -> dict[str, str]:
    """A JSON Schema reference to ``model`` among the document's component schemas."""
    return {"$ref": COMPONENT.format(model=model.__name__)}


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make ``app.openapi()`` also hold the schemas of ``REQUEST_MODELS`` (and the models they
    use), so that every ``component_ref`` resolves, and say what ``settings`` make the server do:
    a route asks for a key only when one is configured for it (else no ``security``, no 401),
    and a request holds at most ``max_images_per_request`` images (more are refused)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        # FastAPI's, cached on the app: a copy, whose route bodies this changes per settings
        document = copy.deepcopy(generate())
        _, extra = models_json_schema(
            [(model, "validation") for model in REQUEST_MODELS], ref_template=COMPONENT
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(extra["$defs"])
        limit = settings.max_images_per_request
        schemas["PredictRequest"]["properties"]["instances"]["maxItems"] = limit
        for operations in document["paths"].values():
            for operation in operations.values():
                if "security" in operation and not _key_configured(operation, settings):
                    del operation["security"]
                    operation["responses"].pop("401", None)
                files = _multipart_files(operation)
                if files is not None:
                    files["maxItems"] = limit
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _key_configured(operation: dict[str, Any], settings: Settings) -> bool:
    """Whether the server asks for the key an operation is documented behind: the admin key (the
    API key when unset) for the admin routes, the API key for the others."""
    if ADMIN_TAG in operation.get("tags", []):
        return (settings.admin_key or settings.api_key) is not None
    return settings.api_key is not None


def _multipart_files(operation: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of the ``files`` field of an operation's multipart body, if it has one."""
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("multipart/form-data", {}).get("schema", {})
    files: dict[str, Any] | None = schema.get("properties", {}).get("files")
    return files
