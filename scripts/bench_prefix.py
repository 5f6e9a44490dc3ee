"""Time to first token of a request whose prompt shares a long prefix with an
earlier one, against the earlier one's: the prefix cache's gain, in process
(no HTTP), on the CPU by default.

    PYTHONPATH=. python scripts/bench_prefix.py --out docs/benchmarks/prefix_cache.json

For each of `--trials` prefixes of `--prefix` random tokens: a first request
(the prefix and a tail of its own) runs alone, then a second one with the
same prefix and another tail; the same again with `prefix_caching` off.
Prints each trial's times and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import REPO, commit  # noqa: E402

from mstar.config import EngineConfig, SchedulerConfig  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402


async def _ttft(eng: Engine, rid: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    first = None
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt},
                                                  SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))):
        if chunk.error:
            raise RuntimeError(chunk.error)
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    assert first is not None
    return first * 1e3


async def _measure(a: argparse.Namespace, caching: bool) -> list[tuple[float, float]]:
    eng = Engine(EngineConfig(model=a.model, devices=(a.device,), max_model_len=a.prefix + 64,
                              scheduler=SchedulerConfig(page_size=a.page_size, prefix_caching=caching)))
    await eng.start()
    try:
        rng = random.Random(0)
        vocab = 250
        await _ttft(eng, "warm", [rng.randrange(vocab) for _ in range(a.prefix + a.tail)])  # first-use costs
        out = []
        for t in range(a.trials):
            prefix = [rng.randrange(vocab) for _ in range(a.prefix)]
            first = await _ttft(eng, f"a{t}", prefix + [rng.randrange(vocab) for _ in range(a.tail)])
            second = await _ttft(eng, f"b{t}", prefix + [rng.randrange(vocab) for _ in range(a.tail)])
            out.append((first, second))
        return out
    finally:
        await eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix", type=int, default=1500)
    p.add_argument("--tail", type=int, default=12)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    env = dict(commit=commit(REPO), torch=torch.__version__, python=platform.python_version(),
               machine=platform.machine(), cpus=str(torch.get_num_threads()), device=a.device, model=a.model)
    print(" ".join(f"{k} {v}" for k, v in env.items()))
    report: dict = dict(environment=env, prefix=a.prefix, tail=a.tail, page_size=a.page_size,
                        command="scripts/bench_prefix.py " + " ".join(sys.argv[1:]))
    for caching in (True, False):
        rows = asyncio.run(_measure(a, caching))
        first = statistics.median(r[0] for r in rows)
        second = statistics.median(r[1] for r in rows)
        key = "cache_on" if caching else "cache_off"
        report[key] = dict(trials=[dict(first_ms=round(f, 2), second_ms=round(s, 2)) for f, s in rows],
                           first_ms_p50=round(first, 2), second_ms_p50=round(second, 2),
                           ratio=round(second / first, 3))
        print(f"prefix caching {'on ' if caching else 'off'}: first request {first:7.2f} ms, "
              f"second (same {a.prefix}-token prefix) {second:7.2f} ms, ratio {second / first:.3f}")
        for f, s in rows:
            print(f"    {f:7.2f} {s:7.2f}")
    if a.out is not None:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
