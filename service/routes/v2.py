"""Open Inference Protocol (KServe v2 / Triton HTTP) routes, so stock v2 clients work.

What the model takes and answers is in :mod:`service.open_inference` (shared with the gRPC
endpoint): ONE input per request, ``input`` (FP32 ``[N, C, H, W]``) or ``image`` (BYTES ``[N]``:
encoded PNG/JPEG/... files; base64 strings in JSON, raw in the binary extension); outputs
``probabilities``, ``label``, ``flagged``, ``score`` and ``query_attack``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from detector.errors import UnsupportedMediaError
from service import open_inference
from service.deps import RuntimeDep, check_api_key, client_of, runtime_of
from service.inference_protocol import (
    BINARY_MEDIA_TYPE,
    HEADER_LENGTH,
    encode_outputs,
    parse_request,
    response_body,
)
from service.open_inference import check_model
from service.openapi import component_ref
from service.routes.inference import inference_route
from service.schemas import (
    INFERENCE_ERRORS,
    InferenceRequest,
    InferenceResponse,
    LiveResponse,
    ModelMetadata,
    ReadyResponse,
    ServerMetadata,
    V2ErrorResponse,
    error_responses,
)

# Full paths (no router prefix), so a route's own path is its template for metrics and logs.
router = APIRouter(tags=["v2 (Open Inference Protocol)"])

# The error answers of each kind of route, in the protocol's error shape.
_READY_ERRORS = error_responses(503, model=V2ErrorResponse)
_MODEL_ERRORS = error_responses(404, 422, model=V2ErrorResponse)
_MODEL_READY_ERRORS = error_responses(404, 422, 503, model=V2ErrorResponse)
_INFER_ERRORS = error_responses(*INFERENCE_ERRORS, 404, model=V2ErrorResponse)
#: A body in the binary tensor extension (requests, and answers with outputs asked in binary).
_BINARY_TENSORS = {
    "schema": {
        "type": "string",
        "format": "binary",
        "description": f"binary tensor extension: JSON header ({HEADER_LENGTH} bytes) + tensor data",
    }
}


@router.get("/v2", response_model=ServerMetadata, summary="server metadata")
async def server_metadata() -> ServerMetadata:
    return open_inference.server_metadata(["binary_tensor_data"])


@router.get("/v2/health/live", response_model=LiveResponse)
async def live() -> LiveResponse:
    return LiveResponse(live=True)


@router.get("/v2/health/ready", response_model=ReadyResponse, responses=_READY_ERRORS)
async def ready(runtime: RuntimeDep) -> ReadyResponse:
    runtime.check_ready()
    return ReadyResponse(ready=True)


@router.get(
    "/v2/models/{name}",
    response_model=ModelMetadata,
    response_model_exclude_none=True,
    responses=_MODEL_ERRORS,
)
@router.get(
    "/v2/models/{name}/versions/{version}",
    response_model=ModelMetadata,
    response_model_exclude_none=True,
    responses=_MODEL_ERRORS,
)
async def model_metadata(
    runtime: RuntimeDep, name: str, version: str | None = None
) -> ModelMetadata:
    check_model(runtime, name, version)
    return open_inference.model_metadata(runtime)


@router.get("/v2/models/{name}/ready", response_model=ReadyResponse, responses=_MODEL_READY_ERRORS)
@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    response_model=ReadyResponse,
    responses=_MODEL_READY_ERRORS,
)
async def model_ready(runtime: RuntimeDep, name: str, version: str | None = None) -> ReadyResponse:
    check_model(runtime, name, version)
    runtime.check_ready()
    return ReadyResponse(ready=True)


#: The body as JSON. The binary tensor extension (a JSON header of Inference-Header-Content-Length
#: bytes, then the tensors' bytes, whatever the Content-Type) cannot be described in OpenAPI: an
#: octet-stream body is read as JSON unless that header says where the JSON ends.
_INFER_BODY = {
    "description": (
        "JSON, or the binary tensor extension: a JSON header of Inference-Header-Content-Length "
        "bytes followed by the tensors' bytes (each input's parameters.binary_data_size)"
    ),
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": component_ref(InferenceRequest)}},
    },
}


@inference_route(
    router,
    "/v2/models/{name}/versions/{version}/infer",
    "/v2/models/{name}/infer",
    response_model=InferenceResponse,
    openapi_extra=_INFER_BODY,
    responses={200: {"content": {BINARY_MEDIA_TYPE: _BINARY_TENSORS}}, **_INFER_ERRORS},
)
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    runtime = runtime_of(request)
    check_api_key(request, runtime)
    check_model(runtime, name, version)
    runtime.check_ready()
    client = client_of(request, runtime)
    await runtime.admit_client(client)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaError(
            f"Content-Encoding {encoding!r} is not supported; send the body uncompressed"
        )
    payload, chunks = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
    result, available = await open_inference.infer(runtime, client, payload.inputs, chunks)
    outputs, binary = encode_outputs(payload, available)
    model_name, model_version = runtime.answered_by(result)
    header: dict[str, Any] = InferenceResponse(
        model_name=model_name,
        model_version=model_version,
        id=payload.id,
        parameters={"threshold": float(result.threshold)},
        outputs=outputs,
    ).model_dump(exclude_none=True)
    body, headers, media_type = response_body(header, binary)
    return Response(body, headers=headers, media_type=media_type)
