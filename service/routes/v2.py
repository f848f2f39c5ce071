"""Open Inference Protocol (KServe v2 / Triton HTTP) routes, so stock v2 clients work.

The model takes ONE input per request, either ``input`` (FP32 ``[N, C, H, W]`` in the input spec's
value range) or ``image`` (BYTES ``[N]``: encoded PNG/JPEG/... files; base64 strings in JSON, raw
in the binary extension). Any input name is accepted; the datatype decides. Outputs:
``probabilities`` FP32 ``[N, K]``, ``label`` INT64 ``[N]``, ``flagged`` BOOL ``[N]``,
``score`` FP32 ``[N]`` (higher = more abnormal), ``query_attack`` BOOL ``[N]`` (the client's
recent queries hold near-duplicates of the image: stateful detection of query-based attacks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

import detector
from detector.errors import UnsupportedMediaError
from service.deps import RuntimeDep, check_api_key, client_of, runtime_of
from service.errors import ModelNotFoundError
from service.inference_protocol import (
    BINARY_MEDIA_TYPE,
    HEADER_LENGTH,
    OutputTensor,
    decode_bytes,
    decode_numeric,
    encode_outputs,
    parse_request,
    response_body,
)
from service.openapi import component_ref
from service.routes.inference import inference_route
from service.runtime import Runtime
from service.schemas import (
    INFERENCE_ERRORS,
    InferenceRequest,
    InferenceResponse,
    LiveResponse,
    ModelMetadata,
    ReadyResponse,
    ServerMetadata,
    TensorMetadata,
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


def _check_model(runtime: Runtime, name: str, version: str | None) -> None:
    if name != runtime.model_name:
        raise ModelNotFoundError(
            f"unknown model {name!r}; this server serves {runtime.model_name!r}"
        )
    if version is not None and version != runtime.model_version:
        raise ModelNotFoundError(
            f"unknown version {version!r} of model {name!r}; this server serves version {runtime.model_version!r}"
        )


@router.get("/v2", response_model=ServerMetadata, summary="server metadata")
async def server_metadata() -> ServerMetadata:
    return ServerMetadata(
        name="lapguard", version=detector.__version__, extensions=["binary_tensor_data"]
    )


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
    _check_model(runtime, name, version)
    spec = runtime.input_spec
    classes = len(runtime.class_names) or -1
    return ModelMetadata(
        name=runtime.model_name,
        versions=[runtime.model_version],
        platform="lapguard",
        inputs=[
            TensorMetadata(
                name="input",
                datatype="FP32",
                shape=[-1, spec.channels, spec.height, spec.width],
                parameters={"value_range": list(spec.value_range), "alternative_to": "image"},
            ),
            TensorMetadata(
                name="image", datatype="BYTES", shape=[-1], parameters={"alternative_to": "input"}
            ),
        ],
        outputs=[
            TensorMetadata(name="probabilities", datatype="FP32", shape=[-1, classes]),
            TensorMetadata(name="label", datatype="INT64", shape=[-1]),
            TensorMetadata(name="flagged", datatype="BOOL", shape=[-1]),
            TensorMetadata(
                name="score",
                datatype="FP32",
                shape=[-1],
                parameters={"direction": "higher = more abnormal"},
            ),
            TensorMetadata(
                name="query_attack",
                datatype="BOOL",
                shape=[-1],
                parameters={"meaning": "near-duplicates in this client's recent queries"},
            ),
        ],
        parameters={"class_names": runtime.class_names},
    )


@router.get("/v2/models/{name}/ready", response_model=ReadyResponse, responses=_MODEL_READY_ERRORS)
@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    response_model=ReadyResponse,
    responses=_MODEL_READY_ERRORS,
)
async def model_ready(runtime: RuntimeDep, name: str, version: str | None = None) -> ReadyResponse:
    _check_model(runtime, name, version)
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
    _check_model(runtime, name, version)
    runtime.check_ready()
    client = client_of(request, runtime)
    await runtime.admit_client(client)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaError(
            f"Content-Encoding {encoding!r} is not supported; send the body uncompressed"
        )
    payload, chunks = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
    tensor, chunk = payload.inputs[0], chunks[0]
    limit = runtime.settings.max_images_per_request
    if tensor.datatype == "BYTES":
        blobs = decode_bytes(tensor, chunk, max_first_dim=limit)
        result = await runtime.score_encoded(
            blobs, [f"{tensor.name}[{i}]" for i in range(len(blobs))]
        )
    else:  # FP32, FP16 or FP64 (InferenceRequest takes no other)
        array = decode_numeric(tensor, chunk, max_first_dim=limit).astype(np.float32)
        result = await runtime.score_array(array)
    query_attack = await runtime.screen_queries(client, result)
    available = [
        OutputTensor("probabilities", "FP32", np.asarray(result.probabilities, dtype=np.float32)),
        OutputTensor("label", "INT64", np.asarray(result.labels, dtype=np.int64)),
        OutputTensor("flagged", "BOOL", np.asarray(result.flagged, dtype=bool)),
        OutputTensor("score", "FP32", np.asarray(result.scores, dtype=np.float32)),
        OutputTensor("query_attack", "BOOL", query_attack),
    ]
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
