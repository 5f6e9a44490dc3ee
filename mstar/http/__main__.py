"""The command line in, a serving process out: `python -m mstar.http`.

Parses the arguments (`mstar.config.parse_args`), configures logging, starts
the engine and the aiohttp app on host:port (on the loop `--event-loop`
names: the standard library's by default), sets the garbage collector for
serving (`quiet_gc`), and serves until SIGINT or SIGTERM. Then it stops
accepting connections, lets running requests finish for up to `DRAIN_S`,
aborts the rest (their streams end with an error event), cancels any
handler still running at `SHUTDOWN_GRACE_S` and shuts the engine down. A
second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import structlog

from mstar.config import ServerConfig, parse_args
from mstar.engine import builtin_models
from mstar.errors import ConfigError, MstarError
from mstar.http import listener
from mstar.http.deadlines import ServingRunner
from mstar.http.logs import configure_logging
from mstar.http.server import DRAIN_S, build_app

SHUTDOWN_GRACE_S = 10.0
# of it, running requests may go on for `DRAIN_S`; then they are aborted and their handlers get the rest to
# send their last event (a handler still running after that is cancelled)

log = structlog.get_logger("mstar.http")


async def serve(config: ServerConfig) -> None:
    """Serve until a stop signal; the engine lives and dies with the app."""
    try:  # a taken port fails here, before torch and the model load
        sock = listener.bind(config.host, config.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    from mstar.engine.engine import Engine  # torch comes in here, not at import of this module

    engine = Engine(config.engine)
    app = build_app(engine, manage_engine=True, config=config)
    # handler_cancellation: a client that hangs up cancels its handler, whose
    # `finally` aborts the engine request at once instead of at the next write.
    runner = ServingRunner(app, header_timeout=config.header_timeout, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S - DRAIN_S)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second signal; exiting without waiting", signal=sig.name)
            os._exit(128 + sig.value)
        log.info("stop signal received; draining", signal=sig.name, abort_after_s=DRAIN_S,
                 cancel_after_s=SHUTDOWN_GRACE_S)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        log.info("starting engine", model=config.engine.model, devices=list(config.engine.devices))
        await runner.setup()  # runs on_startup, which starts the engine
        frozen = quiet_gc()
        await listener.site(runner, sock).start()
        cap = listener.backlog_cap()
        if cap is not None and cap < listener.BACKLOG:
            log.warning("the kernel caps the listen backlog: a burst of more clients retries its handshakes a "
                        "second later", backlog=listener.BACKLOG, somaxconn=cap,
                        raise_with=f"sysctl -w net.core.somaxconn={listener.BACKLOG}")
        host, port = sock.getsockname()[:2]
        log.info("listening", url=listener.url(host, port), demo=listener.demo_url(host, port),
                 model=engine.model_name, gc_frozen_objects=frozen)
        await stop.wait()
    finally:
        await runner.cleanup()  # stop intake, drain, cancel, then engine.shutdown()
        sock.close()  # the site closed it if it started
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        log.info("stopped")


# young objects between collections while serving (Python's default: 700). A step of hundreds of rows makes
# and drops many times that; at 700 what lives a step or two is promoted until it sets off a full collection.
GC_YOUNG_THRESHOLD = 20_000


def quiet_gc() -> int:
    """Python's garbage collector set for serving; returns how many objects
    were frozen. Every collection holds the GIL, so the workers and the event
    loop wait each one out. Startup's objects (modules, the model, its graphs
    and kernels), once its garbage is collected, go into the permanent
    generation: a full collection over startup's ~330k (orpheus-tiny) took
    ~0.2 s on the CPU box, every stream stalled; it now walks only what
    serving made. The youngest generation is collected less often
    (`GC_YOUNG_THRESHOLD`), so what lives a step dies young instead of being
    promoted: with 256 speech streams on the CPU box, collections took
    ~25 ms a second with eight full ones in 30 s at Python's threshold, and
    ~1 ms a second with none at this one (`scripts/bench_host_speech.py`).
    A cycle of frozen objects that becomes garbage later is never collected:
    startup's objects live as long as the server."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()


def run_on(event_loop: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to its end on a new loop of the kind `--event-loop` names."""
    factory = None
    if event_loop != "asyncio":
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            if event_loop == "uvloop":
                coro.close()
                raise ConfigError("--event-loop uvloop: uvloop is not installed") from None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv, builtin_models())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        configure_logging(config.log_format, config.log_level)
    except ValueError as e:
        print(f"error: --log-level: {e}", file=sys.stderr)
        return 2
    try:
        run_on(config.event_loop, serve(config))
    except MstarError as e:  # a port taken, a model that does not load, a device or worker that did not start
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("server failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
