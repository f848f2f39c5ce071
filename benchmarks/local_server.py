"""`lapguard serve` in a subprocess on a free 127.0.0.1 port, for the benchmarks that need a server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start_server(
    bundle: Path, *, flags: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[subprocess.Popen, str]:
    """Start the server with ``flags`` (and LAPGUARD_* ``env`` on top of a clean environment);
    return it and its URL once /readyz answers 200. Its stderr goes to a temporary file, never
    to an unread pipe: a full pipe (64 KiB of logs under load) would block the server."""
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
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited: {log.read()[-4000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(process)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (graceful drain), then kill if it does not exit."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
