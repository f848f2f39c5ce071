"""The OpenAPI document: FastAPI's, plus the schemas of the request bodies that routes parse
themselves (multipart or JSON images, v2 tensors), which FastAPI cannot see."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.schemas import InferenceRequest, PredictRequest

COMPONENT = "#/components/schemas/{model}"
#: The request bodies documented by reference in the routes' ``openapi_extra``.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (PredictRequest, InferenceRequest)


def component_ref(model: type[BaseModel]) -> dict[str, str]:
    """A JSON Schema reference to ``model`` among the document's component schemas."""
    return {"$ref": COMPONENT.format(model=model.__name__)}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` also hold the schemas of ``REQUEST_MODELS`` (and the models they
    use), so that every ``component_ref`` resolves."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        document = generate()  # FastAPI's, cached on the app after the first call
        _, extra = models_json_schema(
            [(model, "validation") for model in REQUEST_MODELS], ref_template=COMPONENT
        )
        document.setdefault("components", {}).setdefault("schemas", {}).update(extra["$defs"])
        return document

    app.openapi = openapi  # type: ignore[method-assign]
