"""The sampler's draw over a wide vocabulary, per batch size: the torch form
(`draw_tokens_reference`: a sort, softmax and cumsum of every row, the noise
apart) against `draw_tokens_wide` (a search over keys, no sort), with Orpheus's sampling
(temperature 0.6, top-p 0.8) on random logits of Orpheus's vocabulary.
Prints, per batch size, the median milliseconds of each (synchronised, so
launch time counts too), the wide draw replayed from a CUDA graph (its GPU
time, as inside the decode step's graph), and how many rows drew the same
token. `--profile` adds torch's profiler table of the wide draw's kernels at
the largest batch.

    PYTHONPATH=. python scripts/bench_sampler.py --batches 1 64 256 [--profile]
"""

from __future__ import annotations

import argparse

import torch
from bench_env import commit, timed, REPO

from mstar.kernels.sampling.draw import draw_tokens_reference
from mstar.kernels.sampling.wide_draw import draw_tokens_wide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=156940)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 400])
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, vocab {args.vocab}, temperature {args.temperature}, top-p {args.top_p}, "
          f"commit {commit(REPO)}")
    for b in args.batches:
        gen = torch.Generator().manual_seed(b)
        # a language model's logits: a few strong candidates over a long tail
        logits = (torch.randn(b, args.vocab, generator=gen) * 2.5).to(device=device, dtype=torch.bfloat16)
        params = [torch.full((b,), args.temperature), torch.zeros(b, dtype=torch.long), torch.full((b,), args.top_p),
                  torch.zeros(b), torch.arange(b), torch.arange(b) * 7]
        params = [p.to(device) for p in params]
        ref = timed(lambda: draw_tokens_reference(logits, *params), device, args.iters)
        # the sampler tells the draw that no row cuts by top-k (Orpheus's sampling has none), as here
        wide = timed(lambda: draw_tokens_wide(logits, *params, top_k_active=False), device, args.iters)
        replay = _graphed(lambda: draw_tokens_wide(logits, *params, top_k_active=False), device)
        graph = timed(replay, device, args.iters) if replay else float("nan")
        same = (draw_tokens_reference(logits, *params) == draw_tokens_wide(logits, *params)).sum().item()
        print(f"batch {b:4d}: torch {ref:7.3f} ms | wide {wide:7.3f} ms ({ref / wide:5.2f}x), "
              f"from a graph {graph:7.3f} ms | same token {same}/{b}", flush=True)
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                draw_tokens_wide(logits, *params, top_k_active=False)
            torch.cuda.synchronize(device)
        print(f"profile: three wide draws of {b} rows, by self CUDA time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=50))


def _graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph (after a warm-up that compiles its
    kernels): a replay, or None off CUDA."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay

if __name__ == "__main__":
    main()
