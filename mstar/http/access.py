"""Requests in, the ones a caller may make out: the bearer key and the
browser origins allowed to call.

With an API key every route but `/health` and the demo's files (`/`,
`/static/*`) wants `Authorization: Bearer <key>`; the realtime websocket also
takes the key the way browsers must send it, as the subprotocol
`openai-insecure-api-key.<key>` (a browser cannot set headers on a websocket).
A missing or wrong key gets a 401 in the OpenAI error shape with
`WWW-Authenticate: Bearer`, before any upgrade or body is read.

With allowed origins (CORS), a browser's preflight `OPTIONS` is answered here,
before the key is asked for (browsers send no credentials on a preflight),
allowing the headers it asks for (SDKs add their own, such as X-Stainless-*),
and every answer to an allowed origin carries `Access-Control-Allow-Origin`.
Without origins no CORS header is ever sent, so browsers keep other origins
out. Browsers apply no CORS to websockets, so a websocket upgrade from a page
of another origin (its `Origin` neither this server's host nor an allowed
origin) is refused here with a 403: a page on the web cannot open a session
on a server that listens on the user's machine.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from mstar.http.logs import Handler
from mstar.http.responses import error_response

OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/static/",)
SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
# headers a browser script may read besides the CORS-safelisted ones
EXPOSED_HEADERS = "X-Request-Id, Retry-After, X-Sample-Rate"
PREFLIGHT_MAX_AGE_S = 600
# an HTTP field name (RFC 9110 token): what a preflight may ask for and be echoed
_FIELD_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def presented_key(request: web.Request) -> str | None:
    """The key the request carries: a bearer token, or on a websocket
    upgrade the `openai-insecure-api-key.` subprotocol."""
    scheme, _, token = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket":
        for protocol in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(","):
            protocol = protocol.strip()
            if protocol.startswith(SUBPROTOCOL_KEY_PREFIX):
                return protocol[len(SUBPROTOCOL_KEY_PREFIX):]
    return None


def key_matches(presented: str, key: str) -> bool:
    # constant time: how much of a guess matched must not show in the answer's timing
    # surrogatepass: a header that is not UTF-8 reaches us with lone surrogates, and is simply no match
    return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


def unauthorized(message: str) -> web.Response:
    response = error_response(message, status=401, code="invalid_api_key")
    response.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
    return response


def bearer_auth(api_key: str) -> Middleware:
    """The middleware that turns away a request without the key."""
    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_open(request.path):
            return await handler(request)
        presented = presented_key(request)
        if presented is None:
            return unauthorized("no API key: send 'Authorization: Bearer <key>' (on the realtime websocket, the "
                                f"'{SUBPROTOCOL_KEY_PREFIX}<key>' subprotocol also works)")
        if not key_matches(presented, api_key):
            return unauthorized("the API key is not valid")
        return await handler(request)
    return authorize


class Origins:
    """The browser origins allowed to call (CORS); `*` allows any."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(o.rstrip("/") for o in origins)
        self.any = "*" in self.origins

    def __bool__(self) -> bool:
        return bool(self.origins)

    def allow_origin(self, origin: str | None) -> str | None:
        """The `Access-Control-Allow-Origin` value for `origin`, None when not allowed."""
        if origin is None:
            return None
        if self.any:
            return "*"
        return origin if origin in self.origins else None

    def allows_socket(self, request: web.Request) -> bool:
        """A websocket upgrade from no browser (no `Origin`), from a page of
        this server, or from an allowed origin."""
        origin = request.headers.get(hdrs.ORIGIN)
        return (origin is None or urlsplit(origin).netloc == request.host
                or self.allow_origin(origin.rstrip("/")) is not None)

    @web.middleware
    async def sockets(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Turns away a websocket upgrade from a page of another origin."""
        if request.headers.get(hdrs.UPGRADE, "").lower() == "websocket" and not self.allows_socket(request):
            origin = request.headers.get(hdrs.ORIGIN)
            return error_response(f"origin '{origin}' may not open a websocket here (--allowed-origins)",
                                  status=403, param="Origin", code="origin_not_allowed")
        return await handler(request)

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Answers a CORS preflight itself: it carries no key and reaches no route."""
        origin = request.headers.get(hdrs.ORIGIN)
        if (request.method != hdrs.METH_OPTIONS or origin is None
                or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers):
            return await handler(request)
        allowed = self.allow_origin(origin)
        if allowed is None:
            return error_response(f"origin '{origin}' is not allowed (--allowed-origins)", status=403,
                                  param="Origin", code="origin_not_allowed")
        response = web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: allowed,
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: ALLOWED_METHODS,
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: allowed_headers(request),
            hdrs.ACCESS_CONTROL_MAX_AGE: str(PREFLIGHT_MAX_AGE_S),
            hdrs.VARY: "Origin"})
        response.headers.add(hdrs.VARY, hdrs.ACCESS_CONTROL_REQUEST_HEADERS)  # the allowed headers echo it
        return response

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: every answer, streamed ones included, before its headers go out."""
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is None or hdrs.ACCESS_CONTROL_ALLOW_ORIGIN in response.headers:
            return
        if not self.any:  # allowed or not, the answer depends on the origin: caches must tell them apart
            response.headers.add(hdrs.VARY, "Origin")
        allowed = self.allow_origin(origin)
        if allowed is not None:
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = allowed
            response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSED_HEADERS


def allowed_headers(request: web.Request) -> str:
    """Our own headers plus whatever the preflight asks for. SDKs send headers of their own on every call
    (the `openai` JS SDK's X-Stainless-*), and a browser drops a request whose preflight left one out; the
    origin is allowed already and may send the key, so no header it adds gives it more."""
    names = {h.strip().lower(): h.strip() for h in ALLOWED_HEADERS.split(",")}
    for h in request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "").split(","):
        if _FIELD_NAME.match(h.strip()):
            names.setdefault(h.strip().lower(), h.strip())
    return ", ".join(names.values())


def access_middlewares(api_key: str | None, origins: Origins) -> list[Middleware]:
    """The preflight answer, then the key check: what goes before any route's
    own middlewares (admission, say), so a refused request costs nothing."""
    out: list[Middleware] = [origins.sockets]
    if origins:
        out.append(origins.preflight)
    if api_key:
        out.append(bearer_auth(api_key))
    return out
