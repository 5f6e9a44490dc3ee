"""The CPU's draw over Orpheus's vocabulary: `draw_tokens_reference` (which
on the CPU races each row's head, `head_race.py`) against the race over
whole sorted rows (`filtered_race_reference` with the whole rows' noise),
per batch size, on a trained model's kind of logits (a few strong
candidates over a long tail) and a random-weight model's (flat: top-p keeps
thousands). Prints the median milliseconds of each and how many rows drew
the same token. `--engine` also times `orpheus-tiny` serving requests
in-process with Orpheus's sampling (temperature 0.6, top-p 0.8, repetition
penalty 1.3), as the CPU serves them, with the heads' race and the whole rows'
alternated.

    PYTHONPATH=. python scripts/bench_cpu_draw.py --batches 1 8 32 [--engine]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from bench_env import REPO, commit, timed

from mstar.kernels.sampling.draw import draw_tokens_reference
from mstar.kernels.sampling.noise import exponential_noise_reference
from mstar.kernels.sampling.race import filtered_race_reference

KINDS = {"trained": 2.5, "flat": 0.6}   # the logits' scale: randn times this


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=156940)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="also time orpheus-tiny requests in-process")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    print(f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}, vocab {args.vocab}, temperature "
          f"{args.temperature}, top-p {args.top_p}, commit {commit(REPO)}")
    cpu = torch.device("cpu")
    for kind, scale in KINDS.items():
        for b in args.batches:
            gen = torch.Generator().manual_seed(b)
            logits = torch.randn(b, args.vocab, generator=gen) * scale
            params = [torch.full((b,), args.temperature), torch.zeros(b, dtype=torch.long),
                      torch.full((b,), args.top_p), torch.zeros(b), torch.arange(b), torch.arange(b) * 7]
            temperature, top_k, top_p, min_p, seeds, counters = params

            def whole() -> torch.Tensor:
                noise = exponential_noise_reference(seeds, counters, args.vocab)
                return filtered_race_reference(logits / temperature[:, None], top_k, top_p, min_p, noise)

            head_ms = timed(lambda: draw_tokens_reference(logits, *params), cpu, args.iters)
            whole_ms = timed(whole, cpu, args.iters)
            same = (draw_tokens_reference(logits, *params) == whole()).sum().item()
            print(f"{kind:7s} batch {b:3d}: whole rows {whole_ms:8.2f} ms | heads {head_ms:8.2f} ms "
                  f"({whole_ms / head_ms:5.2f}x) | same token {same}/{b}", flush=True)
    if args.engine:
        from mstar.kernels.sampling import draw
        heads = draw.HEAD_MIN_VOCAB
        for how in ("heads", "whole rows", "heads", "whole rows"):   # alternated: the box's load drifts
            draw.HEAD_MIN_VOCAB = heads if how == "heads" else args.vocab + 1
            asyncio.run(_engine(args.requests, args.tokens, how))


async def _engine(requests: int, tokens: int, how: str) -> None:
    from mstar.config import EngineConfig
    from mstar.engine.engine import Engine
    from mstar.types import GenerateRequest, SamplingParams

    engine = Engine(EngineConfig(model="orpheus-tiny"))
    await engine.start()
    try:
        sampling = SamplingParams(max_tokens=tokens, temperature=0.6, top_p=0.8, repetition_penalty=1.3)

        async def one(i: int) -> None:
            stream = engine.submit(GenerateRequest(f"r{i}", "orpheus-tiny", {"text": "Hello there, how are you?"},
                                                   sampling))
            async for _ in stream:
                pass

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        print(f"orpheus-tiny, {how}: {requests} requests x {tokens} tokens in {time.perf_counter() - t0:.2f} s",
              flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    main()
