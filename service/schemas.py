"""Request and response bodies: lapguard's v1 API (DESIGN.md §7) and the Open Inference Protocol
(KServe v2) REST messages."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


# ---- errors ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    code: str = Field(
        description="machine-readable error code, e.g. invalid_input, payload_too_large"
    )
    message: str = Field(description="what went wrong and what to do")


class ErrorResponse(BaseModel):
    error: ErrorDetail


#: OpenAPI ``responses=`` for the error answers of the inference routes.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "an image cannot be decoded or used",
        401: "missing or wrong API key (when one is configured)",
        413: "body, image or image count over the limit",
        415: "unsupported content type or image format",
        422: "the body does not match the schema",
        403: "refused for a cool-down after a query-based attack (query_attack_action=403)",
        429: "the queue is full, or a cool-down after a query-based attack (query_attack_action=429); retry after Retry-After seconds",
        503: "not ready or shutting down; retry after Retry-After seconds",
    }.items()
}


# ---- v1 --------------------------------------------------------------------------------------
class ImageInstance(BaseModel):
    model_config = ConfigDict(extra="forbid")

    b64: str = Field(description="the encoded image file (PNG, JPEG, ...), base64")


class PredictRequest(BaseModel):
    """JSON form of ``POST /v1/predict`` (the other form is multipart with field ``files``)."""

    model_config = ConfigDict(extra="forbid")

    instances: list[ImageInstance] = Field(min_length=1)


class ModelRef(BaseModel):
    name: str
    version: str


class Prediction(BaseModel):
    index: int = Field(description="position of the image in the request")
    filename: str | None = Field(
        default=None, description="the uploaded file's name (multipart only)"
    )
    label: int
    class_name: str
    confidence: float = Field(description="the network's softmax probability of the label")
    flagged: bool = Field(
        description="true when the input looks adversarial or out of distribution"
    )
    score: float = Field(
        description="abnormality score; higher = more abnormal; flagged when > threshold"
    )
    threshold: float
    query_attack: bool = Field(
        description=(
            "true when this client's recent queries hold near-duplicates of this image, as "
            "query-based black-box attacks (HopSkipJump, Boundary, Square) send; stateful, per "
            "client (API key, else address); always false when LAPGUARD_QUERY_MEMORY=off"
        )
    )


class PredictResponse(BaseModel):
    model: ModelRef
    results: list[Prediction]


class BuildProgress(BaseModel):
    """A pipeline run building the next bundle: its ``RUN/progress.json`` (training/progress.py)."""

    preset: str = Field(description="the pipeline preset being run, e.g. quick")
    step: str = Field(description="the step under way (or the last one), e.g. 'attack lap/cw'")
    done: int = Field(ge=0, description="steps finished")
    total: int = Field(ge=1, description="steps in the run")
    state: Literal["running", "done", "failed"] = Field(
        description="running; done (its bundle is written); failed (see message)"
    )
    started: str = Field(description="when the run started, ISO 8601 (UTC)")
    updated: str = Field(description="when the file was last written, ISO 8601 (UTC)")
    message: str | None = Field(
        default=None, description="why the run failed or stopped; null while it runs"
    )


class ModelSummary(BaseModel):
    """``GET /v1/model``: what is served, from the bundle's manifest."""

    name: str
    version: str
    sha256: str | None = Field(
        default=None,
        description="sha256 of the bundle's manifest.json, which lists the sha256 of every file",
    )
    created: str | None = None
    dataset: str | None = None
    class_names: list[str]
    input_spec: dict[str, Any]
    network: dict[str, Any] | None = None
    detector: dict[str, Any] | None = None
    threshold: float
    target_fpr: float | None = None
    metrics: dict[str, Any] | None = None
    device: str
    max_batch_size: int
    ready: bool
    building: BuildProgress | None = Field(
        default=None,
        description=(
            "progress of the pipeline run building the next bundle (LAPGUARD_PROGRESS_FILE); "
            "null when none is configured or its file is missing or unreadable"
        ),
    )


# ---- admin ----------------------------------------------------------------------------------
class ReloadRequest(BaseModel):
    """Body of ``POST /v1/admin/reload`` (optional): which bundle to serve next."""

    model_config = ConfigDict(extra="forbid")

    bundle: str | None = Field(
        default=None,
        description="bundle directory on the server; default: the served directory, read again",
    )


class BundleRef(BaseModel):
    name: str
    version: str
    sha256: str | None = Field(default=None, description="sha256 of the bundle's manifest.json")
    path: str | None = Field(default=None, description="the bundle directory on the server")


class ReloadResponse(BaseModel):
    previous: BundleRef
    current: BundleRef = Field(description="the bundle that answers from now on")
    seconds: float = Field(description="time to verify, load and warm up the new bundle")


#: OpenAPI ``responses=`` of the admin routes.
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        401: "missing or wrong admin key (LAPGUARD_ADMIN_KEY, else LAPGUARD_API_KEY)",
        403: "admin calls are off: no admin or API key is configured",
        422: "the bundle is refused (missing, tampered, another input spec, fails a forward pass); the previous bundle keeps serving",
        503: "not loaded yet or shutting down",
    }.items()
}


class Health(BaseModel):
    status: Literal["ok", "ready", "not_ready", "draining"]
    ready: bool


# ---- Open Inference Protocol (v2) ------------------------------------------------------------
Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class LiveResponse(BaseModel):
    live: bool


class ReadyResponse(BaseModel):
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int]
    parameters: dict[str, Any] | None = None


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] | None = None


class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(description="tensor shape; FP32 images are [N, C, H, W]")
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(default=None, description="row-major values (flat or nested)")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]
