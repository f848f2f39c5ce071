"""Admin routes: ``POST /v1/admin/reload`` swaps the served bundle without downtime (as SIGHUP
does, see service/server.py), behind the admin key."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter

from service.deps import ADMIN_KEY_REQUIRED, ADMIN_TAG, RuntimeDep
from service.reload import ServedBundle
from service.schemas import ADMIN_RESPONSES, BundleRef, ReloadRequest, ReloadResponse

router = APIRouter(tags=[ADMIN_TAG])


@router.post(
    "/v1/admin/reload",
    response_model=ReloadResponse,
    responses=ADMIN_RESPONSES,
    dependencies=ADMIN_KEY_REQUIRED,
    summary="hot-reload the bundle: verify, load and warm up, then swap; in-flight requests finish on the old one",
)
async def reload_bundle(runtime: RuntimeDep, body: ReloadRequest | None = None) -> ReloadResponse:
    """Serve ``bundle`` (default: the served directory, read again) once every checksum is
    verified and a forward pass succeeded; a refused bundle (422) leaves the previous one serving.
    Needs ``LAPGUARD_ADMIN_KEY`` (else ``LAPGUARD_API_KEY``) as ``X-API-Key`` or Bearer token."""
    started = time.perf_counter()
    path = Path(body.bundle) if body is not None and body.bundle else None
    previous, current = await runtime.reload(path)
    return ReloadResponse(
        previous=_ref(previous), current=_ref(current), seconds=time.perf_counter() - started
    )


def _ref(served: ServedBundle) -> BundleRef:
    return BundleRef(
        name=served.name,
        version=served.version,
        sha256=served.sha256,
        path=str(served.path) if served.path is not None else None,
    )
