"""The benchmarks that stub the model's heavy compute (`bench_host_speech.py`'s
stand-ins, `profile_tts.py --stub-compute`, `bench_host.py --cprofile`) still
run against the engine: their stand-ins take what the engine now passes (a
stand-in that lags a new sampler argument fails every row). In a subprocess:
the stand-ins replace methods process-wide."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=SCRIPTS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_profile_tts_runs_on_the_stand_ins_under_the_python_profiler() -> None:
    out = _run(str(SCRIPTS / "profile_tts.py"), "--model", "orpheus-tiny", "--devices", "cpu", "--stub-compute",
               "--concurrency", "4", "--tokens", "400", "--trace", "0.3", "--trace-after", "0.2", "--cprofile", "3")
    assert "row failed" not in out and "Traceback" not in out
    assert "## concurrency 4" in out and "became audio" in out
    assert "Ordered by: internal time" in out  # the profiler's window saw the worker's plans


def test_bench_host_prints_the_workers_profile() -> None:
    out = _run(str(SCRIPTS / "bench_host.py"), "--batches", "2", "--tokens", "8", "--cprofile", "3")
    assert "## batch 2: the worker's Python" in out and "Ordered by: cumulative time" in out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["batch", "steps"])
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["2"])
    # the worker's thread CPU a step (`DeviceWorker.cpu_s`), read from outside that thread
    assert header[-3:] == ["cpu", "l", "tok/s"] and float(row[-3]) > 0


def test_bench_sse_host_measures_the_event_loop_per_streamed_token() -> None:
    with socket.socket() as s:  # a port free a moment ago, for the server the script starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run(str(SCRIPTS / "bench_sse_host.py"), "--clients", "3", "--tokens", "5", "--port", str(port))
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["3"])
    # every token's event read, besides each stream's role and finish events (the loop's CPU for so few is
    # below /proc's clock tick: only its column is read)
    assert int(row[1]) >= 3 * 5 and float(row[-1]) >= 0
