"""The worker thread's host time per round of Qwen3-Omni spoken answers.

`qwen3-omni-tiny` on the CPU, N concurrent `speak` requests in this process.
A round is one talker frame for every row (a `talker.speak` step). The
worker thread's CPU time over the level, less the time it spent inside the
model's forwards and the sampler's kernels (work a GPU does, from CUDA
graphs), divided by the rounds: the Python a round costs the worker, which
on the H200 sits between the device's steps. The event loop's thread is
timed the same way (it competes for the GIL). CPU attention planning stays
in (a GPU replays graphs instead), so the number is an upper bound.

    PYTHONPATH=. python scripts/bench_omni_host.py --concurrency 8 32 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import REPO, commit  # noqa: E402

from mstar.config import EngineConfig, SchedulerConfig  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.execution import row_sampler  # noqa: E402
from mstar.models.qwen3_omni.speaking import TalkerSteps  # noqa: E402
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav  # noqa: E402
from mstar.models.qwen3_omni.thinker import ThinkerDecoder  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402


class DeviceWork:
    """Thread CPU time spent inside wrapped functions (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()

    def wrap(self, owner: object, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t0 = time.thread_time() if depth == 0 else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds += time.thread_time() - t0
        setattr(owner, name, call)


def thread_cpu(ident: int) -> float:
    """CPU seconds of the thread with `ident` (its pthread_t, as `threading.get_ident` gives it)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def speak(eng: Engine, rid: str, text_tokens: int, frames: int) -> None:
    request = GenerateRequest(rid, "qwen3-omni-tiny", {"messages": [{"role": "user", "content": "Tell me a story."}]},
                              SamplingParams(max_tokens=text_tokens, ignore_eos=True), walk="speak",
                              sampling_by={"talker": {"max_tokens": frames + 1, "ignore_eos": True,
                                                      "stop_token_ids": []}})
    async for chunk in eng.submit(request):
        if chunk.finished and chunk.error:
            raise RuntimeError(chunk.error)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--text-tokens", type=int, default=30)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3, help="runs a level; the median is printed (the CPU is noisy)")
    args = p.parse_args()
    device = DeviceWork()
    for owner, names in ((ThinkerDecoder, ("forward", "prefill", "decode")),
                         (TalkerSteps, ("prefill", "speak", "read")),
                         (Code2Wav, ("stream",)), (row_sampler, ("sample", "token_logprobs"))):
        for name in names:
            if hasattr(owner, name):
                device.wrap(owner, name)
    rounds = [0]
    speak_step = TalkerSteps.speak  # one call a round, item step or group step

    def counted(self, batch):
        rounds[0] += 1
        return speak_step(self, batch)
    TalkerSteps.speak = counted
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", devices=("cpu",), max_model_len=2048,
                              scheduler=SchedulerConfig(max_num_seqs=64)))
    await eng.start()
    print(f"worker host time per round, qwen3-omni-tiny on the CPU: commit {commit(REPO)}, {args.text_tokens} text "
          f"tokens and {args.frames} frames a request")
    try:
        await asyncio.gather(*(speak(eng, f"warm{i}", 4, 4) for i in range(4)))
        worker = eng.workers[0]._thread.ident
        loop_thread = threading.get_ident()
        for c in args.concurrency:
            host, loop = [], []
            for r in range(args.repeat):
                rounds[0], device.seconds = 0, 0.0
                w0, l0, t0 = thread_cpu(worker), thread_cpu(loop_thread), time.perf_counter()
                await asyncio.gather(*(speak(eng, f"c{c}-{r}-{i}", args.text_tokens, args.frames) for i in range(c)))
                worker_s, loop_s = thread_cpu(worker) - w0, thread_cpu(loop_thread) - l0
                wall, n = time.perf_counter() - t0, max(rounds[0], 1)
                host.append(1e3 * (worker_s - device.seconds) / n)
                loop.append(1e3 * loop_s / n)
                print(f"concurrency {c:3d}: {n} rounds in {wall:.1f} s; worker CPU {1e3 * worker_s / n:.2f} ms a "
                      f"round, of which model and sampler {1e3 * device.seconds / n:.2f}, host {host[-1]:.2f}; "
                      f"event loop CPU {loop[-1]:.2f} ms a round")
            if args.repeat > 1:
                print(f"concurrency {c:3d}: median of {args.repeat}: host {statistics.median(host):.2f} ms a round, "
                      f"event loop {statistics.median(loop):.2f} (host range {min(host):.2f}-{max(host):.2f})")
    finally:
        await eng.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
