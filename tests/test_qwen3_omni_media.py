"""Qwen3-Omni hears and sees: chat messages whose user turn holds audio and
images, served by the engine from a folder transformers saved (a tiny random
model, float32), give transformers' thinker's greedy tokens and
log-probabilities for the same prompt and media; several requests at once
(two clips, a clip, two images, audio and an image, text alone) each get what
they get alone. The walk runs only the encoders a prompt's media need."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.models.qwen3_omni.model import Qwen3OmniModel
from mstar.models.tokenizer import builtin_byte_tokenizer
from mstar.models.vision.patches import image_patches
from mstar.types import GenerateRequest, SamplingParams
from test_qwen3_omni_thinker import saved  # noqa: F401  (the fixture)

TOKENS = 6


def _clip(seconds: float, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.05 * gen.standard_normal(t.size)).astype(np.float32)


def _messages(*parts: object) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def _audio(wav: np.ndarray) -> dict:
    return {"type": "audio", "audio": wav}


def _picture(height: int, width: int, seed: int) -> dict:
    gen = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255 // width), (y * 255 // height), gen.integers(0, 256, (height, width))], axis=-1)
    return {"type": "image", "image": rgb.astype(np.uint8)}


@pytest.fixture(scope="module")
def folder(saved: tuple[Path, Qwen3OmniMoeForConditionalGeneration]) -> Path:  # noqa: F811
    """The saved model with the byte tokenizer beside it (chat text needs one)."""
    path, _ = saved
    builtin_byte_tokenizer()._tok.save(str(path / "tokenizer.json"))
    return path


def _reference(model: Qwen3OmniMoeForConditionalGeneration, ids: list[int], clips: list[np.ndarray],
               pictures: list[np.ndarray]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' thinker, greedy, with the processor's features for each
    clip alone and the image processor's patches (`image_patches` equals it
    bit for bit): its tokens, and each step's log-probabilities."""
    kwargs = {}
    if pictures:
        patches = [image_patches(p) for p in pictures]
        kwargs["pixel_values"] = torch.cat([p.pixel_values for p in patches])
        kwargs["image_grid_thw"] = torch.tensor([p.grid_thw for p in patches])
    if clips:
        extractor = WhisperFeatureExtractor(feature_size=128)
        feats = [extractor(c, sampling_rate=16000, return_attention_mask=True, return_tensors="pt") for c in clips]
        longest = max(f["input_features"].shape[-1] for f in feats)
        kwargs["input_features"] = torch.cat([torch.nn.functional.pad(f["input_features"],
                                                                      (0, longest - f["input_features"].shape[-1]))
                                              for f in feats])
        kwargs["feature_attention_mask"] = torch.cat(
            [torch.nn.functional.pad(f["attention_mask"], (0, longest - f["attention_mask"].shape[-1]))
             for f in feats])
    with torch.no_grad():
        out = model.thinker.generate(input_ids=torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(ids):].tolist(), [s[0].log_softmax(-1) for s in out.scores]


async def test_audio_prompts_give_transformers_tokens_alone_and_together(
        folder: Path, saved: tuple[Path, Qwen3OmniMoeForConditionalGeneration]) -> None:  # noqa: F811
    _, hf = saved
    mine = Qwen3OmniModel(str(folder), str(folder))
    prompts = [_messages("what is this?", _audio(_clip(2.3, 1)), "and this?", _audio(_clip(1.4, 2))),
               _messages(_audio(_clip(3.1, 3)), "describe it"),
               _messages("two pictures", _picture(70, 90, 1), _picture(40, 33, 2)),
               _messages(_picture(64, 48, 3), "and a sound", _audio(_clip(1.2, 4))),
               _messages("no media here")]
    expected = []
    for messages in prompts:
        request = GenerateRequest("p", str(folder), {"messages": messages})
        ids = mine.prepare(request).values["prompt_ids"].tolist()
        parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
        clips = [p["audio"] for p in parts if p["type"] == "audio"]
        pictures = [p["image"] for p in parts if p["type"] == "image"]
        assert (mine.config.ids.audio in ids) == bool(clips) and (mine.config.ids.image in ids) == bool(pictures)
        expected.append(_reference(hf, ids, clips, pictures))
    assert [mine.walk_for(GenerateRequest("p", "m", {"messages": m})) for m in prompts] == \
        ["chat+audio", "chat+audio", "chat+image", "chat+audio+image", "chat"]

    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), max_model_len=512))
    await eng.start()
    try:
        async def run(i: int) -> list[int]:
            params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
            request = GenerateRequest(f"r{i}", str(folder), {"messages": prompts[i]}, params)
            chunks = [c async for c in eng.submit(request)]
            # each step's top log-probabilities, as transformers scores those tokens (the audio moves them)
            steps = [lp for c in chunks for lp in c.logprobs or ()]
            assert len(steps) == TOKENS
            for k, step in enumerate(steps):
                want = expected[i][1][k]
                for token, logprob in step.top:
                    assert logprob == pytest.approx(float(want[token]), abs=1e-4)
            return [t for c in chunks for t in c.token_ids]

        alone = [await run(i) for i in range(len(prompts))]
        together = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        assert alone == [tokens for tokens, _ in expected]
        assert list(together) == alone
    finally:
        await eng.shutdown()


def test_bad_audio_is_refused_naming_its_part(folder: Path) -> None:
    mine = Qwen3OmniModel(str(folder), str(folder))
    bad = _messages("hi", _audio(np.array([np.nan] * 4000, dtype=np.float32)))
    with pytest.raises(RequestError) as e:
        mine.prepare(GenerateRequest("p", "m", {"messages": bad}))
    assert e.value.field == "messages[1].content[1]"


def test_chat_without_the_assistants_opening_when_asked(folder: Path) -> None:  # noqa: F811
    """`add_generation_prompt: false` leaves the assistant's opening out (the
    last message is continued); speaking needs it, and says so."""
    mine = Qwen3OmniModel(str(folder), str(folder))
    messages = _messages("hello")
    opened = mine.prepare(GenerateRequest("a", "m", {"messages": messages})).values["prompt_ids"].tolist()
    plain = mine.prepare(GenerateRequest("b", "m", {"messages": messages, "add_generation_prompt": False})
                         ).values["prompt_ids"].tolist()
    ids = mine.config.ids
    assert opened[:len(plain)] == plain and opened[len(plain):len(plain) + 2] == [ids.im_start, ids.assistant]
    with pytest.raises(RequestError) as refused:
        mine.prepare(GenerateRequest("c", "m", {"messages": messages, "add_generation_prompt": False, "voice": "ethan"},
                                     walk="speak"))
    assert refused.value.field == "input"


def test_images_past_the_context_are_refused_before_they_are_cut(folder: Path,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each picture's token count comes from its size: a chat whose images overrun the context is refused
    (`context_length_exceeded`) without a patch cut (under the default budget a 4096-pixel square is ~400 MB
    of patches, and a few of them in a small request could exhaust the host's memory before the refusal)."""
    mine = Qwen3OmniModel(str(folder), str(folder))

    def cut(*args: object, **kwargs: object) -> None:
        raise AssertionError("patches were cut for a prompt past the context")
    monkeypatch.setattr("mstar.models.vision.patches._rgb", cut)   # where any cut first reads the pixels
    square = {"type": "image", "image": np.zeros((1024, 1024, 3), dtype=np.uint8)}   # 1024 tokens each
    count = mine.max_model_len // 1024 + 1
    with pytest.raises(RequestError) as refused:
        mine.prepare(GenerateRequest("p", "m", {"messages": _messages("what are they?", *[square] * count)}))
    assert refused.value.code == "context_length_exceeded" and refused.value.field == "messages"
    assert f"more than the model's {mine.max_model_len} tokens: " in refused.value.message
    assert "up to the end of messages[1]" in refused.value.message  # how far it counted (a system message first)
