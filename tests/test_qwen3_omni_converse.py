"""Qwen3-Omni in full duplex: one `converse` request takes user turns while it
runs (audio, then audio and text), each a thinker turn on the KV cache it
has, each answered in text and speech. The thinker's text of every turn is
transformers' greedy answer to the whole conversation so far (its earlier
answers included); the talker speaks every turn to its end (past the turn's
text it reads tts_eos, then tts_pad, to its own stop), and the conversation's
audio is one waveform."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.models.qwen3_omni.model import Qwen3OmniModel
from mstar.types import GenerateRequest, SamplingParams
from test_qwen3_omni_media import _clip, folder  # noqa: F401  (a fixture)
from test_qwen3_omni_thinker import saved  # noqa: F401  (a fixture)

TEXT, FRAMES = 4, 6


def _thinker(model: Qwen3OmniMoeForConditionalGeneration, ids: list[int], clips: list[np.ndarray]) -> list[int]:
    extractor = WhisperFeatureExtractor(feature_size=128)
    feats = [extractor(c, sampling_rate=16000, return_attention_mask=True, return_tensors="pt") for c in clips]
    longest = max(f["input_features"].shape[-1] for f in feats)
    pad = torch.nn.functional.pad
    with torch.no_grad():
        out = model.thinker.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=TEXT, do_sample=False,
            input_features=torch.cat([pad(f["input_features"], (0, longest - f["input_features"].shape[-1]))
                                      for f in feats]),
            feature_attention_mask=torch.cat([pad(f["attention_mask"], (0, longest - f["attention_mask"].shape[-1]))
                                              for f in feats]))
    return out[0, len(ids):].tolist()


async def test_each_turn_is_the_thinkers_answer_to_the_conversation_and_is_spoken(
        folder: Path, saved: tuple[Path, Qwen3OmniMoeForConditionalGeneration]) -> None:  # noqa: F811
    _, hf = saved
    mine = Qwen3OmniModel(str(folder), str(folder))
    first, second = _clip(1.6, 7), _clip(1.1, 8)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": first}]}]
    more = {"audio": second, "text": "and now?"}

    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), max_model_len=512), model=mine)
    await eng.start()
    try:
        request = GenerateRequest("c", str(folder), {"messages": messages, "voice": "ethan"},
                                  SamplingParams(max_tokens=TEXT, temperature=0.0, ignore_eos=True), walk="converse",
                                  more_input=True, sampling_by={"talker": {"temperature": 0.0, "max_tokens": FRAMES},
                                                                "cp": {"temperature": 0.0}})
        text, audio, turns = [], 0, 0
        async for chunk in eng.submit(request):
            text += chunk.token_ids
            audio += len(chunk.audio or b"") // 2
            if chunk.awaiting_input:
                turns += 1
                if turns == 1:
                    eng.append("c", more)
                else:
                    eng.close_input("c")
            if chunk.finished:
                assert chunk.error is None, chunk.error
        assert turns == 2
    finally:
        await eng.shutdown()

    prompt = mine.prepare(GenerateRequest("p", "m", {"messages": messages, "voice": "ethan"}, walk="converse")
                          ).values["prompt_ids"].tolist()
    answer = _thinker(hf, prompt, [first])
    assert text[:TEXT] == answer
    piece = mine.prepare_more(request, more).values
    joined = mine.join_turn(answer[-1], piece, 0).values["prompt_ids"].tolist()
    conversation = prompt + answer[:-1] + joined
    assert text[TEXT:] == _thinker(hf, conversation, [first, second])
    # each turn's talker ran to its budget, FRAMES - 1 frames a turn; code2wav goes on from one answer into the
    # next (one waveform: the samples held back at an answer's end come at the next one's start)
    assert audio == 2 * 1920 * (FRAMES - 1) - 555


async def test_a_turn_the_model_refuses_fails_at_append_and_the_conversation_goes_on(
        folder: Path) -> None:  # noqa: F811
    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), max_model_len=512))
    await eng.start()
    try:
        request = GenerateRequest("c", str(folder), {"messages": [{"role": "user", "content": "hi"}]},
                                  SamplingParams(max_tokens=2, ignore_eos=True), walk="converse", more_input=True,
                                  sampling_by={"talker": {"max_tokens": 3}})
        turns, reasons = 0, []
        async for chunk in eng.submit(request):
            if chunk.awaiting_input:
                turns += 1
                if turns == 1:
                    with pytest.raises(RequestError) as refused:
                        eng.append("c", {"content": [{"type": "image", "image": np.zeros((64, 64, 3), np.uint8)}]})
                    assert refused.value.field == "input[0]"
                    eng.append("c", {"text": "go on"})
                else:
                    eng.close_input("c")
            if chunk.finished:
                reasons.append((chunk.finish_reason, chunk.error))
        assert turns == 2 and reasons == [("length", None)]
    finally:
        await eng.shutdown()
