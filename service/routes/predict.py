"""``POST /v1/predict``: encoded images in (multipart ``files`` or JSON base64), prediction and
abnormality flag out, in one synchronous response (docs/architecture.md, "HTTP API")."""

from __future__ import annotations

import base64
import binascii

import numpy as np
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from detector.errors import InputError, InputTooLargeError, UnsupportedMediaError
from detector.guard import GuardResult
from service.deps import check_api_key, client_of, runtime_of
from service.openapi import component_ref
from service.routes.inference import inference_route
from service.runtime import Runtime
from service.schemas import ModelRef, Prediction, PredictRequest, PredictResponse

router = APIRouter(tags=["v1"])

IMAGES_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["files"],
                    "properties": {
                        "files": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "minItems": 1,
                            "description": "one or more image files; the server's "
                            "max_images_per_request at most (maxItems)",
                        }
                    },
                }
            },
            "application/json": {"schema": component_ref(PredictRequest)},
        },
    }
}

_ACCEPTED_PART_TYPES = ("image/", "application/octet-stream")


@inference_route(
    router,
    "/v1/predict",
    response_model=PredictResponse,
    openapi_extra=IMAGES_BODY,
    summary="classify images and flag adversarial / out-of-distribution ones",
)
async def predict(request: Request) -> PredictResponse:
    runtime = runtime_of(request)
    result, filenames, query_attack = await score_request(request, runtime)
    name, version = runtime.answered_by(result)  # the bundle that computed it, across a reload
    return PredictResponse(
        model=ModelRef(name=name, version=version),
        results=predictions(result, filenames, query_attack),
    )


async def score_request(
    request: Request, runtime: Runtime
) -> tuple[GuardResult, list[str | None], np.ndarray]:
    """The body's images scored (micro-batched) and screened for query attacks: (result, each
    image's filename, each image's ``query_attack``). Shared by ``/v1/predict`` and ``/v1/explain``."""
    check_api_key(request, runtime)
    runtime.check_ready()  # refuse before reading the body
    client = client_of(request, runtime)
    await runtime.admit_client(client)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == "multipart/form-data":
        blobs, names, filenames = await _read_multipart(request, runtime)
    elif media_type == "application/json" or media_type.endswith("+json"):
        blobs, names, filenames = await _read_json(request, runtime)
    else:
        raise UnsupportedMediaError(
            f"content type {media_type or '(none)'!r} is not accepted: send multipart/form-data with "
            'field "files", or application/json {"instances": [{"b64": "..."}]}'
        )
    result = await runtime.score_encoded(blobs, names)
    query_attack = await runtime.screen_queries(client, result)
    return result, filenames, query_attack


def predictions(
    result: GuardResult, filenames: list[str | None], query_attack: np.ndarray
) -> list[Prediction]:
    """One :class:`Prediction` per image of ``result``."""
    return [
        Prediction(
            index=i,
            filename=filenames[i],
            label=int(result.labels[i]),
            class_name=result.class_names[i],
            confidence=float(result.confidences[i]),
            flagged=bool(result.flagged[i]),
            score=float(result.scores[i]),
            threshold=float(result.threshold),
            query_attack=bool(query_attack[i]),
        )
        for i in range(len(result.labels))
    ]


def _check_count(count: int, runtime: Runtime) -> None:
    limit = runtime.settings.max_images_per_request
    if count > limit:
        raise InputTooLargeError(
            f"{count} images in one request, more than the limit of {limit}; split the request"
        )


async def _read_multipart(
    request: Request, runtime: Runtime
) -> tuple[list[bytes], list[str], list[str | None]]:
    limit = runtime.settings.max_images_per_request
    try:
        form = await request.form(max_files=limit, max_fields=limit + 16)
    except StarletteHTTPException as error:  # Starlette's multipart parser refuses with 400
        detail = str(error.detail)
        if "too many files" in detail.lower():
            raise InputTooLargeError(
                f"more than {limit} images in one request; split the request"
            ) from error
        raise InputError(f"cannot parse the multipart body: {detail}") from error
    try:
        parts = form.getlist("files")
        if not parts:
            raise RequestValidationError(
                [
                    {
                        "type": "missing",
                        "loc": ("body", "files"),
                        "msg": "Field required: send one or more images as files=@image.png",
                    }
                ]
            )
        _check_count(len(parts), runtime)
        blobs: list[bytes] = []
        names: list[str] = []
        filenames: list[str | None] = []
        for i, part in enumerate(parts):
            if not isinstance(part, UploadFile):
                raise InputError(
                    f"files[{i}] is a text field, not a file: send it as a file upload (files=@image.png)"
                )
            label = f"files[{i}] ({part.filename})" if part.filename else f"files[{i}]"
            declared = (part.content_type or "").lower()
            if declared and not declared.startswith(_ACCEPTED_PART_TYPES):
                raise UnsupportedMediaError(
                    f"{label}: content type {declared!r} is not an image; "
                    f"accepted formats: {', '.join(runtime.settings.image_formats)}"
                )
            blobs.append(await part.read())
            names.append(label)
            filenames.append(part.filename)
        return blobs, names, filenames
    finally:
        await form.close()


async def _read_json(
    request: Request, runtime: Runtime
) -> tuple[list[bytes], list[str], list[str | None]]:
    payload = PredictRequest.model_validate_json(await request.body())  # ValidationError -> 422
    _check_count(len(payload.instances), runtime)
    blobs = [
        _b64decode(instance.b64, f"instances[{i}].b64")
        for i, instance in enumerate(payload.instances)
    ]
    names = [f"instances[{i}]" for i in range(len(blobs))]
    return blobs, names, [None] * len(blobs)


def _b64decode(text: str, where: str) -> bytes:
    if text.startswith("data:") and "," in text:  # a data URI: data:image/png;base64,....
        text = text.split(",", 1)[1]
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as error:
        raise InputError(f"{where} is not valid base64: {error}") from error
