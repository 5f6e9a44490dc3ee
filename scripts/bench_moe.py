"""One MoE layer's routed experts on CUDA: the torch loop against fused_moe.

bf16 at the Qwen3-Omni thinker's and talker's real shapes.

Per part and token count it prints, each the median of many calls:

  loop_us    the reference loop, eager (it waits on the host for its expert list)
  fused_us   fused_moe_triton, eager: its four launches and allocations included
  graph_us   fused_moe_triton replayed from a CUDA graph, as a decode step runs it
  floor_us   bytes read at least (the experts the routing touched, x and the
             output) / 4.0e12 B/s, the H200's memory bandwidth
  max_err    fused against the loop, the largest absolute difference

Routing is uniform over the experts (a random router), drawn afresh for
each of ROUTINGS calls in turn, so the weights read are not all in L2 from
the call before. Writes the table to stdout and JSON with the environment to
--out.

    python3 scripts/bench_moe.py [--tokens 1 8 32 64 256 2048] [--out moe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_env import commit, version  # noqa: E402

from mstar.kernels import moe  # noqa: E402

# hidden, intermediate, experts, top k
SHAPES = {"thinker": (2048, 768, 128, 8), "talker": (1024, 384, 128, 6)}
BANDWIDTH = 4.0e12
ROUTINGS = 8


def routings(t: int, e: int, k: int, h: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for _ in range(ROUTINGS):
        scores = torch.rand(t, e, generator=gen, device="cuda")
        top, experts = scores.topk(k, dim=-1)
        x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
        out.append((x, experts, torch.softmax(top * 4, dim=-1).to(torch.bfloat16)))
    return out


def median_us(fn: Callable[[int], object], calls: int) -> float:
    """Median over `calls` of CUDA events around fn(i), after a warm-up."""
    for i in range(3):
        fn(i)
    times = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graph_us(gate_up: torch.Tensor, down: torch.Tensor, inputs: list[tuple[torch.Tensor, ...]], calls: int) -> float:
    """One fused call captured on static inputs; before each replay the next
    routing is copied into them, outside the timed span."""
    x, experts, weights = (t.clone() for t in inputs[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.fused_moe_triton(x, gate_up, down, experts, weights)  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.fused_moe_triton(x, gate_up, down, experts, weights)
    times = []
    for i in range(calls + 3):
        for static, new in zip((x, experts, weights), inputs[i % len(inputs)]):
            static.copy_(new)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def floor_us(h: int, inter: int, inputs: list[tuple[torch.Tensor, ...]]) -> float:
    per_expert = 3 * h * inter * 2
    reads = [experts.unique().numel() * per_expert + 2 * x.numel() * 2 for x, experts, _ in inputs]
    return statistics.mean(reads) / BANDWIDTH * 1e6


def measure(part: str, t: int, gate_up: torch.Tensor, down: torch.Tensor, gen: torch.Generator) -> dict[str, object]:
    h, inter, e, k = SHAPES[part]
    inputs = routings(t, e, k, h, gen)
    calls = 50 if t <= 256 else 20
    with torch.no_grad():
        x, experts, weights = inputs[0]
        err = (moe.fused_moe_triton(x, gate_up, down, experts, weights).float()
               - moe.fused_moe_reference(x, gate_up, down, experts, weights).float()).abs().max().item()
        loop = median_us(lambda i: moe.fused_moe_reference(inputs[i % ROUTINGS][0], gate_up, down,
                                                            *inputs[i % ROUTINGS][1:]), calls)
        fused = median_us(lambda i: moe.fused_moe_triton(inputs[i % ROUTINGS][0], gate_up, down,
                                                          *inputs[i % ROUTINGS][1:]), calls)
        graph = graph_us(gate_up, down, inputs, calls)
    tiles = moe.tiles_for(t, k, e)
    return dict(part=part, tokens=t, block_m=tiles.block_m, loop_us=round(loop, 1), fused_us=round(fused, 1),
                graph_us=round(graph, 1), floor_us=round(floor_us(h, inter, inputs), 1),
                speedup=round(loop / graph, 1), max_err=err)


def environment() -> dict[str, str]:
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=version("triton"),
                commit=commit(REPO), dtype="bfloat16", bandwidth_bytes_per_s=f"{BANDWIDTH:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    p.add_argument("--parts", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device: it times Triton kernels against the torch loop on the GPU")
    env = environment()
    print(" ".join(f"{k} {v}" for k, v in env.items()))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for part in a.parts:
        h, inter, e, _ = SHAPES[part]
        gate_up = (torch.randn(e, 2 * inter, h, generator=gen, device="cuda") * h ** -0.5).to(torch.bfloat16)
        down = (torch.randn(e, h, inter, generator=gen, device="cuda") * inter ** -0.5).to(torch.bfloat16)
        for t in a.tokens:
            rows.append(measure(part, t, gate_up, down, gen))
            print(rows[-1], flush=True)
        del gate_up, down
        torch.cuda.empty_cache()
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2e}" if c == "max_err" else str(r[c]) for c in cols) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
