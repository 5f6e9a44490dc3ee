"""One mstar server as a Ray actor: the server's flags in, its base URL out.

The actor starts `python -m mstar.http` on its node, with the GPUs Ray gave
it (Ray sets CUDA_VISIBLE_DEVICES, so the server sees them as 0..k-1) or on
the CPU, on a free port of the node's address, and answers `url()` once the
server's `/health` does. The server is the actor's child and dies with it
(Linux's parent-death signal); when the server dies, or a restarted one
cannot start, the actor exits, so
Ray's restart of the actor (`max_restarts`) is a restart of the server, on
whichever node Ray picks, at a new URL.

Ray is imported only by `actor_class()`: importing this module needs no Ray.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.25
EXIT_WHEN_SERVER_DIES = 3   # the actor's exit code then: Ray restarts it
RETRY_AFTER_S = 5.0         # a restarted replica whose server failed to start tries again (a new actor) after this
STARTUP_TIMEOUT_S = 900.0   # a large checkpoint loads for minutes
PORT_ATTEMPTS = 3           # free ports a server is started on, when the one before was taken before it bound
PORT_TAKEN = "cannot listen on"   # what `mstar.http` says then, before it loads anything
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # the node's own address, never a proxy


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica runs: the server's flags (no --host/--port/--gpus:
    the actor sets those), its GPUs (0: `--gpus cpu`), and how long its start
    may take (a large checkpoint loads for minutes)."""

    server_args: tuple[str, ...]
    gpus: int = 0
    startup_timeout_s: float = STARTUP_TIMEOUT_S


class ReplicaServer:
    """The actor's body (made a Ray actor by `actor_class`)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        import ray

        self.index = index
        self.spec = spec
        self.host = ray.util.get_node_ip_address()
        self.log = tempfile.NamedTemporaryFile(prefix=f"mstar-replica{index}-", suffix=".log", delete=False)
        self._ready = False
        self._stopping = False
        self._spawn()

    def _spawn(self) -> None:
        """Start the server on a free port of the node. The port is free when
        chosen, not when the server binds it a moment later: `url()` starts
        the server again on another port if something took it meanwhile."""
        self.port = _free_port(self.host)
        self.log.seek(0)
        self.log.truncate()
        gpus = ",".join(str(i) for i in range(self.spec.gpus)) if self.spec.gpus else "cpu"
        cmd = [sys.executable, "-m", "mstar.http", *self.spec.server_args, "--host", self.host,
               "--port", str(self.port), "--gpus", gpus]
        # Ray runs a sync actor's tasks on its main thread, which spawns the server here: the
        # parent-death signal (sent when that thread ends) comes when the actor's process does
        self.server = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                       preexec_fn=_die_with(os.getpid(), _prctl()))

    @property
    def _base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self) -> str:
        """The server's base URL, once its /health answers (the first call waits for it)."""
        if self._ready:
            return self._base
        deadline = time.monotonic() + self.spec.startup_timeout_s
        ports_tried = 1
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                if ports_tried < PORT_ATTEMPTS and PORT_TAKEN in self._log_tail():
                    ports_tried += 1
                    self._spawn()
                    continue
                self._failed(f"exited ({self.server.returncode}) while starting")
            try:
                with _NO_PROXY.open(f"{self._base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(POLL_S)
        else:
            self.server.kill()
            self._failed(f"did not answer /health within {self.spec.startup_timeout_s:.0f} s")
        self._ready = True
        threading.Thread(target=self._watch, name="mstar-replica-watch", daemon=True).start()
        return self._base

    def info(self) -> dict[str, Any]:
        """Where it runs: node address, server pid and log (a test kills the pid)."""
        return {"index": self.index, "host": self.host, "port": self.port, "pid": self.server.pid,
                "log": self.log.name, "node_id": _node_id()}

    def stop(self) -> None:
        """Stop the server (SIGTERM: it drains), then let the actor go."""
        self._stopping = True
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log.name)

    def _failed(self, what: str) -> None:
        """The server could not start. A first start says why (the cluster's
        start fails with it); a replica Ray restarted exits after a pause, so
        Ray tries it again, as it would a server that died."""
        import ray

        message = f"replica {self.index}'s server {what}:\n{self._log_tail()}"
        if ray.get_runtime_context().was_current_actor_reconstructed:
            print(message, flush=True)
            time.sleep(RETRY_AFTER_S)
            os._exit(EXIT_WHEN_SERVER_DIES)
        raise RuntimeError(message)

    def _watch(self) -> None:
        """The server died after it served: the actor exits, and Ray restarts it (a `stop()` does not come here)."""
        code = self.server.wait()
        if not self._stopping:
            print(f"replica {self.index}'s server exited ({code}); restarting the replica", flush=True)
            os._exit(EXIT_WHEN_SERVER_DIES)

    def _log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def actor_class(num_gpus: int, num_cpus: float, max_restarts: int) -> Any:
    """`ReplicaServer` as a Ray actor class with these resources; calls to a
    restarting actor wait for its restart instead of failing."""
    import ray

    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=max_restarts,
                      max_task_retries=-1)(ReplicaServer)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _prctl() -> Any:
    """libc's `prctl`, looked up in the parent (a forked child must not load libraries); None off Linux."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with(parent: int, prctl: Any) -> Callable[[], None]:
    """The server's pre-exec step: SIGKILL when the actor's process dies, as
    it holds the GPUs a restarted replica needs (PR_SET_PDEATHSIG); and gone
    at once if the actor died before that was set."""
    def before_exec() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
    return before_exec
