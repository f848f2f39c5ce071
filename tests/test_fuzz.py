"""Schemathesis against the live server's ``/openapi.json``: seeded, bounded cases for every
documented operation, with and without the API key, fitting the schema and not. Every answer must
be a documented status with a documented content type, headers and body, never a 5xx, and the
server must keep answering. The hostile requests a schema cannot express (decompression bombs,
truncated images, thousands of parts, oversized or chunked bodies, API key variants) are in
test_service_errors.py and test_service_auth.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.errors import FailureGroup

from tests.live_server import LiveServer
from tests.service_helpers import API_KEY, server_settings

KEYED = {"X-API-Key": API_KEY}
#: Every check of the installed schemathesis runs on every answer (none is named here), with the
#: statuses the repository's schemathesis.toml adds for what no schema can say (the file `st run`
#: reads when started from the repository).
CONFIG = schemathesis.Config.from_path(Path(__file__).resolve().parents[1] / "schemathesis.toml")
#: server -> (name, generation mode, headers, served model in the path, cases per operation at
#: most): the keyed server gets the key with requests that fit the schema and with requests that
#: do not, both naming the served model where a path names one (or /v2 would answer 404 before
#: reading the body), and a few requests without the key or the model's name; the server without
#: a key gets both kinds with no key. Operations without parameters or body have a single case;
#: the rest make each server's total over MIN_CASES.
VARIANTS = {
    "keyed": [
        ("keyed", GenerationMode.POSITIVE, KEYED, True, 50),
        ("keyed-negative", GenerationMode.NEGATIVE, KEYED, True, 50),
        ("anonymous", GenerationMode.POSITIVE, {}, False, 15),
    ],
    "open": [
        ("open", GenerationMode.POSITIVE, {}, True, 30),
        ("open-negative", GenerationMode.NEGATIVE, {}, True, 30),
    ],
}
MIN_CASES = {"keyed": 500, "open": 300}
SEED = 15


@pytest.fixture(scope="module")
def open_server(service_bundle) -> Iterator[LiveServer]:
    """The conftest server's settings without an API key: its document asks for none."""
    settings = server_settings(service_bundle, api_key=None)
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def servers(server: LiveServer, open_server: LiveServer) -> dict[str, LiveServer]:
    return {"keyed": server, "open": open_server}


@pytest.fixture(scope="module")
def api_schema(server: LiveServer) -> schemathesis.BaseSchema:
    """The live server's OpenAPI document, as schemathesis reads it."""
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(VARIANTS))
def test_every_operation_answers_as_documented(servers: dict[str, LiveServer], kind: str) -> None:
    """At least MIN_CASES generated requests over every operation, and not one failed check, on
    a server with a key and on one without."""
    server = servers[kind]
    api_schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)
    cases: Counter[str] = Counter()
    failures: list[str] = []
    served = {"name": server.runtime.model_name, "version": server.runtime.model_version}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    for operation in operations:
        for name, mode, headers, pin, examples in VARIANTS[kind]:
            label = f"{operation.label} [{name}]"
            path = {k: v for k, v in served.items() if pin and f"{{{k}}}" in operation.path}
            strategy = operation.as_strategy(generation_mode=mode, path_parameters=path or None)
            try:
                cases[label] = _fuzz(strategy, headers, examples, negative=mode.is_negative)
            except (FailureGroup, Exception) as error:  # one report for every operation
                failures.append(f"{label}: {error}")
            assert _alive(server), f"the server stopped answering after {label}"
    assert not failures, "\n\n".join(failures)
    assert {"GET /v2", "POST /v2/models/{name}/infer"} <= {op.label for op in operations}
    assert sum(cases.values()) >= MIN_CASES[kind], cases


def _fuzz(strategy: Any, headers: dict[str, str], examples: int, *, negative: bool) -> int:
    """Up to ``examples`` seeded requests drawn from ``strategy``, each sent and checked; how
    many were sent. A ``negative`` strategy may have nothing to negate (no parameters, or only
    free-form strings): none sent."""
    sent = 0

    @seed(SEED)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report the first failure
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        case.call_and_validate(headers=headers, timeout=30)  # every check CONFIG enables

    try:
        run()
    except Unsatisfiable:
        if not negative:
            raise
    return sent


def _alive(server: LiveServer) -> bool:
    return httpx.get(server.url + "/healthz", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def document(server: LiveServer) -> dict[str, Any]:
    """The live server's OpenAPI document, as JSON."""
    return httpx.get(server.url + "/openapi.json", timeout=10).json()


def test_every_reference_in_the_openapi_document_resolves(document: dict[str, Any]) -> None:
    """The request bodies the routes parse themselves are documented too (the /v2 infer JSON
    body named a schema the document did not hold)."""
    schemas = document["components"]["schemas"]
    refs = set(_refs(document))
    assert {"#/components/schemas/InferenceRequest", "#/components/schemas/PredictRequest"} <= refs
    assert {ref.removeprefix("#/components/schemas/") for ref in refs} <= set(schemas), refs


def test_the_routes_behind_the_key_say_how_to_send_it(document: dict[str, Any]) -> None:
    """Every route that may answer 401 lists the two ways to present the key, and only those."""
    assert set(document["components"]["securitySchemes"]) == {"ApiKey", "Bearer"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            keyed = "401" in operation["responses"]
            security = operation.get("security")
            assert (security == [{"ApiKey": []}, {"Bearer": []}]) == keyed, (method, path, security)


def test_the_document_asks_for_a_key_only_where_the_server_does(
    document: dict[str, Any], server: LiveServer, open_server: LiveServer
) -> None:
    """Without a configured key: no `security` and no 401 anywhere (the schemes stay defined). With one:
    the routes that score or reload ask for it (and answer 401 without it), health and the
    document itself do not."""
    bare = httpx.get(open_server.url + "/openapi.json", timeout=10).json()
    assert "security" not in bare
    for path, operations in bare["paths"].items():
        for method, operation in operations.items():
            assert "security" not in operation and "401" not in operation["responses"], (
                method,
                path,
            )
    keyed = {
        (m.upper(), p)
        for p, ops in document["paths"].items()
        for m, op in ops.items()
        if "security" in op
    }
    assert {
        ("POST", "/v1/predict"),
        ("POST", "/v2/models/{name}/infer"),
        ("POST", "/v1/admin/reload"),
    } <= keyed
    assert not {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v2/health/ready")} & keyed
    assert httpx.post(server.url + "/v1/predict", timeout=10).status_code == 401


def _refs(node: Any) -> Any:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


#: Answers that the OpenAPI document did not describe (a 404 left out, the /v2 error shape
#: documented as v1's, v2 binary outputs): operation, request, status.
UNDOCUMENTED_BEFORE = {
    "unknown v2 model": ("GET /v2/models/{name}", {"path_parameters": {"name": "other"}}, 404),
    "unknown v2 version": (
        "GET /v2/models/{name}/versions/{version}/ready",
        {"path_parameters": {"name": "tiny", "version": "0"}},
        404,
    ),
    "infer on an unknown model": (
        "POST /v2/models/{name}/infer",
        {"path_parameters": {"name": "other"}, "body": {"inputs": []}},
        404,
    ),
    "v2 error shape": (
        "POST /v2/models/{name}/infer",
        {
            "path_parameters": {"name": "tiny"},
            "body": {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
        },
        400,
    ),
    "v2 outputs in binary": (
        "POST /v2/models/{name}/infer",
        {
            "path_parameters": {"name": "tiny"},
            "body": {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [1, 1, 28, 28],
                        "datatype": "FP32",
                        "data": [0.5] * 784,
                    }
                ],
                "parameters": {"binary_data_output": True},
            },
        },
        200,
    ),
    "gallery sample past the last": (
        "GET /v1/gallery/{index}.png",
        {"path_parameters": {"index": 99}},
        404,
    ),
}


@pytest.mark.parametrize("name", list(UNDOCUMENTED_BEFORE))
def test_error_answers_are_documented(api_schema: schemathesis.BaseSchema, name: str) -> None:
    label, request, status = UNDOCUMENTED_BEFORE[name]
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label
    case = operation.Case(media_type="application/json" if "body" in request else None, **request)
    response = case.call_and_validate(headers=KEYED, timeout=30)
    assert response.status_code == status, response.text


def test_a_reload_body_that_is_not_utf8_is_a_documented_400(
    server: LiveServer, api_schema: schemathesis.BaseSchema
) -> None:
    """FastAPI answers 400 (not 422) to a JSON body it cannot decode; the document says so."""
    headers = {**KEYED, "Content-Type": "application/json"}
    response = httpx.post(server.url + "/v1/admin/reload", content=b"\xff{", headers=headers)
    assert response.status_code == 400, response.text
    operation = api_schema.find_operation_by_label("POST /v1/admin/reload")
    assert operation is not None
    operation.Case(media_type="application/json").validate_response(response, headers=headers)
