#!/usr/bin/env python3
"""Realtime websocket benchmark: time to the first audio delta after
`response.create`, and cancel to silence, at N concurrent sessions.

Each session connects to /v1/realtime, sets its voice and max_output_tokens,
adds a user message and sends `response.create`; the clock runs from that
send to the first `response.output_audio.delta`. With `--cancel-after K`,
a session sends `response.cancel` after its K-th audio delta and counts the
audio deltas that still arrive, and the time until `response.done`
(cancelled). Sessions of one level start together (a closed loop of one
response each, `--rounds` times). Loopback only; the server is started here
(`python -m mstar.http`) unless `--url` names one.

  python scripts/bench_realtime.py --model orpheus-tiny --gpus cpu --sessions 1 2 --tokens 63
  python scripts/bench_realtime.py --sessions 1 16 64 --out docs/benchmarks/realtime.json   # on the H200

Prints one table row per level and writes JSON with the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import add_server_args, on_sigterm, run_async, start_server, wait_healthy  # noqa: E402
from tts_report import environment, percentile  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEXT = "Hello there, this is a realtime speech benchmark of the mstar server."


@dataclass
class Session:
    first_delta_ms: float | None = None
    deltas: int = 0
    deltas_after_cancel: int = 0
    cancel_to_done_ms: float | None = None
    status: str = ""
    error: str = ""


@dataclass
class Level:
    sessions: int
    results: list[Session] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttfa = [r.first_delta_ms for r in self.results if r.first_delta_ms is not None]
        cancel = [r.cancel_to_done_ms for r in self.results if r.cancel_to_done_ms is not None]
        after = [r.deltas_after_cancel for r in self.results if r.cancel_to_done_ms is not None]
        return {
            "sessions": self.sessions, "responses": len(self.results),
            "errors": sum(1 for r in self.results if r.error),
            "first_delta_ms_p50": percentile(ttfa, 50) if ttfa else None,
            "first_delta_ms_p99": percentile(ttfa, 99) if ttfa else None,
            "cancel_to_done_ms_p50": percentile(cancel, 50) if cancel else None,
            "cancel_to_done_ms_p99": percentile(cancel, 99) if cancel else None,
            "deltas_after_cancel_max": max(after) if after else None,
            "statuses": sorted({r.status for r in self.results}),
        }


async def one_session(http: aiohttp.ClientSession, ws_url: str, a: argparse.Namespace, start: asyncio.Event,
                      ) -> Session:
    out = Session()
    try:
        async with http.ws_connect(ws_url, max_msg_size=0) as ws:
            first = await ws.receive_json()
            if first.get("type") != "session.created":
                raise RuntimeError(f"expected session.created, got {first.get('type')}")
            await ws.send_json({"type": "session.update", "session": {
                "type": "realtime", "audio": {"output": {"voice": a.voice}}, "max_output_tokens": a.tokens,
                "mstar": {"input_linger_ms": 0}}})
            await ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": a.text}]}})
            await start.wait()
            t0 = time.perf_counter()
            await ws.send_json({"type": "response.create"})
            cancel_at: float | None = None
            async for msg in ws:
                ev = json.loads(msg.data)
                kind = ev.get("type")
                if kind == "response.output_audio.delta":
                    out.deltas += 1
                    if out.first_delta_ms is None:
                        out.first_delta_ms = (time.perf_counter() - t0) * 1000
                    if cancel_at is not None:
                        out.deltas_after_cancel += 1
                    elif a.cancel_after and out.deltas >= a.cancel_after:
                        cancel_at = time.perf_counter()
                        await ws.send_json({"type": "response.cancel"})
                elif kind == "error":
                    out.error = ev["error"].get("message", "error")
                elif kind == "response.done":
                    out.status = ev["response"]["status"]
                    if cancel_at is not None:
                        out.cancel_to_done_ms = (time.perf_counter() - cancel_at) * 1000
                    break
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_level(url: str, a: argparse.Namespace, n: int) -> Level:
    level = Level(n)
    ws_url = url.replace("http://", "ws://") + f"/v1/realtime?model={a.served_name}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.timeout)) as http:
        for _ in range(a.rounds):
            start = asyncio.Event()
            tasks = [asyncio.create_task(one_session(http, ws_url, a, start)) for _ in range(n)]
            await asyncio.sleep(0.5 + n * 0.01)  # every session connected and set up before the clock starts
            start.set()
            level.results += await asyncio.gather(*tasks)
    return level


async def bench(url: str, a: argparse.Namespace) -> list[Level]:
    levels = []
    if a.warmup:
        await run_level(url, a, 1)
    for n in a.sessions:
        level = await run_level(url, a, n)
        s = level.summary()
        print(f"sessions {n:4d}: first delta p50 {_ms(s['first_delta_ms_p50'])} p99 {_ms(s['first_delta_ms_p99'])}"
              f" | cancel->done p50 {_ms(s['cancel_to_done_ms_p50'])} p99 {_ms(s['cancel_to_done_ms_p99'])}"
              f" | deltas after cancel max {s['deltas_after_cancel_max']} | errors {s['errors']}"
              f" | statuses {s['statuses']}", flush=True)
        levels.append(level)
    return levels


def _ms(x: float | None) -> str:
    return "   -   " if x is None else f"{x:7.1f}"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--gpus", default="0")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=2, help="responses per session and level")
    p.add_argument("--tokens", type=int, default=210, help="max_output_tokens of each response")
    p.add_argument("--cancel-after", type=int, default=4, help="audio deltas before response.cancel (0: never)")
    p.add_argument("--voice", default="tara")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None)
    add_server_args(p, startup_timeout=900.0)
    a = p.parse_args()
    a.served_name = a.model
    return a


def main() -> None:
    a = parse()
    signal.signal(signal.SIGTERM, on_sigterm)
    serve = ["--model", a.model, "--load-format", a.load_format, "--gpus", a.gpus, "--log-level", "warning"]
    url, server, desc = start_server(a, serve, "mstar-realtime-")
    try:
        run_async(wait_healthy(url, a.startup_timeout, server))
        levels = run_async(bench(url, a))
    finally:
        if server is not None:
            server.stop()
    devices = ["cpu"] if a.gpus == "cpu" else [f"cuda:{g}" for g in a.gpus.split(",")]
    result = {
        "environment": environment(devices, a.model, desc, REPO, {
            "tokens": str(a.tokens), "cancel_after": str(a.cancel_after), "rounds": str(a.rounds)}),
        "levels": [{**lv.summary(), "sessions_detail": [asdict(r) for r in lv.results]} for lv in levels],
    }
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"# wrote {a.out}")


if __name__ == "__main__":
    main()
