"""Logging of the HTTP layer: every line logged while serving a request
carries its id, and each request ends with one access line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import orjson
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from mstar.http.logs import add_request_id_header, configure_logging, request_context


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the logging setup back as it was after a test configured its own."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    structlog.reset_defaults()


async def inside(request: web.Request) -> web.Response:
    structlog.get_logger("test").info("handling", step=1)
    logging.getLogger("plain.stdlib").warning("from stdlib too")
    return web.Response(text="ok")


async def test_request_id_on_every_line(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "info")  # here, not in a fixture: it binds the stderr capsys installed
    app = web.Application(middlewares=[request_context])
    app.on_response_prepare.append(add_request_id_header)
    app.router.add_get("/x", inside)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/x", headers={"X-Request-Id": "req-42"})
        assert r.status == 200 and r.headers["X-Request-Id"] == "req-42"
        r = await client.get("/x", headers={"X-Request-Id": "not a sane id!"})
        made_up = r.headers["X-Request-Id"]
    assert made_up != "not a sane id!" and len(made_up) == 32
    lines = [orjson.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    ours = [line for line in lines if line.get("request_id") == "req-42"]
    assert [line["event"] for line in ours] == ["handling", "from stdlib too", "request"]
    access = ours[-1]
    assert access["method"] == "GET" and access["path"] == "/x" and access["status"] == 200
    assert access["duration_ms"] >= 0 and access["level"] == "info" and "timestamp" in access
    assert any(line.get("request_id") == made_up and line["event"] == "request" for line in lines)


def test_bad_level_is_refused() -> None:
    with pytest.raises(ValueError):
        configure_logging("json", "chatty")



async def test_the_request_id_is_bound_only_while_its_request_runs() -> None:
    seen: list[object] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(structlog.contextvars.get_contextvars().get("request_id"))
        return web.Response(text="ok")

    outer = structlog.contextvars.bind_contextvars(request_id="outer", other=1)
    try:
        for headers in ({"X-Request-Id": "req-1"}, {}):
            response = await request_context(make_mocked_request("GET", "/x", headers=headers), handler)
            assert response.status == 200
            # after it, what was bound before, and nothing else touched
            assert structlog.contextvars.get_contextvars() == {"request_id": "outer", "other": 1}
    finally:
        structlog.contextvars.reset_contextvars(**outer)
    assert seen[0] == "req-1" and isinstance(seen[1], str) and len(seen[1]) == 32  # while it ran: its own id
    assert "request_id" not in structlog.contextvars.get_contextvars()
