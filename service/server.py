"""Running the app under uvicorn (what ``lapguard serve`` calls); SIGHUP reloads the bundle."""

from __future__ import annotations

import asyncio
import logging.config
import math
import signal
import socket
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from detector.errors import ArtefactError, ConfigError, LapguardError
from service.address_file import bound_address, remove_address, write_address
from service.app import create_app
from service.logs import logging_config
from service.runtime import Runtime, batch_close_timeout_s
from service.settings import Settings

logger = logging.getLogger("lapguard.service")


class Server(uvicorn.Server):
    """uvicorn's server, which also marks the app as draining (``/readyz`` 503) on SIGTERM/SIGINT,
    before uvicorn stops accepting and waits for in-flight requests, and reloads the bundle on
    SIGHUP (from its directory, read again: see :meth:`Runtime.reload`; the outcome is logged).
    With a ``state_file``, it records the address it listens on there once it does (see
    service/address_file.py: the container health check reads it) and removes it on stop."""

    def __init__(
        self, config: uvicorn.Config, runtime: Runtime, state_file: Path | None = None
    ) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.state_file = state_file
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reloads: set[asyncio.Task[None]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        listeners = [sock for server in self.servers for sock in server.sockets or ()]
        address = bound_address(listeners) if self.started else None
        if self.state_file is not None and address is not None:
            write_address(self.state_file, *address)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.state_file is not None:
            remove_address(self.state_file)
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.runtime.draining = True
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's SIGINT/SIGTERM handling, plus SIGHUP (main thread only, as for any handler)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "SIGHUP"
        ):
            with super().capture_signals():
                yield
            return
        self._loop = asyncio.get_running_loop()
        previous = signal.signal(signal.SIGHUP, self.handle_reload)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def handle_reload(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: start a reload on the event loop (the handler itself must not block)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_reload)

    def _start_reload(self) -> None:
        logger.info("SIGHUP: reloading the bundle")
        task = asyncio.get_running_loop().create_task(
            self.runtime.reload_quietly(), name="lapguard-reload"
        )
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)


def graceful_shutdown_s(settings: Settings) -> int:
    """How long uvicorn waits for in-flight requests after SIGTERM (whole seconds, at least 1)."""
    return max(1, math.ceil(settings.graceful_timeout_s))


def stop_seconds(settings: Settings) -> float:
    """The longest a stop takes after SIGTERM: the in-flight requests, then the batch being
    computed. A supervisor's grace period (Kubernetes' terminationGracePeriodSeconds, less its
    preStop) must cover it, or the last answers are cut off."""
    return graceful_shutdown_s(settings) + batch_close_timeout_s(settings)


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
        timeout_graceful_shutdown=graceful_shutdown_s(settings),
        timeout_keep_alive=5,
    )
    return Server(config, app.state.runtime, state_file=settings.state_file)


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
