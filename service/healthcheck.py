"""Container health check without curl: ``python -m service.healthcheck [PATH]``.

Exits 0 when ``http://127.0.0.1:$LAPGUARD_PORT/PATH`` (default ``/readyz``) answers 200, 1
otherwise. Uses the standard library only, so it starts fast and needs nothing installed.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

DEFAULT_PATH = "/readyz"


def check(path: str = DEFAULT_PATH, *, port: int | None = None, timeout: float = 4.0) -> bool:
    port = port if port is not None else int(os.environ.get("LAPGUARD_PORT", "8000"))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return 0 if check(args[0] if args else DEFAULT_PATH) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
