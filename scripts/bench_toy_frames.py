"""What fusing a code predictor into the talker's step saves, on the toy omni
model (tests/toys/omni.py): the same requests through `chat_frames` (the
predictor's codes as a nested loop of steps) and `chat_fused` (drawn inside
one talker step), with the engine steps, rows and wall time of each. The
toy's modules are tiny, so the wall time is the runtime's per-step cost,
not a model's; a real talker's shape is measured with its model.

    PYTHONPATH=.:tests python scripts/bench_toy_frames.py [--requests 16] [--frames 40] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_env import REPO, commit, version  # noqa: E402
from mstar.config import EngineConfig  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402
from toys.audio_decoder import MEL, PLACEHOLDER, VOCAB  # noqa: E402
from toys.omni import GROUPS, ToyOmniModel  # noqa: E402


async def run(walk: str, requests: int, frames: int, device: str) -> dict[str, float]:
    """`requests` concurrent requests whose talkers speak `frames` frames
    each (the thinker writes as many items), through `walk`."""
    model = ToyOmniModel()
    eng = Engine(EngineConfig(model="toy-omni", devices=(device,), dtype="float32"), model=model)
    await eng.start()
    gen = torch.Generator().manual_seed(0)

    async def one(i: int) -> int:
        ids = [*torch.randint(PLACEHOLDER + 1, VOCAB, (4,), generator=gen).tolist(), PLACEHOLDER, PLACEHOLDER]
        request = GenerateRequest(f"{walk}-{i}", "toy-omni", {"prompt_ids": ids, "mel": torch.randn(2, MEL)},
                                  SamplingParams(max_tokens=frames + 1, temperature=0.8, ignore_eos=True, seed=i),
                                  walk=walk, sampling_by={"talker": {"max_tokens": frames, "temperature": 0.8},
                                                          "cp": {"temperature": 0.8}})
        return sum(c.data is not None and not isinstance(c.data, list) for c in
                   [c async for c in eng.submit(request)])
    try:
        t0 = time.perf_counter()
        codes = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
        stats = [w.stats for w in eng.workers]
        return {"wall_s": round(wall, 3), "steps": sum(s.steps for s in stats), "rows": sum(s.rows for s in stats),
                "talker_codes": sum(codes)}
    finally:
        await eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=2, help="each walk this many times, interleaved")
    args = p.parse_args()
    print(json.dumps({"commit": commit(REPO), "torch": version("torch"), "python": platform.python_version(),
                      "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "device": args.device, "requests": args.requests, "frames": args.frames,
                      "codes_per_frame": GROUPS}))
    for r in range(args.rounds):
        for walk in ("chat_frames", "chat_fused"):
            print(json.dumps({"walk": walk, "round": r, **asyncio.run(run(walk, args.requests, args.frames,
                                                                         args.device))}))


if __name__ == "__main__":
    main()
