"""The sampler's draw over a wide vocabulary, per batch size: the torch form
(`draw_tokens_reference`: a sort, softmax and cumsum of every row, the noise
apart) against `draw_tokens_wide` (a search over keys, no sort), with Orpheus's sampling
(temperature 0.6, top-p 0.8) on random logits of Orpheus's vocabulary.
Prints, per batch size, the median milliseconds of each (synchronised, so
launch time counts too) and how many rows drew the same token.

    PYTHONPATH=. python scripts/bench_sampler.py --batches 1 64 256
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
        same = (draw_tokens_reference(logits, *params) == draw_tokens_wide(logits, *params)).sum().item()
        print(f"batch {b:4d}: torch {ref:7.3f} ms | wide {wide:7.3f} ms ({ref / wide:5.2f}x) | "
              f"same token {same}/{b}", flush=True)


if __name__ == "__main__":
    main()
