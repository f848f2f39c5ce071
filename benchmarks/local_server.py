"""`lapguard serve` on a free 127.0.0.1 port, for the benchmarks that need a server: in a subprocess
(what the figures are measured on), or, for the small modes, in a thread of this process (the same
app and settings without the subprocess's imports: seconds saved per server in the tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ThreadServer:
    """The app under uvicorn in a daemon thread of this process, on ``sock``; its forward pass on
    one torch thread unless ``overrides`` say otherwise (it shares the cores with its caller).
    It answers what the benchmarks ask of a ``Popen``: ``pid`` (this process), ``poll``,
    ``send_signal`` (SIGTERM: the server's own graceful exit), ``wait`` and ``kill``."""

    def __init__(self, bundle: Path, sock: socket.socket, overrides: dict[str, str]) -> None:
        from service.server import build_server
        from service.settings import load_settings

        host, port = sock.getsockname()
        overrides = {"torch_threads": "1", **overrides}
        self.settings = load_settings(bundle=bundle, host=host, port=port, **overrides)
        self.server = build_server(self.settings)
        self.socket = sock
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        self.pid = os.getpid()

    def poll(self) -> int | None:
        """None while it serves, then 0."""
        return None if self.thread.is_alive() else 0

    def send_signal(self, sig: int) -> None:
        """SIGTERM or SIGINT: drain in-flight requests, then exit (uvicorn's handler)."""
        self.server.handle_exit(sig, None)

    def wait(self, timeout: float | None = None) -> int:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired("lapguard serve (thread)", timeout or 0)
        self.socket.close()
        return 0

    def kill(self) -> None:
        """uvicorn's forced exit: stop waiting for in-flight requests."""
        self.server.force_exit = True
        self.server.should_exit = True

    def stop(self) -> None:
        """What SIGTERM does: drain in-flight requests, then exit."""
        self.send_signal(signal.SIGTERM)
        self.wait(timeout=30)


Server = subprocess.Popen | ThreadServer


def start_server(
    bundle: Path,
    *,
    flags: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 120,
    in_process: bool = False,
) -> tuple[Server, str]:
    """Start the server with ``flags`` (and LAPGUARD_* ``env`` on top of a clean environment);
    return it and its URL once /readyz answers 200. Its stderr goes to a temporary file, never
    to an unread pipe: a full pipe (64 KiB of logs under load) would block the server.
    ``in_process``: a :class:`ThreadServer` instead, with ``flags`` and ``env`` as its settings."""
    if in_process:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = ThreadServer(bundle, sock, settings_of(flags, env or {}))
        return server, wait_ready(server, f"http://127.0.0.1:{sock.getsockname()[1]}", timeout)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith("LAPGUARD_") or k == "LAPGUARD_DATA"
    }
    environment.update(env or {})
    command = [sys.executable, "-m", "training.cli.main", "serve", "--bundle", str(bundle), "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", *flags]  # fmt: skip
    log = tempfile.TemporaryFile(mode="w+", prefix="lapguard-serve-")  # noqa: SIM115 (lives with the server)
    process = subprocess.Popen(
        command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=log, text=True
    )
    try:
        return process, wait_ready(process, f"http://127.0.0.1:{port}", timeout)
    except SystemExit as error:
        log.seek(0)
        raise SystemExit(f"{error}; its log: {log.read()[-4000:]}") from None


def settings_of(flags: list[str], env: dict[str, str]) -> dict[str, str]:
    """``lapguard serve`` flags (``--max-batch-size 64``) and LAPGUARD_* variables as settings."""
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    settings = {flag.removeprefix("--").replace("-", "_"): value for flag, value in pairs.items()}
    settings.update({k.removeprefix("LAPGUARD_").lower(): v for k, v in env.items()})
    return settings


def wait_ready(server: Server, url: str, timeout: float) -> str:
    """``url`` once its /readyz answers 200; stops the server and exits if it does not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s")


def stop_server(server: Server) -> None:
    """SIGTERM (graceful drain), then kill if it does not exit."""
    if isinstance(server, ThreadServer):
        server.stop()
        return
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)
