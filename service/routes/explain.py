"""What the page at ``/`` shows, through the API: ``POST /v1/explain`` (the predictions plus each
image's per-block transport features against the clean band of its predicted class),
``GET /v1/gallery`` and its PNGs (the bundle's samples), ``GET /v1/stats`` (recent activity)."""

from __future__ import annotations

import io

import numpy as np
from fastapi import APIRouter, Path, Query, Request, Response
from PIL import Image

from detector.explain import CleanBand, Gallery
from detector.guard import Guard, GuardResult
from service.deps import API_KEY_REQUIRED, RuntimeDep, runtime_of
from service.errors import NotFoundError
from service.routes.inference import inference_route
from service.routes.predict import IMAGES_BODY, predictions, score_request
from service.schemas import (
    ActivityResponse,
    BlockBand,
    ExplainedPrediction,
    ExplainResponse,
    Explanation,
    GalleryResponse,
    GallerySample,
    ModelRef,
    error_responses,
)

router = APIRouter(tags=["explain"])


@inference_route(
    router,
    "/v1/explain",
    response_model=ExplainResponse,
    openapi_extra=IMAGES_BODY,
    summary="as /v1/predict, plus each image's per-block features against the clean band of its class",
)
async def explain(request: Request) -> ExplainResponse:
    runtime = runtime_of(request)
    result, filenames, query_attack = await score_request(request, runtime)
    served = getattr(result, "served", None)
    guard: Guard = served.guard if served is not None else runtime.require_guard()
    band = guard.band
    name, version = runtime.answered_by(result)
    return ExplainResponse(
        model=ModelRef(name=name, version=version),
        blocks=list(guard.block_names),
        band_quantiles=list(band.quantiles) if band is not None else None,
        band_images=band.counts.tolist() if band is not None else None,
        results=[
            ExplainedPrediction(**p.model_dump(), explanation=_explanation(result, i, band))
            for i, p in enumerate(predictions(result, filenames, query_attack))
        ],
    )


def _explanation(result: GuardResult, row: int, band: CleanBand | None) -> Explanation:
    """Image ``row``'s (msq, cos) per block, its class's band and the blocks outside it."""
    assert result.blocks is not None  # the Guard always returns them
    msq, cos = result.blocks[row]
    clean = band.for_class(int(result.labels[row])) if band is not None else None
    if clean is None:
        return Explanation(msq=msq.tolist(), cos=cos.tolist(), outside=[])
    msq_band, cos_band = np.asarray(clean["msq"])[[0, -1]], np.asarray(clean["cos"])[[0, -1]]
    outside = (msq < msq_band[0]) | (msq > msq_band[1]) | (cos < cos_band[0]) | (cos > cos_band[1])
    return Explanation(
        msq=msq.tolist(),
        cos=cos.tolist(),
        band=BlockBand(**clean),
        outside=np.flatnonzero(outside).tolist(),
    )


@router.get(
    "/v1/gallery",
    response_model=GalleryResponse,
    summary="the bundle's sample images (clean, adversarial, out-of-distribution) to try",
    responses=error_responses(401, 503),
    dependencies=API_KEY_REQUIRED,
)
async def gallery(runtime: RuntimeDep) -> GalleryResponse:
    samples = _gallery(runtime.require_guard())
    return GalleryResponse(
        samples=[
            GallerySample(index=i, url=f"/v1/gallery/{i}.png", **item.model_dump())
            for i, item in enumerate(samples.items)
        ]
    )


@router.get(
    "/v1/gallery/{index}.png",
    response_class=Response,
    summary="one gallery sample as a PNG (8-bit, as a client would send it)",
    responses={200: {"content": {"image/png": {}}}, **error_responses(401, 404, 422, 503)},
    dependencies=API_KEY_REQUIRED,
)
async def gallery_image(runtime: RuntimeDep, index: int = Path(ge=0)) -> Response:
    samples = _gallery(runtime.require_guard())
    if index >= len(samples.items):
        raise NotFoundError(f"no gallery sample {index}: the bundle has {len(samples.items)}")
    pixels = samples.images[index]
    image = Image.fromarray(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return Response(buffer.getvalue(), media_type="image/png")


def _gallery(guard: Guard) -> Gallery:
    spec = guard.input_spec
    empty = Gallery([], np.zeros((0, *spec.shape), np.uint8))
    return guard.gallery if guard.gallery is not None else empty


@router.get(
    "/v1/stats",
    response_model=ActivityResponse,
    summary="recent activity: request and flag rates, score histogram (the page's live panel)",
    responses=error_responses(401, 422),
    dependencies=API_KEY_REQUIRED,
)
async def stats(
    runtime: RuntimeDep,
    window_s: float = Query(300.0, ge=10.0, le=3600.0, description="seconds looked back"),
    bucket_s: float = Query(10.0, ge=1.0, le=600.0, description="seconds per bucket"),
) -> ActivityResponse:
    summary = runtime.activity.summary(window_s, min(bucket_s, window_s))
    guard = runtime.guard
    return ActivityResponse(threshold=guard.threshold if guard else None, **summary)  # type: ignore[arg-type]
