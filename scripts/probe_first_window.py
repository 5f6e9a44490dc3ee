"""How many decode steps after its 28th audio code an arriving speech request
gets its first audio, beside running speech streams: the scheduler's order
(a new row's first codec window against the streams' decode steps), with the
device's time taken out. In-process, Orpheus (tiny) on the CPU by default.

    PYTHONPATH=. python scripts/probe_first_window.py --streams 0 8 32

Prints, per level, the LLM step (counting the arrival's prompt step) that drew
its 28th code and the LLM step after which its first audio was emitted.
"""

from __future__ import annotations

import argparse
import asyncio

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.types import GenerateRequest, SamplingParams

FIRST_WINDOW = 28  # codes of Orpheus's first window (4 frames of 7)


async def level(model: str, devices: tuple[str, ...], streams: int) -> tuple[int | None, int | None]:
    eng = Engine(EngineConfig(model=model, devices=devices, scheduler=SchedulerConfig(max_num_seqs=streams + 4)))
    await eng.start()
    reports: list[StepReport] = []
    eng.add_report_hook(reports.append)

    async def speak(rid: str, tokens: int) -> None:
        sp = SamplingParams(max_tokens=tokens, temperature=0.6, top_p=0.8, seed=3, ignore_eos=True)
        async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"text": "hello there", "voice": "tara"},
                                                      sp)):
            assert chunk.error is None, chunk.error

    background = [asyncio.ensure_future(speak(f"s{i}", 4000)) for i in range(streams)]
    try:
        await asyncio.sleep(1.0 if streams else 0)  # the streams past their prompts
        start = len(reports)
        await speak("arrival", 60)
    finally:
        for task in background:
            task.cancel()
        await eng.shutdown()
    drawn, steps, cut = 0, 0, None
    for r in reports[start:]:
        if r.component == "llm":
            steps += r.steps
            drawn += r.sampled.count("arrival")
            if cut is None and drawn >= FIRST_WINDOW:
                cut = steps
        elif any("arrival" in e.request_ids for e in r.emits):
            return cut, steps
    return cut, None


async def main(a: argparse.Namespace) -> None:
    for streams in a.streams:
        cut, audio = await level(a.model, tuple(a.devices.split(",")), streams)
        print(f"streams {streams:>4}: code {FIRST_WINDOW} drawn at LLM step {cut}, first audio after LLM step {audio}",
              flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-tiny")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[0, 8, 32])
    asyncio.run(main(p.parse_args()))
