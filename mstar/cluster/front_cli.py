"""The front's command line: `python -m mstar.cluster.front` over replicas
already serving, and the deadline flags it shares with `python -m
mstar.cluster` (`add_deadline_flags`, `check_deadline_flags`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from mstar.cluster import serving
from mstar.cluster.front import (BACKLOG, CONNECT_TIMEOUT_S, EXIT_S, GRACE_S, REPLICA_TIMEOUT_S, SHUTDOWN_TIMEOUT_S,
                                 Front)
from mstar.cluster.held_body import BODY_TIMEOUT_S


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m mstar.cluster.front --replicas URL,URL [--host H] [--port P] [--replica-timeout S]`: the
    front over replicas already serving (each `python -m mstar.http` on its own host or port)."""
    p = argparse.ArgumentParser(prog="python -m mstar.cluster.front",
                                description="One address over several mstar replicas. It checks no keys itself: "
                                            "a request's Authorization header goes on to the replica, whose "
                                            "--api-key decides (/metrics too).")
    p.add_argument("--replicas", required=True, help="base URLs, comma-separated: http://10.0.0.2:8000,...")
    p.add_argument("--host", default="127.0.0.1", help="the front's address, as the server's "
                                                        "--host (0.0.0.0: every interface; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the front's port (default 8080)")
    add_deadline_flags(p)
    a = p.parse_args(argv)
    urls = [u.strip() for u in a.replicas.split(",") if u.strip()]
    if not urls:
        p.error("--replicas names no replica")
    check_deadline_flags(p, a)
    try:
        serving.run(Front(urls, replica_timeout=a.replica_timeout, body_timeout=a.body_timeout).app(),
                    host=a.host, port=a.port, backlog=BACKLOG, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                    stop_within_s=GRACE_S - EXIT_S, header_timeout=a.header_timeout,
                    ready=lambda: print(f"mstar front over {', '.join(urls)} on http://{a.host}:{a.port}",
                                        flush=True))
    except OSError as e:  # the address is taken, or not this host's
        sys.exit(f"error: cannot listen on {a.host}:{a.port}: {e.strerror or e}")


def add_deadline_flags(p: argparse.ArgumentParser) -> None:
    """`--header-timeout`, `--body-timeout` and `--replica-timeout`."""
    p.add_argument("--header-timeout", type=float, default=serving.HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a client's request head may take to arrive before the front answers 408 and "
                        f"closes the connection (0: no limit; default {serving.HEADER_TIMEOUT_S:.0f})")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="seconds a small request body the front holds (so that a replica's refusal can send it to "
                        "another) may take to arrive before the front answers 408 and closes the connection, as the "
                        "replicas' own --body-timeout does (python -m mstar.cluster sets both); bodies streamed "
                        f"through meet the replica's (0: no limit; default {BODY_TIMEOUT_S:.0f})")
    p.add_argument("--replica-timeout", type=float, default=REPLICA_TIMEOUT_S, metavar="S",
                   help="seconds a replica may send nothing while it holds a request (a non-streamed answer sends "
                        "nothing until it is whole) before the client gets 504 replica_timeout (or, mid-stream, an "
                        "error event); streams that keep producing are never cut; a replica's connect is bounded "
                        f"at {CONNECT_TIMEOUT_S:.0f} s (default {REPLICA_TIMEOUT_S:.0f})")


def check_deadline_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The deadlines finite and not negative (the replica's above 0; 0 is no limit for the others), or a usage
    error."""
    if not (a.replica_timeout > 0 and math.isfinite(a.replica_timeout)):
        p.error(f"--replica-timeout must be a positive, finite number of seconds, got {a.replica_timeout}")
    for flag, value in (("--header-timeout", a.header_timeout), ("--body-timeout", a.body_timeout)):
        if not (value >= 0 and math.isfinite(value)):
            p.error(f"{flag} must be a finite number of seconds, 0 or more, got {value}")


if __name__ == "__main__":
    main()
