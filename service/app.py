"""The FastAPI application factory.

``create_app(settings, guard=None)`` builds an app whose ``lifespan`` loads the bundle (a bad or
tampered bundle stops start-up), starts the micro-batcher and warms the model up in the
background; ``/readyz`` answers 503 until warm-up is done and again while shutting down.
``uvicorn --factory service.app:create_app`` serves with settings from ``LAPGUARD_*``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

import detector
from service.errors import install_error_handlers
from service.middleware import BodyLimitMiddleware, RequestContextMiddleware
from service.openapi import install_openapi
from service.routes import admin, explain, health, page, predict, v2
from service.runtime import Runtime
from service.settings import Settings, load_settings

if TYPE_CHECKING:
    from detector.guard import Guard

DESCRIPTION = """Classify images and flag adversarial or out-of-distribution inputs in one synchronous
response. `score` is higher for more abnormal inputs; `flagged` is `score > threshold`, with the
threshold calibrated at the bundle's target false-positive rate."""


def create_app(settings: Settings | None = None, guard: Guard | None = None) -> FastAPI:
    """An app serving ``settings.bundle`` (or the given, already loaded ``guard``)."""
    settings = settings if settings is not None else load_settings()
    runtime = Runtime(settings, guard)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(
        title="lapguard", version=detector.__version__, description=DESCRIPTION, lifespan=lifespan
    )
    app.state.runtime = runtime
    install_error_handlers(app)
    install_openapi(app, settings)
    # Added innermost first: the request context (ids, log, metrics) wraps the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=runtime.metrics)
    # The inference routes first: a request is matched against the routes in this order.
    app.include_router(predict.router)
    app.include_router(v2.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(explain.router)
    app.include_router(page.router)
    app.mount("/static", page.static_files(), name="static")
    return app
