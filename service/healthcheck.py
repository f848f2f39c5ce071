"""Container health check without curl: ``python -m service.healthcheck [PATH]``.

Exits 0 when ``http://127.0.0.1:PORT/PATH`` (default ``/readyz``) answers 200, 1 otherwise; PORT
is the server's, from its `Settings` (``LAPGUARD_PORT``). Probes with urllib, so it needs no curl.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from service.settings import Settings

DEFAULT_PATH = "/readyz"


def check(path: str = DEFAULT_PATH, *, port: int | None = None, timeout: float = 4.0) -> bool:
    """True when ``path`` on the local server (``port``, default the settings' port) answers 200."""
    port = port if port is not None else Settings().port
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """The exit code of a probe of ``argv[0]`` (default ``/readyz``): 0 healthy, 1 not."""
    args = list(sys.argv[1:] if argv is None else argv)
    return 0 if check(args[0] if args else DEFAULT_PATH) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
