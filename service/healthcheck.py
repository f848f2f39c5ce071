"""Container health check without curl: ``python -m service.healthcheck [PATH]``.

Exits 0 when ``http://127.0.0.1:PORT/PATH`` (default ``/readyz``) answers 200, 1 otherwise. PORT
is the one the server listens on, read from the address file it writes (``LAPGUARD_STATE_FILE``,
see service/address_file.py): the engine starts this check as a separate process with the
image's environment, so a ``lapguard serve --port P`` is only known there. Without that file,
PORT is ``LAPGUARD_PORT``. Probes with urllib, so it needs no curl.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from service.address_file import read_address
from service.settings import Settings

DEFAULT_PATH = "/readyz"


def check(path: str = DEFAULT_PATH, *, port: int | None = None, timeout: float = 4.0) -> bool:
    """True when ``path`` on the local server (``port``, default :func:`local_address`'s)
    answers 200."""
    host, port = ("127.0.0.1", port) if port is not None else local_address()
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with urllib.request.urlopen(f"http://{authority}{path}", timeout=timeout) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def local_address() -> tuple[str, int]:
    """(host, port) of the local server: its address file's when it wrote one, else loopback
    and ``LAPGUARD_PORT``."""
    settings = Settings()
    recorded = read_address(settings.state_file) if settings.state_file is not None else None
    return recorded if recorded is not None else ("127.0.0.1", settings.port)


def main(argv: Sequence[str] | None = None) -> int:
    """The exit code of a probe of ``argv[0]`` (default ``/readyz``): 0 healthy, 1 not."""
    args = list(sys.argv[1:] if argv is None else argv)
    return 0 if check(args[0] if args else DEFAULT_PATH) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
