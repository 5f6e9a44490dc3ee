"""`python -m mstar.http` as a process: it logs where it listens, serves, and
on SIGTERM / SIGINT drains and exits cleanly; its help and version; a bad
model, device, context length or port ends it with one line and exit 1."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from mstar.config import build_parser

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


@pytest.mark.parametrize("sig, loop", [(signal.SIGTERM, "auto"), (signal.SIGINT, "auto"),
                                       (signal.SIGTERM, "asyncio")])
def test_serves_then_stops_on_signal(sig: signal.Signals, loop: str) -> None:
    proc = start_server("--event-loop", loop)
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


def test_the_event_loop_is_the_one_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--event-loop`: the standard library's by default, uvloop's when asked (or `auto` with it installed);
    asking for uvloop where it is not installed is a configuration error, not a silent fallback."""
    import asyncio

    from mstar.config import parse_args
    from mstar.errors import ConfigError
    from mstar.http.__main__ import run_on
    from mstar.engine import builtin_models

    assert parse_args(["--model", "tiny-llama"], builtin_models()).event_loop == "asyncio"

    seen: list[str] = []

    async def note() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    for kind in ("auto", "uvloop", "asyncio"):
        run_on(kind, note())
    assert seen[0].startswith("uvloop") and seen[1].startswith("uvloop") and seen[2].startswith("asyncio")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it fails
    run_on("auto", note())
    assert seen[3].startswith("asyncio")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        run_on("uvloop", note())


def test_quiet_gc_freezes_startup_and_collects_the_young_less_often() -> None:
    """In a process of its own (a frozen generation is for the whole process): startup's garbage is
    collected before the rest is frozen, and the youngest generation is collected less often."""
    code = ("import gc, weakref; from mstar.http.__main__ import GC_YOUNG_THRESHOLD, quiet_gc\n"
            "class Cycle: pass\n"
            "c = Cycle(); c.me = c; dead = weakref.ref(c); del c\n"
            "gc.disable(); before = gc.get_threshold(); n = quiet_gc(); after = gc.get_threshold()\n"
            "print(n, dead() is None, before[1:] == after[1:], after[0] == GC_YOUNG_THRESHOLD > before[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    frozen, collected, older_kept, young_raised = out.stdout.split()
    assert int(frozen) > 1000 and collected == older_kept == young_raised == "True"


def test_bad_arguments_exit_2() -> None:
    proc = start_server("--gpus", "tpu")
    assert proc.wait(timeout=60) == 2


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mstar.http", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """What the process said outside its log lines."""
    return [ln for ln in proc.stderr.splitlines() if ln and not ln.startswith("{")]


def test_help_shows_every_flag_its_default_and_the_builtin_models() -> None:
    out = run_cli("--help").stdout
    flat = " ".join(out.split())
    assert "--model MODEL built-in model name or a local Hugging Face folder (default: tiny-llama)" in flat
    assert "(default: 8192)" in flat and "--seed SEED engine seed, for requests without their own (default: 0)" in flat
    assert ("built-in models (served without a folder): orpheus-3b, orpheus-tiny, qwen3-omni-30b-a3b, "
            "qwen3-omni-tiny, qwen3.5-35b-a3b, qwen3.5-9b, qwen3.5-tiny, qwen3.5-vl-tiny, tiny-llama") in flat
    flags = [a for a in build_parser()._actions if a.option_strings]
    assert len(flags) > 30
    for action in flags:
        assert action.help, f"{action.option_strings[0]} has no help"
        assert f"  {action.option_strings[0]}" in out


def test_version_names_the_package_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mstar {importlib.metadata.version('mstar')}"


def _llama_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}))
    return tmp_path


@pytest.mark.parametrize("case", ["unknown name", "missing folder", "bad config", "no weights", "too long",
                                  "no such device"])
def test_config_errors_print_one_line_and_exit_1(case: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # a CUDA device this machine lacks: any on a CPU-only machine, one past the last on a GPU machine
    missing_gpu = str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    args, expected = {
        "unknown name": (["--model", "nosuch"], "unknown model 'nosuch'"),
        "missing folder": (["--model", str(tmp_path / "absent")], "not a local folder"),
        "bad config": (["--model", str(bad)], f"{bad / 'config.json'}: llama config: missing key 'hidden_size'"),
        "no weights": (["--model", str(_llama_folder(tmp_path))], "no model.safetensors"),
        "too long": (["--max-model-len", "4096"], "--max-model-len 4096 is more than model 'tiny-llama' supports "
                                                  "(2048 positions)"),
        "no such device": (["--gpus", missing_gpu], "--gpus: "),
    }[case]
    proc = run_cli("--port", "0", "--log-format", "json", *args)
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


def test_taken_port_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("--port", str(port), "--log-format", "json", timeout=30)
    assert proc.returncode == 1
    assert error_lines(proc) == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert '"starting engine"' not in proc.stderr  # refused before the engine (and torch) came in


def test_startup_says_weights_dtype_context_and_demo_url() -> None:
    proc = start_server("--model", "orpheus-tiny")
    try:
        started = wait_for_line(proc, "engine started")
        assert (started["model"], started["random_weights"], started["dtype"], started["max_model_len"],
                started["devices"]) == ("orpheus-tiny", True, "float32", 2048, ["cpu"])
        listening = wait_for_line(proc, "listening")
        assert listening["demo"] == listening["url"] + "/"
        assert listening["gc_frozen_objects"] > 10_000  # startup's modules and model, out of the collector's walks
        with urllib.request.urlopen(listening["demo"], timeout=10) as r:
            assert b"<html" in r.read().lower()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
