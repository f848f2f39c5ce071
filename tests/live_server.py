"""`LiveServer`: the real app under uvicorn, in a background thread, on a loopback port."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx

from service.app import create_app
from service.runtime import Runtime
from service.server import build_server
from service.settings import Settings


class LiveServer:
    """The app under uvicorn in a background thread, on a socket bound to 127.0.0.1:<free port>."""

    def __init__(self, settings: Settings, guard=None, wait_for: str = "/readyz") -> None:
        self.wait_for = wait_for
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.settings = settings.model_copy(update={"host": "127.0.0.1", "port": self.port})
        self.app = create_app(self.settings, guard=guard)
        self.server = build_server(self.settings, self.app)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def runtime(self) -> Runtime:
        return self.app.state.runtime

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.thread.is_alive():
            try:
                if httpx.get(self.url + self.wait_for, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the server did not become ready: {self.runtime.startup_error or 'timed out after 60 s'}"
        )

    def stop(self) -> None:
        """What SIGTERM does: drain in-flight requests, then exit."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout=30)
        self.socket.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()
