"""What the front adds: streamed completions straight from a replica against
the same through `mstar.cluster.front`, in one run.

One replica (`python -m mstar.http --model <model>`, a subprocess) and a
front over it (another subprocess) on loopback. Requests alternate between
the two addresses, one at a time, so both see the same server state; each
streams `--tokens` tokens (`ignore_eos`) and the client records the time to
the first token and every gap between tokens. Prints medians and p99s of
both paths and their ratios, and the environment; `--out` writes them as
JSON. Tokens that arrive in one socket read have gaps of ~0 (a CPU model's
steps are short, and a hop may join events), so a gap's median says little:
the mean gap (a stream's length over its tokens) is the figure compared.

    python scripts/bench_front.py --model tiny-llama --requests 40 --tokens 32
    python scripts/bench_front.py --model tiny-llama --requests 40 --tokens 64 --ray   # through python -m mstar.cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench_env import REPO, commit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


async def replica_url(front: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{front}/health") as r:
        return (await r.json())["replicas"][0]["url"]


async def one(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> tuple[float, list[float]]:
    """Time to the first streamed token, and the gaps between tokens (seconds)."""
    body = {"model": model, "prompt": "Tell me about the sea.", "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    start = time.perf_counter()
    arrivals = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{url} streamed no token")
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 3)}


async def measure(direct: str, front: str, model: str, requests: int, tokens: int) -> dict[str, dict]:
    ttft: dict[str, list[float]] = {"direct": [], "front": []}
    gaps: dict[str, list[float]] = {"direct": [], "front": []}
    async with aiohttp.ClientSession() as session:
        for name, url in (("direct", direct), ("front", front)):   # warm both paths up, uncounted
            await one(session, url, model, tokens)
        paths = [("direct", direct), ("front", front)]
        for i in range(requests):
            for name, url in paths if i % 2 else paths[::-1]:   # alternate which goes first
                first, between = await one(session, url, model, tokens)
                ttft[name].append(first)
                gaps[name].extend(between)
    out = {name: {"ttft": summary(ttft[name]), "gap": summary(gaps[name])} for name in ttft}
    out["ratio"] = {"ttft_p50": round(out["front"]["ttft"]["p50_ms"] / out["direct"]["ttft"]["p50_ms"], 3),
                    "gap_mean": round(out["front"]["gap"]["mean_ms"] / out["direct"]["gap"]["mean_ms"], 3),
                    "ttft_p50_added_ms": round(out["front"]["ttft"]["p50_ms"] - out["direct"]["ttft"]["p50_ms"], 3),
                    "gap_mean_added_ms": round(out["front"]["gap"]["mean_ms"] - out["direct"]["gap"]["mean_ms"], 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--requests", type=int, default=40, help="per path")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ray", action="store_true",
                   help="the replica and front from `python -m mstar.cluster` (a local Ray instance, one CPU "
                        "replica); direct is the replica's own address")
    a = p.parse_args()
    replica_port, front_port = free_port(), free_port()
    direct, front = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{front_port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": REPO}
    if a.ray:
        procs = [subprocess.Popen([sys.executable, "-m", "mstar.cluster", "--gpus", "cpu", "--num-replicas", "1",
                                   "--port", str(front_port), "--", "--model", a.model], **quiet)]
    else:
        procs = [subprocess.Popen([sys.executable, "-m", "mstar.http", "--model", a.model, "--port",
                                   str(replica_port)], **quiet),
                 subprocess.Popen([sys.executable, "-m", "mstar.cluster.front", "--replicas", direct,
                                   "--port", str(front_port)], **quiet)]
    try:
        asyncio.run(wait_healthy(front, timeout_s=240))
        if a.ray:   # the replica's address, as the front knows it
            direct = asyncio.run(replica_url(front))
        asyncio.run(wait_healthy(direct))
        result = asyncio.run(measure(direct, front, a.model, a.requests, a.tokens))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    env = {"python": platform.python_version(), "machine": platform.machine(), "mstar": commit(REPO),
           "model": a.model, "requests per path": a.requests, "tokens": a.tokens,
           "launch": "python -m mstar.cluster (Ray)" if a.ray else "mstar.http + mstar.cluster.front"}
    print("# " + " | ".join(f"{k} {v}" for k, v in env.items()))
    for name in ("direct", "front"):
        r = result[name]
        print(f"{name:>6}: TTFT p50 {r['ttft']['p50_ms']:.2f} ms p99 {r['ttft']['p99_ms']:.2f} ms; "
              f"gap mean {r['gap']['mean_ms']:.3f} ms p50 {r['gap']['p50_ms']:.3f} ms p99 {r['gap']['p99_ms']:.3f} ms")
    print(f" ratio: {result['ratio']}")
    if a.out:
        a.out.write_text(json.dumps({"env": env, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
