"""How many candidates the wide draw's descent tests before a row settles
(`mstar/kernels/sampling/wide_descent.py`), by simulation on the CPU: each
row's softmax sorted once, its race scores drawn, and the descent's rule
applied (test the best kept token against top-p's cut; if it fails, race
again over the tokens before it). Rows needing more than `wide_descent.STEPS`
tests go to the search. Prints, per sampling setting, the mean and largest
number of tests and the share of rows past 4, 8 and 16.

    python scripts/sim_descent.py --rows 400
"""

from __future__ import annotations

import argparse

import torch


def tests_needed(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    sorted_probs = probs[order]
    mass_before = (torch.cumsum(sorted_probs, 0) - sorted_probs)[rank]
    score = probs / torch.empty_like(probs).exponential_(generator=gen)
    field = torch.ones_like(probs, dtype=torch.bool)
    tests = 0
    while True:
        winner = torch.where(field, score, torch.zeros_like(score)).argmax()
        tests += 1
        if mass_before[winner] < top_p:
            return tests
        field &= rank < rank[winner]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=156940)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    # (logit scale, temperature, top-p): the first is scripts/bench_sampler.py's rows
    for scale, temperature, top_p in ((2.5, 0.6, 0.8), (1.0, 0.6, 0.8), (4.0, 1.0, 0.95), (2.5, 1.0, 0.5)):
        tests = torch.tensor([tests_needed(torch.randn(args.vocab, generator=gen) * scale, temperature, top_p, gen)
                              for _ in range(args.rows)], dtype=torch.float32)
        print(f"logits N(0, {scale}^2), temperature {temperature}, top-p {top_p}: tests mean {tests.mean():.2f}, "
              f"max {int(tests.max())}, rows past 4 {(tests > 4).float().mean():.3f}, past 8 "
              f"{(tests > 8).float().mean():.3f}, past 16 {(tests > 16).float().mean():.3f}", flush=True)


if __name__ == "__main__":
    main()
