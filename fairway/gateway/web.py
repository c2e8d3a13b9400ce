"""The chat page: `/` and its static files from `fairway/web/` (plain HTML + JS, no build step).

The page is public (it holds no data); it asks for an API key and sends it with every API call.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from fairway.gateway.errors import error_responses, not_found

router = APIRouter()

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# Only these kinds of file are served, and only from WEB_DIR itself: no paths, no source.
SERVED_SUFFIXES = {".html", ".js", ".css", ".svg", ".png", ".ico"}
# Revalidate each time: a redeployed page must never run against a stale script.
HEADERS = {"Cache-Control": "no-cache"}




def _file(*media_types: str | None) -> dict[int | str, dict]:
    """The 200 of a route that sends a file of one of these types (for the OpenAPI schema)."""
    return {200: {"description": "The file.", "content": {t: {"schema": {"type": "string"}} for t in media_types if t}}}


@router.get("/", response_class=FileResponse, responses=_file("text/html"))
async def index() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", headers=HEADERS)


@router.get("/web/{name}", response_class=FileResponse,
            responses={**_file(*(mimetypes.guess_type("f" + s)[0] for s in sorted(SERVED_SUFFIXES))),
                       **error_responses(404)})
async def asset(name: str) -> FileResponse:
    path = WEB_DIR / name
    if "/" in name or name.startswith(".") or path.suffix not in SERVED_SUFFIXES or not path.is_file():
        raise not_found(f"No file {name!r}.", "name", "not_found")
    return FileResponse(path, headers=HEADERS)
