"""HTTP requests in, engine calls and JSON / streamed answers out.

`build_app` wires the routes to one `Engine`, adds the request-id / access-log
middleware and the error middleware that turns every failure into an
OpenAI-shaped JSON error (`RequestError` -> its 4xx, unknown route -> 404,
a client that hung up -> 499, anything unexpected -> a logged 500), and the
admission middleware: a generation request waits for room in the engine's
waiting line, then gets 429 with Retry-After (503 when the engine is down).
Before admission: the API key and CORS (`access.py`); innermost, the body
deadline (`deadlines.py`).
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING

import structlog
from aiohttp import HttpVersion11, hdrs, web

from mstar.config import ServerConfig
from mstar.errors import RequestError
from mstar.http.ops import demo, metrics, profile
from mstar.http.openapi import routes as openapi_routes
from mstar.http.realtime import routes as realtime_routes
from mstar.http.speech import routes as speech_routes
from mstar.http.text import native_routes, openai_routes, tokenize_routes
from mstar.http.access import Origins, access_middlewares
from mstar.http.deadlines import body_deadline
from mstar.http.keys import (ADMITTED_NOW, CLOSING, ENGINE, MEDIA, MEDIA_LIMITS, SOCKETS, STARTED, TARGETS,
                             TRANSCRIPTS)
from mstar.http.media import MediaDecoder
from mstar.http.logs import Handler, add_request_id_header, request_context
from mstar.http.responses import error_response, json_response, request_error_body
from mstar.http.submission import ClientGone, GenerationFailed, Targets
from mstar.http.text.transcripts import Transcripts

if TYPE_CHECKING:
    from mstar.engine.engine import Engine

log = structlog.get_logger("mstar.http")

# At shutdown, how long running requests may go on before they are aborted (within the process's grace).
DRAIN_S = 7.0
# Token-id prompts are long in JSON; aiohttp's 1 MiB default is too small.
MAX_BODY_BYTES = 32 * 2**20
# a request whose route holds "100 Continue" back until the middlewares have looked (`expect_later`)
CONTINUE_OWED = web.RequestKey("mstar_continue_owed", bool)
TOO_LARGE = (f"the request body is larger than the server's limit of {MAX_BODY_BYTES} bytes "
             f"({MAX_BODY_BYTES // 2**20} MiB)")


def _retry_after(response: web.Response, seconds: float | None) -> web.Response:
    """`response` asking the client to come back in `seconds` (whole, at least 1), if given."""
    if seconds is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(seconds)))
    return response


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return _retry_after(json_response(request_error_body(e), status=e.status), e.retry_after)
    except ClientGone:
        log.info("client went away before its answer; aborted")
        return web.Response(status=ClientGone.status)
    except GenerationFailed as e:
        log.warning("generation failed", error=e.message)
        return _retry_after(error_response(e.message, status=e.status, code=e.code), e.retry_after)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"no route for {request.method} {request.path}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif e.status == 413:
            message = TOO_LARGE
        elif e.status == 426:
            message = f"{request.path} speaks websocket only: open it with an 'Upgrade: websocket' request"
        else:  # the text aiohttp gave it (a websocket handshake's fault, say), or its reason phrase
            text = e.text or ""
            message = e.reason if text in ("", f"{e.status}: {e.reason}") else text
        response = error_response(message, status=e.status, code=e.reason.lower().replace(" ", "_"))
        # a 405 says which methods the route takes, a 426 what to upgrade to (with the upgrade connection option)
        for name in ("Allow", "Upgrade", "Connection"):
            if name in e.headers:
                response.headers[name] = e.headers[name]
        return response
    except Exception:
        log.exception("unhandled error", method=request.method, path=request.path)
        return error_response("internal server error", status=500, code="internal_error")


# the routes that start engine requests: under load they wait for room, then 429
ADMITTED = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/audio/speech"})


@web.middleware
async def admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in ADMITTED:
        return await handler(request)
    await request.app[ENGINE].admit()
    running = request.app[ADMITTED_NOW]
    running[id(request)] = request  # a request is not hashable
    try:
        return await handler(request)
    finally:
        running.pop(id(request), None)


async def expect_later(request: web.Request) -> web.Response | None:
    """aiohttp's answer to `Expect: 100-continue` (curl sends it for bodies over 1 MB) is "100 Continue"
    before any middleware has looked, so a client uploaded up to 32 MiB only to be told its key was wrong,
    the line full or the body too long. Here only an Expect we do not know is refused; `continue_body`
    asks for the body once the middlewares before it let the request through."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version == HttpVersion11 and expect.lower() != "100-continue":
        response = error_response(f"unknown Expect: {expect}", status=417, code="expectation_failed")
        response.force_close()
        return response
    if request.version == HttpVersion11:
        request[CONTINUE_OWED] = True
    return None


@web.middleware
async def continue_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.get(CONTINUE_OWED):
        if (request.content_length or 0) > MAX_BODY_BYTES:  # its connection closes (`close_if_body_unasked`)
            return error_response(TOO_LARGE, status=413, code="request_entity_too_large")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own: the answer proper has not begun
        request[CONTINUE_OWED] = False
    return await handler(request)


async def close_if_body_unasked(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a request refused before its "100 Continue" (a
    401, a 429) never sends its body, so its connection can carry nothing
    after it: read on, the next request would be taken for that body."""
    if request.get(CONTINUE_OWED):
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"  # the hook runs after the headers were made


async def health(request: web.Request) -> web.Response:
    report = request.app[ENGINE].health()
    return json_response(report, status=200 if report.get("status") == "ok" else 503)


def build_app(engine: Engine, *, manage_engine: bool = True, drain_s: float = DRAIN_S,
              config: ServerConfig | None = None) -> web.Application:
    """The aiohttp application serving `engine`.

    With `manage_engine` (the default) the app owns the engine's lifetime:
    `engine.start()` runs on app startup; on shutdown (the listening socket
    is closed by then) running requests, those whose bodies are still
    arriving included, get `drain_s` seconds to finish and the rest are
    aborted, so their streams end with an error event rather than a cut;
    `engine.shutdown()` runs on cleanup, once the handlers ended.
    Pass `manage_engine=False` when the caller starts and stops the engine
    itself (tests sharing one engine across several apps).

    `config` (default: `ServerConfig()`) gives the API key, the CORS origins,
    the body deadline, the media decoder's processes and its limits; the key
    check and a preflight's answer come before admission, so a refused
    request never waits for room. The media decoder's processes stop at
    cleanup.
    """
    config = config or ServerConfig()
    origins = Origins(config.allowed_origins)
    app = web.Application(middlewares=[request_context, errors_as_json, *access_middlewares(config.api_key, origins),
                                       admission, continue_body, body_deadline(config.body_timeout)],
                          client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[TARGETS] = Targets(engine)
    app[SOCKETS] = set()
    app[CLOSING] = set()
    admitted = app[ADMITTED_NOW] = {}
    app[STARTED] = int(time.time())
    media = app[MEDIA] = MediaDecoder(config.media_workers)  # its processes start with the first decode
    app[MEDIA_LIMITS] = config.media_limits
    app[TRANSCRIPTS] = Transcripts()

    async def stop_media(_: web.Application) -> None:
        await media.close()

    app.on_cleanup.append(stop_media)
    app.on_response_prepare.append(add_request_id_header)
    app.on_response_prepare.append(close_if_body_unasked)
    if origins:
        app.on_response_prepare.append(origins.add_headers)
    if manage_engine:
        async def start_engine(_: web.Application) -> None:
            await engine.start()

        async def drain_engine(_: web.Application) -> None:
            # a body still arriving is a request the engine has yet to see; one that only writes an answer out
            # (to a client that may have stopped reading) holds nothing the drain could finish
            await engine.drain(drain_s, busy=lambda: any(not r.content.is_eof() for r in admitted.values()))

        async def stop_engine(_: web.Application) -> None:
            await engine.shutdown()

        app.on_startup.append(start_engine)
        app.on_shutdown.append(drain_engine)
        app.on_cleanup.append(stop_engine)
    app.on_shutdown.append(realtime_routes.close_sockets)  # after the drain: their responses ended by then
    post = functools.partial(app.router.add_post, expect_handler=expect_later)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.metrics)
    app.router.add_get("/v1/models", openai_routes.list_models)
    app.router.add_get("/v1/models/{model:.+}", openai_routes.retrieve_model)  # an id may hold slashes
    post("/v1/completions", openai_routes.completions)
    post("/v1/chat/completions", openai_routes.chat_completions)
    post("/v1/audio/speech", speech_routes.speech)
    post("/generate", native_routes.generate)
    post("/tokenize", tokenize_routes.tokenize)
    post("/detokenize", tokenize_routes.detokenize)
    app.router.add_get("/v1/realtime", realtime_routes.realtime)
    app.router.add_get("/openapi.json", openapi_routes.openapi)
    app.router.add_get("/", demo.index)
    app.router.add_get("/static/{name}", demo.static_file)
    if config.profiling:
        post("/debug/profile", profile.profile)
    return app
