"""The page at ``/``: one HTML file and its script and style, shipped in the package
(``service/static``), served by this process with no build step and no CDN. It uses nothing the
API does not offer (``/v1/model``, ``/v1/explain``, ``/v1/gallery``, ``/v1/stats``)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(str(files("service") / "static"))
#: Scripts and styles from this server only; images may be the page's own blob: URLs.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; "
        "base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["page"])


@router.get(
    "/", response_class=HTMLResponse, summary="the page: try images, see why they are flagged"
)
async def page() -> HTMLResponse:
    return HTMLResponse((STATIC / "index.html").read_text(), headers=SECURITY_HEADERS)


def static_files() -> StaticFiles:
    """The page's script and style, mounted at ``/static``."""
    return StaticFiles(directory=STATIC)
