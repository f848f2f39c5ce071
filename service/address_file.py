"""The address a running server listens on, in a small JSON file (``LAPGUARD_STATE_FILE``).

``lapguard serve --port P`` binds P whatever ``LAPGUARD_PORT`` says, and a container's health
check is a separate process started by the engine with the image's environment, never the flags
of the server's command: it reads the port here. The server writes the file once it listens and
removes it when it stops; the write is atomic (a temporary file renamed), so a reader sees a
whole file or none.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path

#: Hosts that mean "every interface": the local server is probed on loopback then.
ANY_HOST = {"", "0.0.0.0", "::"}


def bound_address(sockets: Iterable[socket.socket]) -> tuple[str, int] | None:
    """(host, port) of the first TCP listener of ``sockets``; None when there is none (a Unix
    socket)."""
    for sock in sockets:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host, port = sock.getsockname()[:2]
            return str(host), int(port)
    return None


def write_address(path: Path, host: str, port: int) -> None:
    """Record that this process listens on ``host:port`` in ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
    os.replace(staging, path)


def remove_address(path: Path) -> None:
    """Forget the address, when this process wrote it (another server may have since)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def read_address(path: Path) -> tuple[str, int] | None:
    """(host to probe, port) from ``path``: loopback for a server bound to every interface;
    None when the file is missing or unreadable (no server wrote one)."""
    try:
        recorded = json.loads(path.read_text())
        host, port = str(recorded["host"]), int(recorded["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host in ANY_HOST:
        host = "::1" if host == "::" else "127.0.0.1"
    return host, port
