"""`GET /openapi.json`: the OpenAPI 3.1 document of this server's routes."""

from __future__ import annotations

from aiohttp import web

from mstar.http.openapi.document import document
from mstar.http.responses import json_response


async def openapi(request: web.Request) -> web.Response:
    return json_response(document())
