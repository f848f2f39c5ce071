"""Request and response bodies: lapguard's v1 API (docs/architecture.md, "HTTP API") and the
Open Inference Protocol (KServe v2) REST messages."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


# ---- errors ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    code: str = Field(
        description="machine-readable error code, e.g. invalid_input, payload_too_large"
    )
    message: str = Field(description="what went wrong and what to do")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class V2ErrorResponse(BaseModel):
    """An error under ``/v2``: the Open Inference Protocol's shape, which stock clients read."""

    error: str = Field(description="what went wrong and what to do")
    code: str = Field(description="lapguard's machine-readable error code, as in ErrorDetail")


#: What each error status means, as the OpenAPI document says it.
ERROR_MEANINGS: dict[int, str] = {
    400: "an image cannot be decoded or used",
    401: "missing or wrong API key (when one is configured)",
    403: "refused for a cool-down after a query-based attack (query_attack_action=403)",
    404: "the request names something this server does not have",
    413: "body, image or image count over the limit",
    415: "unsupported content type or image format",
    422: "the request does not match the schema",
    429: "the queue is full, or a cool-down after a query-based attack (query_attack_action=429); retry after Retry-After seconds",
    503: "not ready or shutting down; retry after Retry-After seconds",
}


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` documenting the error ``statuses`` of a route, with body ``model``
    (``V2ErrorResponse`` under /v2). Every status a route can answer must be listed."""
    return {status: {"model": model, "description": ERROR_MEANINGS[status]} for status in statuses}


#: The error answers of the inference routes (POST /v1/predict, /v1/explain).
INFERENCE_ERRORS = (400, 401, 403, 413, 415, 422, 429, 503)
ERROR_RESPONSES = error_responses(*INFERENCE_ERRORS)


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
    """A pipeline run building the next bundle: its ``RUN/progress.json`` (training/pipeline/progress.py)."""

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
    threshold: float = Field(description="flagged when score > threshold")
    target_fpr: float | None = Field(
        default=None, description="the target false-positive rate the served threshold is for"
    )
    operating_points: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "the bundle's thresholds at other target FPRs (target_fpr, threshold, achieved_fpr); "
            "`lapguard serve --target-fpr` serves one"
        ),
    )
    metrics: dict[str, Any] | None = None
    cost: dict[str, Any] | None = Field(
        default=None,
        description=(
            "what the Guard costs beside the network: ratio (Guard time / the network's plain "
            "forward time), batch_size, device and rounds of the measurement made when the "
            "bundle was written, and the budget its feature set was chosen under"
        ),
    )
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
        400: "the body cannot be parsed (e.g. not UTF-8)",
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
#: The datatypes the model takes: images as floats [N, C, H, W], or encoded files.
InputDatatype = Literal["FP32", "FP64", "FP16", "BYTES"]


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
    shape: list[StrictInt] = Field(description="tensor shape; FP32 images are [N, C, H, W]")
    datatype: InputDatatype = Field(
        description="FP32 (or FP16, FP64) images [N, C, H, W], or BYTES encoded files [N]"
    )
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(default=None, description="row-major values (flat or nested)")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(
        min_length=1, max_length=1, description="one input: FP32 'input' or BYTES 'image'"
    )
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


# ---- explanations, the gallery and the live panel (the page at /) ----------------------------
class BlockBand(BaseModel):
    """Quantiles of each block's feature over the clean images of one class (training side)."""

    msq: list[list[float]] = Field(description="[quantile][block] of msq_m = ||r_m||^2 / d_m")
    cos: list[list[float]] = Field(description="[quantile][block] of cos_m = cos(r_m, 1)")


class Explanation(BaseModel):
    """How the input moved through the network's blocks, against clean images of its class."""

    msq: list[float] = Field(description="msq_m = ||r_m||^2 / d_m of each block m, this input")
    cos: list[float] = Field(description="cos_m = cos(r_m, 1) of each block m, this input")
    band: BlockBand | None = Field(
        default=None,
        description="the clean band of the predicted class (None: the bundle has none)",
    )
    outside: list[int] = Field(
        description="the blocks where msq or cos lies outside the band's outer quantiles"
    )


class ExplainedPrediction(Prediction):
    explanation: Explanation


class ExplainResponse(BaseModel):
    """``POST /v1/explain``: the predictions of ``/v1/predict`` plus each image's explanation."""

    model: ModelRef
    blocks: list[str] = Field(description="the residual blocks, in the order of every list")
    band_quantiles: list[float] | None = Field(
        default=None, description="the quantile levels of the bands' rows (None: no band)"
    )
    band_images: list[int] | None = Field(
        default=None, description="clean training images per class behind the band"
    )
    results: list[ExplainedPrediction]


class GallerySample(BaseModel):
    index: int
    name: str
    kind: Literal["clean", "adversarial", "ood"]
    source: str = Field(description="'test' for clean images, the attack key, or the OOD set")
    label: str | None = Field(default=None, description="the true class (None for OOD images)")
    url: str = Field(description="the PNG of this sample, as a client would send it")


class GalleryResponse(BaseModel):
    samples: list[GallerySample]


class ActivityBucket(BaseModel):
    start: float = Field(description="seconds since the epoch at the bucket's start")
    requests: int
    images: int
    flagged: int


class ScoreHistogram(BaseModel):
    edges: list[float] = Field(description="bin edges (len(counts) + 1)")
    counts: list[int]
    flagged: list[int] = Field(description="per bin, how many were flagged")


class ActivityResponse(BaseModel):
    """``GET /v1/stats``: recent scoring activity of this process (the page's live panel;
    Prometheus' /metrics stays the source for monitoring)."""

    window_s: float
    bucket_s: float
    requests: int
    images: int
    flagged: int
    request_rate: float = Field(description="requests per second over the window")
    flag_rate: float | None = Field(description="share of the window's images flagged")
    threshold: float | None
    buckets: list[ActivityBucket]
    histogram: ScoreHistogram
