"""A host and port in, the server's bound socket and its URLs out.

The socket is bound and listening before the model loads, so a port that is
taken (or a host that does not resolve) fails in a moment instead of after
the weights are in memory, and nobody takes the port meanwhile. aiohttp
accepts on it (`web.SockSite`) once the engine runs; a client that connects
before then waits in the backlog.
"""

from __future__ import annotations

import ipaddress
import os
import socket

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
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


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
