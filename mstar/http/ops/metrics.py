"""`GET /metrics`: the engine's metrics in the Prometheus text format 0.0.4,
for a Prometheus server to scrape."""

from __future__ import annotations

from aiohttp import web

from mstar.http.keys import ENGINE

# aiohttp refuses a charset inside content_type, so the full header is set by hand
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE].metrics_text().encode()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
