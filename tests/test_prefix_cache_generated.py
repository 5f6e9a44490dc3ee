"""What a request generated enters the prefix cache when it ends: a row
follows the ids its pages hold (its prompt, then each token its loop feeds
back), so a conversation's next turn, whose prompt holds the last answer,
starts from the cached answer too. Outputs equal an engine without the
cache; speech codes (a loop feeding another partition's stream) are not
followed."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tiny_llama import generated, save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams

pytest.importorskip("transformers")

VOCAB = 384
PAGE = 4


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_generated"), VOCAB)


def _hits(eng: Engine) -> int:
    return eng.workers[0].prefix_caches()["llm"]["hits"]


async def _conversation(folder: Path, caching: bool, mixed: bool = True) -> tuple[list[list[int]], list[int]]:
    """Three turns, each prompt the last one, its answer and a new question;
    each turn's answer and the prompt tokens it found cached."""
    eng = Engine(EngineConfig(model=str(folder), dtype="float32", scheduler=SchedulerConfig(
        page_size=PAGE, num_pages=256, prefix_caching=caching, mixed_steps=mixed)))
    await eng.start()
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(29)]
    answers, hits = [], []
    try:
        # a request decoding beside them, so that the turns' rows join a running decode group
        running = asyncio.ensure_future(generated(eng, "beside", [1, 5, 9], SamplingParams(
            max_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.05)
        for turn in range(3):
            before = _hits(eng) if caching else 0
            sp = SamplingParams(max_tokens=21, temperature=0.7, seed=turn, ignore_eos=True)
            answer = await generated(eng, f"t{turn}", prompt, sp)
            hits.append((_hits(eng) if caching else 0) - before)
            answers.append(answer)
            prompt = prompt + answer + [rng.randrange(3, VOCAB) for _ in range(6)]
        eng.abort("beside")
        await asyncio.gather(running, return_exceptions=True)
        for _ in range(3000):
            if eng.pages_in_use() == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.pages_in_use() == 0
        return answers, hits
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("mixed", [True, False])
async def test_a_conversations_next_turn_starts_from_the_last_answer(hf_folder: Path, mixed: bool) -> None:
    cached, hits = await _conversation(hf_folder, True, mixed)
    plain, _ = await _conversation(hf_folder, False, mixed)
    assert cached == plain
    assert hits[0] == 0
    # turn 1's prompt: turn 0's 30 prompt tokens and 21 answer tokens, of which the last never entered its pages
    assert hits[1] == (30 + 21 - 1) // PAGE * PAGE
    assert hits[2] == (30 + 21 + 6 + 21 - 1) // PAGE * PAGE


async def test_speech_codes_are_not_followed() -> None:
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=SchedulerConfig(page_size=PAGE)))
    await eng.start()
    try:
        model = eng.model
        sp = SamplingParams(max_tokens=60, ignore_eos=True)
        request = GenerateRequest("s", eng.model_name, {"text": "hello there", "voice": None}, sp)
        prompt = model.prepare(request).values["prompt_ids"].numel()
        chunks = [c async for c in eng.submit(request)]
        assert chunks[-1].error is None
        # only the prompt's full pages were cached, none of the codes it generated
        assert eng.workers[0].prefix_caches()["llm"]["pages"] == prompt // PAGE
    finally:
        await eng.shutdown()
