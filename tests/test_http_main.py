"""`python -m mstar.http` as a process: it logs where it listens, serves, and
on SIGTERM / SIGINT drains and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start_server(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "mstar.http", "--port", "0", "--log-format", "json", *args],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def wait_for_line(proc: subprocess.Popen[str], event: str, timeout: float = 60.0) -> dict:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            pytest.fail(f"the server exited (rc={proc.poll()}) before logging '{event}'")
        if line.startswith("{") and json.loads(line).get("event") == event:
            return json.loads(line)
    pytest.fail(f"no '{event}' line within {timeout}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_on_signal(sig: signal.Signals) -> None:
    proc = start_server()
    try:
        url = wait_for_line(proc, "listening")["url"]
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        body = json.dumps({"text": "hi", "sampling_params": {"max_tokens": 3}}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{url}/generate", data=body), timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
        proc.send_signal(sig)
        wait_for_line(proc, "stopped", timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_arguments_exit_2() -> None:
    proc = start_server("--gpus", "tpu")
    assert proc.wait(timeout=60) == 2
