"""The FastAPI application factory.

``create_app(settings, guard=None)`` builds an app whose ``lifespan`` loads the bundle (a bad or
tampered bundle stops start-up), starts the micro-batcher and warms the model up in the
background; ``/readyz`` answers 503 until warm-up is done and again while shutting down.
With ``grpc_port`` set, the lifespan also starts the gRPC endpoint on the same runtime (after
the bundle is loaded) and stops it first (in-flight calls get the graceful timeout).
``uvicorn --factory service.app:create_app`` serves with settings from ``LAPGUARD_*``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

import detector
from detector.errors import ConfigError
from service.errors import install_error_handlers
from service.middleware import BodyLimitMiddleware, RequestContextMiddleware
from service.openapi import install_openapi
from service.routes import admin, explain, health, page, predict, v2
from service.runtime import Runtime
from service.settings import Settings, load_settings

if TYPE_CHECKING:
    from detector.guard import Guard
    from service.grpc_endpoint import GrpcEndpoint

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
            app.state.grpc = await start_grpc(runtime)
        except BaseException as error:
            runtime.startup_error = error
            await runtime.stop()
            raise
        try:
            yield
        finally:
            if app.state.grpc is not None:
                await app.state.grpc.stop(settings.graceful_timeout_s)
            await runtime.stop()

    app = FastAPI(
        title="lapguard", version=detector.__version__, description=DESCRIPTION, lifespan=lifespan
    )
    app.state.runtime = runtime
    app.state.grpc = None  # the gRPC endpoint while it serves (see start_grpc)
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


async def start_grpc(runtime: Runtime) -> GrpcEndpoint | None:
    """The gRPC endpoint on ``runtime``, listening; None when ``grpc_port`` is unset (grpcio is
    then never imported: serving REST alone does not need it)."""
    if runtime.settings.grpc_port is None:
        return None
    try:
        from service.grpc_endpoint import GrpcEndpoint
    except (ImportError, RuntimeError) as error:  # tritonclient.grpc raises RuntimeError too
        raise ConfigError(
            "the gRPC endpoint (--grpc-port, LAPGUARD_GRPC_PORT) needs the grpc extra: "
            f"pip install 'lapguard[grpc]' ({error})"
        ) from error
    return await GrpcEndpoint.start(runtime)
