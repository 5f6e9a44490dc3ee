"""The browser demo's files over plain HTTP (no browser): `GET /` is the page,
every asset it links is served under /static/ with its content type, and
nothing but those files is reachable there. tests/test_demo_browser.py runs
the page itself in headless Chromium."""

from __future__ import annotations

import re

import aiohttp
import pytest

from mstar.http.ops.demo import STATIC_DIR

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_index_is_the_demo_page(http: aiohttp.ClientSession) -> None:
    async with http.get("/") as r:
        assert r.status == 200
        assert r.content_type == "text/html" and r.charset == "utf-8"
        page = await r.text()
    assert page == (STATIC_DIR / "index.html").read_text()
    for element in ("model", "voice", "text", "speak", "stop", "mic", "ttfa", "audioBytes", "transcript", "errors"):
        assert f'id="{element}"' in page, element


async def test_linked_assets_are_served_with_their_types(http: aiohttp.ClientSession) -> None:
    async with http.get("/") as r:
        page = await r.text()
    links = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    assert "/static/demo.js" in links and "/static/demo.css" in links
    types = {".js": "text/javascript", ".css": "text/css"}
    for link in links:
        async with http.get(link) as r:
            assert r.status == 200, link
            assert r.content_type == types[link[link.rindex("."):]], link
            assert await r.read() == (STATIC_DIR / link.rsplit("/", 1)[1]).read_bytes()


@pytest.mark.parametrize("path", ["/static/missing.js", "/static/.hidden.js", "/static/..%2Fserver.py",
                                  "/static/demo_routes.py"])
async def test_nothing_else_is_reachable(http: aiohttp.ClientSession, path: str) -> None:
    async with http.get(path) as r:
        assert r.status == 404, path
        assert (await r.json())["error"]["code"] == "not_found"
