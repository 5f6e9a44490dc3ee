"""One mstar server as a Ray actor: the server's flags in, its base URL out.

The actor starts `python -m mstar.http` on its node, with the GPUs Ray gave
it (Ray sets CUDA_VISIBLE_DEVICES, so the server sees them as 0..k-1) or on
the CPU, on a free port of the node's address, and answers `url()` once the
server's `/health` does. The server is the actor's child and dies with it
(Linux's parent-death signal); when the server dies, the actor exits, so
Ray's restart of the actor (`max_restarts`) is a restart of the server, on
whichever node Ray picks, at a new URL.

Ray is imported only by `actor_class()`: importing this module needs no Ray.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

POLL_S = 0.25
EXIT_WHEN_SERVER_DIES = 3   # the actor's exit code then: Ray restarts it


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica runs: the server's flags (no --host/--port/--gpus:
    the actor sets those), its GPUs (0: `--gpus cpu`), and how long its start
    may take (a large checkpoint loads for minutes)."""

    server_args: tuple[str, ...]
    gpus: int = 0
    startup_timeout_s: float = 600.0


class ReplicaServer:
    """The actor's body (made a Ray actor by `actor_class`)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        import ray

        self.index = index
        self.spec = spec
        self.host = ray.util.get_node_ip_address()
        self.port = _free_port(self.host)
        self.log = tempfile.NamedTemporaryFile(prefix=f"mstar-replica{index}-", suffix=".log", delete=False)
        gpus = ",".join(str(i) for i in range(spec.gpus)) if spec.gpus else "cpu"
        cmd = [sys.executable, "-m", "mstar.http", *spec.server_args, "--host", self.host, "--port", str(self.port),
               "--gpus", gpus]
        self.server = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._ready = False

    def url(self) -> str:
        """The server's base URL, once its /health answers (the first call waits for it)."""
        base = f"http://{self.host}:{self.port}"
        if self._ready:
            return base
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"replica {self.index}'s server exited ({self.server.returncode}) while "
                                   f"starting:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
        else:
            raise RuntimeError(f"replica {self.index}'s server did not answer /health within "
                               f"{self.spec.startup_timeout_s:.0f} s:\n{self._log_tail()}")
        self._ready = True
        threading.Thread(target=self._watch, name="mstar-replica-watch", daemon=True).start()
        return base

    def info(self) -> dict[str, Any]:
        """Where it runs: node address, server pid and log (a test kills the pid)."""
        return {"index": self.index, "host": self.host, "port": self.port, "pid": self.server.pid,
                "log": self.log.name, "node_id": _node_id()}

    def stop(self) -> None:
        """Stop the server (SIGTERM: it drains), then let the actor go."""
        self._ready = False
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()

    def _watch(self) -> None:
        """The server died after it served: the actor exits, and Ray restarts it (a `stop()` does not come here)."""
        code = self.server.wait()
        if self._ready:
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


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the actor's process dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass
