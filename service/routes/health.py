"""Operations: liveness, readiness, the served model's summary, Prometheus metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from service.deps import RuntimeDep
from service.schemas import BuildProgress, ErrorResponse, Health, ModelSummary, error_responses

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health, summary="liveness: the process answers")
async def healthz(runtime: RuntimeDep) -> Health:
    return Health(status="draining" if runtime.draining else "ok", ready=runtime.ready)


@router.get(
    "/readyz",
    response_model=Health,
    summary="readiness: the bundle is loaded and warmed up",
    responses={
        503: {"model": ErrorResponse, "description": "loading, warming up or shutting down"}
    },
)
async def readyz(runtime: RuntimeDep) -> Health:
    runtime.check_ready()
    return Health(status="ready", ready=True)


@router.get(
    "/v1/model",
    response_model=ModelSummary,
    summary="what is served (from the bundle manifest)",
    responses=error_responses(503),
)
async def model_summary(runtime: RuntimeDep) -> ModelSummary:
    guard = runtime.require_guard()
    manifest = runtime.manifest
    served = runtime.served

    def part(name: str) -> dict | None:
        value = getattr(manifest, name, None)
        if value is None:
            return None
        return value.model_dump(mode="json") if hasattr(value, "model_dump") else dict(value)

    created = getattr(manifest, "created", None)
    return ModelSummary(
        name=runtime.model_name,
        version=runtime.model_version,
        sha256=served.sha256 if served is not None else None,
        created=str(created) if created is not None else None,
        dataset=getattr(manifest, "dataset", None),
        class_names=runtime.class_names,
        input_spec=guard.input_spec.model_dump(mode="json"),
        network=part("network"),
        detector=part("detector"),
        threshold=float(guard.threshold),
        target_fpr=guard.target_fpr,
        operating_points=[
            point.model_dump(mode="json") for point in getattr(manifest, "operating_points", [])
        ],
        metrics=part("metrics"),
        cost=part("cost"),
        device=str(guard.device),
        max_batch_size=runtime.settings.max_batch_size,
        ready=runtime.ready,
        building=read_build_progress(runtime.settings.progress_file),
    )


def read_build_progress(path: Path | None) -> BuildProgress | None:
    """The progress file of the bundle being built, read now (a few hundred bytes, written
    atomically); None when there is none or it is missing, unreadable or not progress JSON."""
    if path is None:
        return None
    try:
        return BuildProgress.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
