"""The event loop's CPU per streamed text token, served over HTTP.

Starts `python -m mstar.http --model MODEL --gpus DEVICE` in a subprocess,
then, per level, N aiohttp clients in this process stream a chat completion
each (`--tokens` tokens, ignore_eos, greedy) as SSE, all at once. Printed per
level: the SSE events the clients read (a stream's role and finish events
too), the wall time, and the server's main thread's CPU time (the event loop:
HTTP, reports into requests, SSE framing; from /proc, Linux only) per event.
`bench_host.py` measures the same loop in-process, without HTTP.

    python scripts/bench_sse_host.py --clients 64 128 --tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time

import aiohttp

from bench_front import wait_healthy  # this script's folder is on the path


def main_thread_cpu_s(pid: int) -> float:
    """The process's main thread's user + system CPU seconds (its thread id is the pid)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(session: aiohttp.ClientSession, url: str, model: str, i: int, tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    chunks = 0
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            chunks += line.startswith(b"data: {")
    return chunks


async def level(port: int, pid: int, model: str, clients: int, tokens: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*[stream(s, url, model, i, 4) for i in range(4)])  # warm the server's paths
        cpu0, t0 = main_thread_cpu_s(pid), time.perf_counter()
        chunks = sum(await asyncio.gather(*[stream(s, url, model, i, tokens) for i in range(clients)]))
        wall, cpu = time.perf_counter() - t0, main_thread_cpu_s(pid) - cpu0
    return {"clients": clients, "chunks": chunks, "wall_s": wall, "loop_cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--gpus", default="cpu")
    p.add_argument("--port", type=int, default=20530)
    p.add_argument("--clients", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=200)
    a = p.parse_args()
    seqs = str(max(a.clients))
    server = subprocess.Popen([sys.executable, "-m", "mstar.http", "--model", a.model, "--gpus", a.gpus,
                               "--port", str(a.port), "--max-num-seqs", seqs],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{a.port}"))
        print(f"# {platform.platform()} | python {platform.python_version()} | {os.cpu_count()} cpus | "
              f"model {a.model} on {a.gpus} | commit {os.environ.get('MSTAR_COMMIT', '?')}")
        print(f"{'clients':>8} {'events':>8} {'wall s':>7} {'loop cpu s':>11} {'us/event':>9}")
        for n in a.clients:
            r = asyncio.run(level(a.port, server.pid, a.model, n, a.tokens))
            print(f"{r['clients']:>8} {r['chunks']:>8} {r['wall_s']:>7.2f} {r['loop_cpu_s']:>11.2f} "
                  f"{1e6 * r['loop_cpu_s'] / max(r['chunks'], 1):>9.1f}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
