"""Running the app under uvicorn (what ``lapguard serve`` calls)."""

from __future__ import annotations

import logging.config
import math
from types import FrameType

import uvicorn
from fastapi import FastAPI

from detector.errors import ArtefactError, ConfigError, LapguardError
from service.app import create_app
from service.logs import logging_config
from service.runtime import Runtime
from service.settings import Settings

logger = logging.getLogger("lapguard.service")


class Server(uvicorn.Server):
    """uvicorn's server, which also marks the app as draining (``/readyz`` 503) on SIGTERM/SIGINT,
    before uvicorn stops accepting and waits for in-flight requests."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.draining = True
        super().handle_exit(sig, frame)


def build_server(settings: Settings, app: FastAPI | None = None) -> Server:
    """A server for ``app`` (default: ``create_app(settings)``), not started."""
    app = app if app is not None else create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=max(1, math.ceil(settings.graceful_timeout_s)),
        timeout_keep_alive=5,
    )
    return Server(config, app.state.runtime)


def serve(settings: Settings) -> None:
    """Serve until stopped. A bundle that cannot be loaded raises its error (nothing is served)."""
    logging.config.dictConfig(logging_config(settings.log_level))
    if settings.bundle is None:
        raise ConfigError("serve needs a bundle: pass --bundle DIR or set LAPGUARD_BUNDLE")
    if not settings.bundle.is_dir():
        raise ArtefactError(
            f"bundle directory {settings.bundle} does not exist; build one with `lapguard bundle`"
        )
    server = build_server(settings)
    try:
        server.run()
    except SystemExit as exit_:
        error = server.runtime.startup_error
        if isinstance(error, LapguardError):
            raise error from None
        if error is not None:
            raise LapguardError(f"the server did not start: {error}") from error
        if exit_.code not in (0, None):
            raise LapguardError(
                f"the server did not start (exit status {exit_.code}); see the log above"
            ) from None
