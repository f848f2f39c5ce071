"""The live server's OpenAPI document describes every route and every answer."""

from __future__ import annotations

from typing import Any

import httpx

from tests.live_server import LiveServer


def test_every_reference_in_the_openapi_document_resolves(server: LiveServer) -> None:
    """The request bodies the routes parse themselves are documented too (the /v2 infer JSON
    body named a schema the document did not hold)."""
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    refs = set(_refs(document))
    assert {"#/components/schemas/InferenceRequest", "#/components/schemas/PredictRequest"} <= refs
    assert {ref.removeprefix("#/components/schemas/") for ref in refs} <= set(schemas), refs


def _refs(node: Any) -> Any:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)
