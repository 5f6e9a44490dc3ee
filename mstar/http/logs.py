"""Log records in, one formatted line each out (JSON or console).

`configure_logging` is called once, at startup: structlog and the standard
`logging` records of every library (aiohttp, the engine) go through the same
renderer. The request middleware binds a request id to the context so every
line logged while serving a request carries it, and writes one access line
per request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable

import orjson
import structlog
from aiohttp import web

from mstar.http.ids import uuid4_hex
from mstar.http.keys import REQUEST_ID

REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

log = structlog.get_logger("mstar.http")


def _orjson_dumps(obj: object, default: Callable[[object], object] | None = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Route structlog and stdlib logging through one renderer at `level`."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level '{level}'")
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        shared.append(structlog.processors.format_exc_info)
    else:
        # plain tracebacks: a rich one prints every frame's locals, an API key among them
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                                 exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        # Level first: a disabled debug line then costs no further processing.
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached, so loggers made before this call (module globals) follow it.
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Our middleware writes the access line; aiohttp's own would duplicate it.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def request_id_for(request: web.Request) -> str:
    """The client's `X-Request-Id` when it is a sane token, else a fresh one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _CLIENT_ID.match(given) else uuid4_hex()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind the request id for every log line of this request, echo it in the
    answer's headers, and log one access line when the request ends."""
    request_id = request_id_for(request)
    request[REQUEST_ID] = request_id
    start = time.perf_counter()
    status = 500
    # set and reset by token: `bound_contextvars` copies the whole context to save what it binds over
    bound = structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # nginx's "client closed request"
            raise
        finally:
            level = logging.DEBUG if request.path == "/health" else logging.INFO
            log.log(level, "request", method=request.method, path=request.path, status=status,
                    duration_ms=round((time.perf_counter() - start) * 1000, 2))
    finally:
        structlog.contextvars.reset_contextvars(**bound)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: runs before headers go out, streams included."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
