"""Qwen3-Omni speaks: the `speak` walks served by the engine from a folder
transformers saved (a tiny random model, float32) give what transformers'
`generate(return_audio=True)` gives with sampling off: the thinker's text,
then the talker's frames (the code predictor inside each step, the talker
taking the text token by token as it is written) and code2wav's waveform,
streamed frame by frame, equal to transformers' one whole decode (to one
PCM16 step). With the talker's repetition penalty on, as released. Requests
running together (one with audio in) each get what they get alone."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.models.qwen3_omni.model import Qwen3OmniModel
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams
from test_qwen3_omni_media import _audio, _clip, _messages, folder  # noqa: F401  (a fixture)
from test_qwen3_omni_thinker import saved  # noqa: F401  (a fixture)
from toys.serving import DEVICES

TEXT, FRAMES = 5, 9  # thinker tokens; talker tokens (one frame fewer: the last first code has no frame)
PENALTY = 1.05


def _reference(model: Qwen3OmniMoeForConditionalGeneration, ids: list[int], clips: list[np.ndarray],
               voice: str) -> tuple[list[int], np.ndarray]:
    """transformers' text and PCM16 waveform. Stopped at its budget, its
    thinker's last token never reaches the talker; mstar's thinker is given
    one token less, so both talkers read the same text."""
    kwargs = {}
    if clips:
        feats = WhisperFeatureExtractor(feature_size=128)(clips[0], sampling_rate=16000, return_attention_mask=True,
                                                          return_tensors="pt")
        kwargs = {"input_features": feats["input_features"], "feature_attention_mask": feats["attention_mask"]}
    with torch.no_grad():
        seqs, wav = model.generate(input_ids=torch.tensor([ids]), return_audio=True, speaker=voice,
                                   thinker_max_new_tokens=TEXT + 1, thinker_do_sample=False,
                                   talker_max_new_tokens=FRAMES, talker_do_sample=False,
                                   talker_repetition_penalty=PENALTY, **kwargs)
    pcm = (wav.reshape(-1).float().clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    return seqs[0, len(ids):len(ids) + TEXT].tolist(), pcm


async def _speak(eng: Engine, rid: str, model: str, messages: list[dict], voice: str) -> tuple[list[int], np.ndarray]:
    params = SamplingParams(max_tokens=TEXT, temperature=0.0, ignore_eos=True)
    request = GenerateRequest(rid, model, {"messages": messages, "voice": voice}, params, walk="speak",
                              sampling_by={"talker": {"temperature": 0.0, "max_tokens": FRAMES,
                                                      "repetition_penalty": PENALTY},
                                           "cp": {"temperature": 0.0}})
    text, audio = [], bytearray()
    async for chunk in eng.submit(request):
        text += chunk.token_ids
        if chunk.audio:
            audio += chunk.audio
        if chunk.finished:
            assert chunk.error is None, chunk.error
    return text, np.frombuffer(bytes(audio), dtype=np.int16)


@pytest.mark.parametrize("device", DEVICES)
async def test_speech_equals_transformers_generate_alone_and_together(
        folder: Path, saved: tuple[Path, Qwen3OmniMoeForConditionalGeneration], device: str) -> None:  # noqa: F811
    """On CUDA too (float32, TF32 off): the code predictor's frames there run
    as CUDA graphs, the thinker's decode too."""
    _, hf = saved
    mine = Qwen3OmniModel(str(folder), str(folder))
    cases = [(_messages("say something"), "ethan"),
             (_messages("what do you hear?", _audio(_clip(1.7, 5))), "ethan")]
    expected = []
    for messages, voice in cases:
        ids = mine.prepare(GenerateRequest("p", "m", {"messages": messages, "voice": voice}, walk="speak")
                           ).values["prompt_ids"].tolist()
        clips = [p["audio"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                 if p["type"] == "audio"]
        expected.append(_reference(hf, ids, clips, voice))
    for _, pcm in expected:
        assert len(pcm) == 1920 * (FRAMES - 1) - 555 and np.abs(pcm).max() > 0

    if device.startswith("cuda"):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    eng = Engine(EngineConfig(model=str(folder), devices=(device,), dtype="float32", max_model_len=512))
    await eng.start()
    try:
        alone = [await _speak(eng, f"a{i}", str(folder), m, v) for i, (m, v) in enumerate(cases)]
        together = await asyncio.gather(*(_speak(eng, f"t{i}", str(folder), m, v) for i, (m, v) in enumerate(cases)))
        for (text, pcm), (want_text, want_pcm) in zip(alone, expected):
            assert text == want_text
            assert len(pcm) == len(want_pcm)
            assert np.abs(pcm.astype(np.int32) - want_pcm).max() <= 1  # float rounding, then one PCM16 step
        for (text, pcm), (again_text, again_pcm) in zip(alone, together):  # batched GEMMs round differently
            assert text == again_text and np.abs(pcm.astype(np.int32) - again_pcm).max() <= 1
    finally:
        await eng.shutdown()


def test_an_unknown_voice_is_refused_naming_the_field(folder: Path) -> None:  # noqa: F811
    mine = Qwen3OmniModel(str(folder), str(folder))
    with pytest.raises(RequestError) as e:
        mine.prepare(GenerateRequest("p", "m", {"messages": _messages("hi"), "voice": "nobody"}, walk="speak"))
    assert e.value.field == "voice" and "ethan" in e.value.message


async def test_text_to_speech_reads_the_text_as_the_talker_would_speak_it_after_the_thinker(
        folder: Path) -> None:  # noqa: F811
    """The `tts` walk (no thinker: the talker reads the given text) speaks as
    the `speak` walk does when the thinker's answer is that text, to a user
    turn of the same text: here a thinker held to answer with it (then EOS)."""
    text = "read me"
    model = Qwen3OmniModel(str(folder), str(folder))
    script = model.tokenizer.encode(text, add_special_tokens=False)
    answer = [*script, model.config.ids.im_end]
    build = model.build_component

    def held_to_the_script(component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        module = build(component, device, dtype)
        if component == "thinker":
            forward, step = module.forward, itertools.count()

            def answering(batch):  # the real thinker's rows for the talker; its tokens are the script's
                out = forward(batch)
                # a decode group may compute one step past the EOS before it reads it: that output is dropped
                token = answer[min(next(step), len(answer) - 1)]
                out["logits"] = torch.full_like(out["logits"], -1e4).index_fill(-1, torch.tensor([token]), 0.0)
                return out

            module.prefill = module.decode = answering
        return module

    model.build_component = held_to_the_script
    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), max_model_len=512), model=model)
    await eng.start()
    greedy = {"talker": {"temperature": 0.0, "max_tokens": FRAMES}, "cp": {"temperature": 0.0}}
    try:
        spoken, said = bytearray(), []
        request = GenerateRequest("s", str(folder), {"messages": [{"role": "user", "content": text}], "voice": "ethan"},
                                  SamplingParams(max_tokens=len(answer) + 2, temperature=0.0), walk="speak",
                                  sampling_by=greedy)
        async for chunk in eng.submit(request):
            spoken += chunk.audio or b""
            said += chunk.token_ids
        # the thinker stopped at its EOS, but its talker ran out of frames: the answer was cut, it ends "length"
        assert said[:len(script)] == script and len(said) <= len(answer) and chunk.finish_reason == "length"
        read = bytearray()
        request = GenerateRequest("t", str(folder), {"text": text, "voice": "ethan"},
                                  SamplingParams(temperature=0.0, max_tokens=FRAMES), walk="tts",
                                  sampling_by={"cp": {"temperature": 0.0}})
        async for chunk in eng.submit(request):
            read += chunk.audio or b""
            if chunk.finished:
                assert chunk.error is None, chunk.error
        assert len(read) == 2 * (1920 * (FRAMES - 1) - 555)
        assert read == spoken
    finally:
        await eng.shutdown()


async def test_a_talker_without_a_stop_ends_at_the_edge_of_the_context() -> None:
    """The talker's budget is its own key's, not fitted to the context as the
    root's is: past the context its loop ends ("length") instead of failing."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", devices=("cpu",), max_model_len=96))
    await eng.start()
    try:
        request = GenerateRequest("edge", "qwen3-omni-tiny", {"messages": [{"role": "user", "content": "hello"}]},
                                  SamplingParams(max_tokens=4, ignore_eos=True), walk="speak",
                                  sampling_by={"talker": {"stop_token_ids": [], "ignore_eos": True}})
        samples, last = 0, None
        async for chunk in eng.submit(request):
            samples += len(chunk.audio or b"") // 2
            last = chunk
        assert last is not None and last.error is None and last.finish_reason == "length"
        assert samples > 1920 * 40  # it spoke until the context was full (96 tokens, its prompt's about 20)
    finally:
        await eng.shutdown()


def test_the_talker_stops_at_the_codec_eos_which_its_own_fields_move() -> None:
    """The talker draws codec ids: its key ends at the codec's EOS (not the
    thinker's text EOS, an id past its vocabulary); `ignore_eos` drops it and
    `stop_token_ids` add to it, as they do for the text."""
    model = load_model("qwen3-omni-tiny")
    codec_eos = model.config.talker.codec_eos_id

    def stops(**talker: object) -> dict[str, tuple[int, ...]]:
        return model.prepare(GenerateRequest("s", "qwen3-omni-tiny", {"messages": [{"role": "user", "content": "hi"}]},
                                             walk="speak", sampling_by={"talker": talker})).stop_ids
    assert stops() == {"thinker": model.eos_token_ids, "talker": (codec_eos,), "cp": ()}
    assert stops(ignore_eos=True)["talker"] == ()
    assert stops(stop_token_ids=[7])["talker"] == (codec_eos, 7)


async def test_min_tokens_bans_only_ids_of_the_keys_vocabulary() -> None:
    """`min_tokens` bans a key's stop ids while it is short: the talker's (the
    codec's EOS), and a text stop id past the vocabulary, which no draw gives,
    bans nothing rather than failing the step."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", devices=("cpu",), max_model_len=256))
    await eng.start()
    try:
        messages = {"messages": [{"role": "user", "content": "hi"}]}
        cases = [GenerateRequest("text", "qwen3-omni-tiny", messages,
                                 SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=(999_999, 2**31 - 1))),
                 GenerateRequest("spoken", "qwen3-omni-tiny", messages, SamplingParams(max_tokens=2, ignore_eos=True),
                                 walk="speak", sampling_by={"talker": {"min_tokens": 3, "max_tokens": 4}})]
        for request in cases:
            tokens, samples, last = 0, 0, None
            async for chunk in eng.submit(request):
                tokens += len(chunk.token_ids)
                samples += len(chunk.audio or b"") // 2
                last = chunk
            assert last is not None and last.error is None, (request.request_id, last)
            if request.walk == "speak":
                assert samples > 0 and last.finish_reason is not None
            else:
                assert tokens >= 2
    finally:
        await eng.shutdown()


async def test_chat_and_spoken_chat_prefill_together_without_a_failed_step() -> None:
    """A chat's thinker prefill writes its token; a spoken chat's also the
    rows the talker reads: admitted together they run as two calls of one
    step, not a failed batch retried row by row."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", devices=("cpu",), max_model_len=256))
    await eng.start()
    try:
        async def run(rid: str, walk: str) -> tuple[list[int], int]:
            request = GenerateRequest(rid, "qwen3-omni-tiny", {"messages": [{"role": "user", "content": "hi"}]},
                                      SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), walk=walk,
                                      sampling_by={"talker": {"max_tokens": 3, "ignore_eos": True,
                                                              "stop_token_ids": []}}
                                      if walk == "speak" else {})  # a sampled first code may be EOS: no audio
            text, audio = [], 0
            async for chunk in eng.submit(request):
                text += chunk.token_ids
                audio += len(chunk.audio or b"")
            return text, audio

        alone = [await run("c0", "chat"), await run("s0", "speak")]
        together = await asyncio.gather(*(run(f"{w}{i}", w) for i in range(1, 3) for w in ("chat", "speak")))
        assert [t for t, _ in together] == [alone[0][0], alone[1][0]] * 2
        assert [a > 0 for _, a in together] == [False, True] * 2
        assert eng.workers[0].stats.failed_steps == 0
    finally:
        await eng.shutdown()
