"""A host and port in, the server's bound socket and its URLs out.

The socket is bound and listening before the model loads, so a port that is
taken (or a host that does not resolve) fails in a moment instead of after
the weights are in memory, and nobody takes the port meanwhile. aiohttp
accepts on it (`site`) once the engine runs; a client that connects before
then waits in the backlog.

The backlog holds connections the kernel has completed and the event loop
has not yet accepted. Python's and aiohttp's default, 128, is less than a
burst of streaming clients: past it the kernel drops a connection's
handshake and the client sends it again after its one-second timeout, a
second added to that request's first audio. The kernel caps the value at
`net.core.somaxconn`.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from aiohttp import web

# hundreds of streaming clients connect at once (a burst of speech requests); the event loop accepts them
# between other work, so they must be able to wait
BACKLOG = 2048
SOMAXCONN = "/proc/sys/net/core/somaxconn"
# a wildcard address is where the server listens, not where a browser can reach it
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`:`port`. Raises `OSError`
    (`socket.gaierror` for a host that does not resolve)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # rebind at once after a restart, past the old socket's TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def backlog_cap() -> int | None:
    """The kernel's cap on a backlog where it says (Linux), else None."""
    try:
        with open(SOMAXCONN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def site(runner: web.BaseRunner, sock: socket.socket) -> web.SockSite:
    """aiohttp's site on `sock`, keeping its backlog (the site listens on
    it again, by default with 128)."""
    return web.SockSite(runner, sock, backlog=BACKLOG)


def url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a name, not an address
        pass
    return f"http://{host}:{port}"


def demo_url(host: str, port: int) -> str:
    """Where a browser on this machine opens the demo page."""
    return url(_LOOPBACK.get(host, host), port) + "/"
