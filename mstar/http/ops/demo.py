"""`GET /` and `GET /static/{name}`: the browser demo (plain HTML, CSS, JS).

The files live in `static/` next to this module and ship as package data.
Only the files found there are served, by exact name, so a request cannot
reach anything else on disk; the content type is fixed per suffix rather than
guessed from the host's mime tables, which differ between machines.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parent.parent / "static"
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _file(name: str) -> web.FileResponse:
    path = STATIC_DIR / name
    content_type = CONTENT_TYPES.get(path.suffix)
    if "/" in name or name.startswith(".") or content_type is None or not path.is_file():
        raise web.HTTPNotFound()
    # no-cache: the page is small, and a stale script against a newer server misleads
    return web.FileResponse(path, headers={"Content-Type": f"{content_type}; charset=utf-8",
                                           "Cache-Control": "no-cache"})


async def index(request: web.Request) -> web.FileResponse:
    return _file("index.html")


async def static_file(request: web.Request) -> web.FileResponse:
    return _file(request.match_info["name"])
