"""Device-to-device copies through `Transport.receive` (cuda:0 -> cuda:1), next
to a plain `tensor.to('cuda:1')`, for payloads from 4 KiB to 1 GiB.

Per size and path: the median latency of one copy on the GPU (CUDA events
around it), the median wall-clock of one copy including the host side (call,
then wait for the copy), the median host time of the call alone (receive()
must not wait, so this stays small), and GB/s from the GPU latency. Writes the
table to stdout and JSON with the environment (torch, GPUs, peer access,
`nvidia-smi topo -m`) to --out.

    python scripts/bench_transport.py [--out docs/benchmarks/transport.json] [--sizes 4K 1M 1G]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from mstar.engine.movement.transport import Transport

DEFAULT_SIZES = ["4K", "64K", "1M", "16M", "256M", "1G"]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * UNITS[s[-1]]) if s and s[-1] in UNITS else int(s)


def label(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def iterations(nbytes: int, requested: int | None) -> int:
    if requested:
        return requested
    # about 1 GiB moved per size and path, at least 10 copies, at most 200
    return max(10, min(200, (1 << 30) // nbytes))


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "peer_access": {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
                        for i in range(torch.cuda.device_count()) for j in range(torch.cuda.device_count()) if i != j},
    }
    try:
        from bench_env import commit  # scripts/bench_env.py; optional
        env["commit"] = commit(REPO)
    except Exception:  # noqa: BLE001 (the environment is best effort)
        env["commit"] = "unknown"
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
        env["nvidia_smi_topo"] = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi_topo"] = f"unavailable: {e}"
    return env


def sync(*devices: torch.device) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


def measure(copy: Callable[[], torch.Tensor], timing_stream: torch.cuda.Stream, iters: int, warmup: int,
            devices: tuple[torch.device, ...]) -> dict:
    """`copy()` returns the copied tensor after queueing it; the events are
    recorded on `timing_stream` around it (the stream whose work ends with the
    copy). Each iteration runs alone: latency, not pipelined throughput."""
    gpu_ms, wall_ms, call_ms = [], [], []
    for i in range(warmup + iters):
        sync(*devices)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record(timing_stream)
        out = copy()
        end.record(timing_stream)
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        del out
        if i >= warmup:
            gpu_ms.append(start.elapsed_time(end))
            call_ms.append((t1 - t0) * 1e3)
            wall_ms.append((t2 - t0) * 1e3)
    return {"gpu_ms": statistics.median(gpu_ms), "wall_ms": statistics.median(wall_ms),
            "call_ms": statistics.median(call_ms), "gpu_ms_min": min(gpu_ms), "iters": iters}


def bench_size(transport: Transport, size: int, src_dev: torch.device, dst_dev: torch.device, iters: int,
               warmup: int) -> list[dict]:
    devices = (src_dev, dst_dev)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=src_dev)
    ready = torch.cuda.current_stream(src_dev).record_event()

    got = transport.receive(src, ready).tensor
    sync(*devices)
    edge = min(size, 4096)
    if not (torch.equal(got[:edge].cpu(), src[:edge].cpu()) and torch.equal(got[-edge:].cpu(), src[-edge:].cpu())):
        sys.exit(f"bench_transport: Transport.receive copied {label(size)} wrongly")
    del got

    # the transfer stream ends with the copy (it waits for it, then records `done`)
    via_transport = measure(lambda: transport.receive(src, ready).tensor, transport.stream, iters, warmup, devices)
    # .to() copies on the source device's current stream, after a barrier with the destination's
    via_to = measure(lambda: src.to(dst_dev, non_blocking=True), torch.cuda.current_stream(src_dev), iters,
                     warmup, devices)
    return [{"path": path, "bytes": size, "size": label(size), **m,
             "gbps": size / (m["gpu_ms"] * 1e-3) / 1e9 if m["gpu_ms"] > 0 else None}
            for path, m in (("Transport.receive", via_transport), ("tensor.to", via_to))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs/benchmarks/transport.json"))
    ap.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="bytes, with K/M/G suffixes (binary)")
    ap.add_argument("--iters", type=int, default=None, help="copies per size and path (default: by size)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--src", type=int, default=0)
    ap.add_argument("--dst", type=int, default=1)
    args = ap.parse_args()

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        sys.exit(f"bench_transport: needs at least 2 CUDA devices, found {n}; nothing measured")
    if args.src == args.dst or max(args.src, args.dst) >= n:
        sys.exit(f"bench_transport: --src {args.src} --dst {args.dst} must be two different devices of {n}")
    src_dev, dst_dev = torch.device("cuda", args.src), torch.device("cuda", args.dst)
    devices = (src_dev, dst_dev)

    transport = Transport(dst_dev)
    transport.enable_peer(src_dev)
    env = environment()
    env["transport_peer_access"] = transport.peer_access.get(args.src, False)
    print(f"torch {env['torch']} (CUDA {env['cuda']}); {src_dev} {env['gpus'][args.src]} -> "
          f"{dst_dev} {env['gpus'][args.dst]}; peer access {env['transport_peer_access']}")

    rows = []
    for size in (parse_size(s) for s in args.sizes):
        rows += bench_size(transport, size, src_dev, dst_dev, iterations(size, args.iters), args.warmup)
        sync(*devices)
        torch.cuda.empty_cache()  # the next size starts from the same free memory

    header = f"{'path':<18} {'size':>8} {'iters':>5} {'gpu ms':>9} {'wall ms':>9} {'call ms':>8} {'GB/s':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        gbps = f"{r['gbps']:.1f}" if r["gbps"] is not None else "-"
        print(f"{r['path']:<18} {r['size']:>8} {r['iters']:>5} {r['gpu_ms']:>9.4f} {r['wall_ms']:>9.4f} "
              f"{r['call_ms']:>8.4f} {gbps:>8}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "src": str(src_dev), "dst": str(dst_dev), "results": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
