"""A server under benchmark: `python -m mstar.http` started in a subprocess
on loopback (or one already running, `--url`), waited for until /health
answers, and stopped through SIGTERM however the benchmark ends; the
client's event loop (uvloop when installed). The speech, omni, realtime,
scheduler and load benchmarks share it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
SERVER_STOP_GRACE_S = 30.0  # the server drains for up to 10 s, then shuts its engine down


class Server:
    """`python -m mstar.http` in a subprocess with its output in a log file:
    the benchmark's client and the server must not share an event loop or a
    GIL, or the client's timing would measure its own server."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ) | self.env
        # the server imports mstar from this checkout whether or not it is pip-installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env=env)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (the server drains and frees its devices), then SIGKILL if it
        hangs; a no-op once stopped."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(SERVER_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"# server pid {proc.pid} did not stop in {SERVER_STOP_GRACE_S:.0f} s; killing it", flush=True)
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_server_args(p: argparse.ArgumentParser, *, startup_timeout: float) -> None:
    """The flags of a script that starts its own server (or uses `--url`)."""
    p.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    p.add_argument("--server-args", default="", help="more arguments for python -m mstar.http, one string")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temp file)")
    p.add_argument("--url", default=None, help="use a running server instead of starting one")
    p.add_argument("--startup-timeout", type=float, default=startup_timeout, help="seconds to wait for /health")
    p.add_argument("--server-trace", type=Path, default=None, metavar="FILE",
                   help="start scripts/traced_server.py instead, its engine's timeline written to FILE at exit")


def start_server(a: argparse.Namespace, serve_args: list[str], log_prefix: str) -> tuple[str, Server | None, str]:
    """The base URL, the server this script started (None with `--url`) and
    a line describing it. The server runs `python -m mstar.http` on loopback
    with `serve_args`, then `--server-args`."""
    if a.url:
        url = a.url.rstrip("/")
        return url, None, f"running server at {url}"
    port = a.port or free_port()
    entry, env = ["-m", "mstar.http"], {}
    if getattr(a, "server_trace", None) is not None:
        entry, env = [str(REPO / "scripts" / "traced_server.py")], {"MSTAR_TRACE_OUT": str(a.server_trace.resolve())}
    argv = [sys.executable, *entry, *serve_args, "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(a.server_args)]
    log_path = a.server_log or Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
    desc = " ".join(["python", *entry, *(shlex.quote(x) for x in argv[1 + len(entry):])])
    print(f"# starting: {desc} (log: {log_path})", flush=True)
    server = Server(argv, log_path, env)
    server.start()
    return f"http://127.0.0.1:{port}", server, desc


async def wait_healthy(url: str, timeout_s: float, server: Server | None) -> dict[str, Any]:
    """Poll GET /health until it answers 200; its report. Fails early when
    the server process exits (a bad flag, a model that does not load)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            if server is not None and server.exited() is not None:
                raise SystemExit(f"server exited with status {server.exited()} before it was healthy:\n"
                                 f"{server.tail()}")
            try:
                async with session.get(f"{url}/health") as r:
                    if r.status == 200:
                        return await r.json()
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                tail = f":\n{server.tail()}" if server is not None else ""
                raise SystemExit(f"{url}/health not ok after {timeout_s:.0f} s{tail}")
            await asyncio.sleep(0.5)


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """On uvloop when installed (no worker shares this process's GIL): the
    client's loop overhead stays small beside the times it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def on_sigterm(signum: int, _frame: Any) -> None:
    # `timeout` and the device tool stop us with SIGTERM: unwind through the
    # `finally` that stops the server instead of leaving it holding the GPU
    raise SystemExit(128 + signum)
