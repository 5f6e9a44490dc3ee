"""Orpheus: the token -> SNAC code layout, the codec's windows against the
reference decode, the stream's windows, prompts, the registry's names and
folder layout, and speech end to end through the engine on orpheus-tiny."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
import torch

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import ConfigError, RequestError
from mstar.graph import SlidingWindow, compile_walks
from mstar.models.llama.config import ORPHEUS_3B
from mstar.models.orpheus import OrpheusCodec, OrpheusModel, PlayedWindows
from mstar.models.orpheus.tokens import (AUDIO_TOKEN_BASE, AUDIO_TOKEN_END, VOICES, codes_to_tokens,
                                         tokens_to_codes)
from mstar.models.registry import load_model
from mstar.models.snac import SNAC_24KHZ, load_snac_decoder
from mstar.types import GenerateRequest, SamplingParams

SPF = 2048  # samples per frame: SNAC 24 kHz hop 512 x 4 (the coarsest level's stride)


def _token(position: int, code: int) -> int:
    return AUDIO_TOKEN_BASE + 4096 * position + code


# ------------------------------------------------------------ token layout


def test_tokens_to_codes_by_hand() -> None:
    # two frames: position k of frame f holds code 100 * f + 10 * k + 1
    frames = [[100 * f + 10 * k + 1 for k in range(7)] for f in range(2)]
    ids = [_token(k, c) for frame in frames for k, c in enumerate(frame)]
    assert ids[:7] == [128267, 132373, 136479, 140585, 144691, 148797, 152903]
    l0, l1, l2 = tokens_to_codes(torch.tensor([ids + ids[:5]]))  # a trailing partial frame is dropped
    assert l0.tolist() == [[1, 101]]
    assert l1.tolist() == [[11, 41, 111, 141]]                       # positions 1, 4
    assert l2.tolist() == [[21, 31, 51, 61, 121, 131, 151, 161]]     # positions 2, 3, 5, 6
    assert codes_to_tokens([l0, l1, l2]).tolist() == [ids]


def test_out_of_range_codes_are_clamped() -> None:
    ids = [_token(k, 7) for k in range(7)]
    ids[1] = _token(0, 5)     # a position-0 id at position 1: code -4091
    ids[2] = _token(6, 5)     # a position-6 id at position 2: code 16389
    l0, l1, l2 = tokens_to_codes(torch.tensor([ids]))
    assert l0.tolist() == [[7]] and l1.tolist() == [[0, 7]] and l2.tolist() == [[4095, 7, 7, 7]]


# ------------------------------------------------------------------ codec


# SNAC 24 kHz's geometry (rates, strides, hop 512, codebooks) at a fraction of
# its width: the same windows and frames, decoded ~50x faster on a CPU
NARROW_24KHZ = dataclasses.replace(SNAC_24KHZ, encoder_dim=8, decoder_dim=64)


@pytest.fixture(scope="module")
def snac_folder(tmp_path_factory):
    """The reference codec (the snac package, random weights) saved as a snac folder."""
    snac = pytest.importorskip("snac")
    torch.manual_seed(0)
    ref = snac.SNAC(**NARROW_24KHZ.to_dict()).eval()
    folder = tmp_path_factory.mktemp("snac")
    (folder / "config.json").write_text(json.dumps(NARROW_24KHZ.to_dict()))
    torch.save(ref.state_dict(), folder / "pytorch_model.bin")
    return folder, ref


@pytest.fixture(scope="module")
def codec(snac_folder) -> OrpheusCodec:
    return OrpheusCodec(load_snac_decoder(snac_folder[0]), SPF)


def _random_tokens(rows: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = [torch.randint(0, 4096, (rows, frames * n), generator=g) for n in (1, 2, 4)]
    return codes_to_tokens(codes)


def _reference(ref, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """decoder.py's convert_to_audio, rewritten: redistribute a window's
    tokens into SNAC's three levels, decode with the package."""
    rows = []
    for row in tokens.tolist():
        code = [t - AUDIO_TOKEN_BASE for t in row[:len(row) // 7 * 7]]
        l0, l1, l2 = [], [], []
        for j in range(len(code) // 7):
            f = code[7 * j: 7 * j + 7]
            l0 += [f[0]]
            l1 += [f[1] - 4096, f[4] - 4 * 4096]
            l2 += [f[2] - 2 * 4096, f[3] - 3 * 4096, f[5] - 5 * 4096, f[6] - 6 * 4096]
        rows.append((l0, l1, l2))
    codes = [torch.tensor([r[level] for r in rows]) for level in range(3)]
    torch.manual_seed(seed)
    with torch.inference_mode():
        return ref.decode(codes)[:, 0]


def test_full_window_is_the_second_frame_of_the_reference_decode(snac_folder, codec) -> None:
    tokens = _random_tokens(2, 4, seed=1)
    assert tokens.shape == (2, 28)
    torch.manual_seed(7)
    out = codec.window(tokens)
    ref = _reference(snac_folder[1], tokens, seed=7)
    assert ref.shape == (2, 4 * SPF)
    assert out.shape == (2, SPF) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref[:, SPF:2 * SPF], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length, frames_out", [(27, 2), (21, 2), (15, 1), (14, 1), (13, 0), (3, 0)])
def test_short_last_window_plays_from_its_second_frame(snac_folder, codec, length: int, frames_out: int) -> None:
    tokens = _random_tokens(1, 4, seed=2)[:, :length]
    torch.manual_seed(3)
    out = codec.window(tokens)
    assert out.shape == (1, frames_out * SPF)
    if frames_out:
        ref = _reference(snac_folder[1], tokens, seed=3)
        torch.testing.assert_close(out, ref[:, SPF:], atol=1e-5, rtol=1e-4)


def _played_frames(policy: SlidingWindow, total: int) -> list[int]:
    """Frames the codec plays over a stream of `total` tokens, in order."""
    chunks, cut = [], 0
    for n in range(1, total + 1):
        ready = policy.ready(n, cut)
        cut += len(ready)
        chunks += ready
    chunks += policy.flush(total, cut)
    played = []
    for start, end in chunks:
        first, frames = start // 7, (end - start) // 7
        played += [first + 1] if end - start == 28 else list(range(first + 1, first + frames))
    return played


@pytest.mark.parametrize("first", [0, 2, 3, 4])
@pytest.mark.parametrize("total", [0, 6, 13, 14, 20, 21, 27, 28, 29, 34, 35, 48, 49, 50, 63, 111, 112])
def test_played_windows_play_every_frame_but_the_first_once(total: int, first: int) -> None:
    frames = total // 7
    policy = PlayedWindows(28, 7, first=first)
    assert _played_frames(policy, total) == list(range(1, frames))
    assert isinstance(policy, SlidingWindow)
    # a last window holds whole frames: 14 or 21 tokens, the lengths the codec has graphs for
    for cut in range(max(frames - 3, 0), frames + 1):
        assert all(end - start in (14, 21, 28) for start, end in policy.flush(total, cut))


@pytest.mark.parametrize("first, due", [(0, [28, 35, 42]), (2, [14, 35, 42]), (3, [21, 42, 49]), (4, [28, 35, 42])])
def test_an_early_first_window_is_cut_as_soon_as_its_frames_are_written(first: int, due: list[int]) -> None:
    policy = PlayedWindows(28, 7, first=first)
    assert [policy.due(i) for i in range(3)] == due
    assert policy.ready(due[0] - 1, 0) == [] and len(policy.ready(due[0], 0)) == 1
    # what the next chunk reads is kept, what none reads may go
    assert policy.keep_from(due[0], 1) == policy.ready(due[1], 1)[0][0]
    with pytest.raises(ValueError, match="first chunk"):
        PlayedWindows(28, 7, first=1)


# ------------------------------------------------------------ model file


@pytest.fixture(scope="module")
def tiny() -> OrpheusModel:
    model = load_model("orpheus-tiny")
    assert isinstance(model, OrpheusModel)
    return model


def _speak(text: str | None = "hello there", voice: str | None = "tara", max_tokens: int = 60, **kw):
    inputs = {"text": text, "voice": voice} if voice is not None else {"text": text}
    return GenerateRequest("r", "orpheus-tiny", inputs, SamplingParams(max_tokens=max_tokens, **kw))


def test_walks_compile(tiny) -> None:
    plans = compile_walks(tiny.walks, tiny.components)
    speak = plans["speak"]
    assert tiny.default_walk == "speak" and set(speak.partitions) == {"llm", "codec"}
    (stream,) = speak.streams["token"]
    assert stream.accept == (AUDIO_TOKEN_BASE, AUDIO_TOKEN_BASE + 7 * 4096) == (128266, 156938)
    assert (stream.chunks.size, stream.chunks.stride) == (28, 7)
    assert speak.emits["pcm"].modality == "audio" and speak.emits["pcm"].sample_rate == 24000
    assert "generate" in plans
    # the early walk differs only in its first window
    (early,) = plans[tiny.early_tts_walk].streams["token"]
    assert early.chunks == dataclasses.replace(stream.chunks, first=2) and early.accept == stream.accept


def test_prompt_format(tiny) -> None:
    ids = tiny.prepare(_speak("hi", "leo")).values["prompt_ids"].tolist()
    # START_OF_HUMAN, the tokenized "leo: hi" with its BOS (the byte tokenizer's: 256), then
    # END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH
    assert ids == [128259, 256, *b"leo: hi", 128009, 128260, 128261, 128257]
    assert tiny.prepare(_speak("hi", voice=None)).values["prompt_ids"].tolist()[2:6] == list(b"tara")
    assert tiny.prepare(_speak("hi", " Zoe ")).values["prompt_ids"].tolist()[2:5] == list(b"zoe")
    passthrough = GenerateRequest("r", "orpheus-tiny", {"prompt_ids": [1, 2, 3]}, SamplingParams())
    assert tiny.prepare(passthrough).values["prompt_ids"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("request_, field", [
    (_speak("hi", "nobody"), "voice"),
    (_speak("hi", ""), "voice"),
    (_speak(""), "input"),
    (_speak("   "), "input"),
    (_speak(None), "input"),
    (_speak("hi", max_tokens=2040), "max_tokens"),
    (_speak("x" * 3000), "input"),  # a prompt past the context names the text it came from
])
def test_bad_requests(tiny, request_, field) -> None:
    with pytest.raises(RequestError) as e:
        tiny.prepare(request_)
    assert e.value.field == field


def test_voices_and_default_sampling(tiny) -> None:
    assert tiny.voices == VOICES and tiny.default_voice == "tara" and len(VOICES) == 8
    sp = tiny.default_sampling()
    assert (sp.temperature, sp.top_p, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.8, 1.3, 1200)
    sp.validate(tiny.max_model_len)


def test_names_and_folder_layout(tmp_path, snac_folder) -> None:
    transformers = pytest.importorskip("transformers")
    big = load_model("orpheus-3b", "dummy")
    assert isinstance(big, OrpheusModel) and big.config is ORPHEUS_3B and big.max_model_len == 8192
    with pytest.raises(ConfigError, match="--load-format dummy"):
        load_model("orpheus-3b")
    # a local checkpoint: the HF Llama folder, with the codec in snac/
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=156940, max_position_embeddings=256,
                                   eos_token_id=128009, bos_token_id=128000, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    plain = load_model(str(tmp_path))
    assert not isinstance(plain, OrpheusModel)
    (tmp_path / "snac").mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (tmp_path / "snac" / name).write_bytes((snac_folder[0] / name).read_bytes())
    model = load_model(str(tmp_path))
    assert isinstance(model, OrpheusModel) and model.eos_token_ids == (128009,)
    cpu = torch.device("cpu")
    model.build_component("llm", cpu, torch.float32)
    codec = model.build_component("codec", cpu, torch.float32)
    tokens = _random_tokens(1, 4, seed=4)
    torch.manual_seed(5)
    torch.testing.assert_close(codec.window(tokens), _reference(snac_folder[1], tokens, seed=5)[:, SPF:2 * SPF],
                               atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------ end to end


async def _drained(eng: Engine) -> None:
    for _ in range(3000):
        if len(eng.store) == 0 and eng.pages_in_use() == 0 and eng.num_running() == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not drain: {len(eng.store)} tensors, {eng.pages_in_use()} pages")


async def test_speech_end_to_end_on_orpheus_tiny(tiny) -> None:
    eng = Engine(EngineConfig(model="orpheus-tiny"), model=tiny)
    await eng.start()
    try:
        base = dataclasses.replace(tiny.default_sampling(), max_tokens=60, ignore_eos=True)

        async def run(rid: str, voice: str, seed: int, walk: str | None = None):
            sp = dataclasses.replace(base, seed=seed)
            req = GenerateRequest(rid, "orpheus-tiny", {"text": "hello there", "voice": voice}, sp, walk=walk)
            return [c async for c in eng.submit(req)]

        voices = VOICES[:4]
        # 4 speech requests at once, beside the same requests on the LLM-only
        # walk: a request's seed draws the same tokens whatever its batch
        runs = await asyncio.gather(*[run(f"s{i}", v, seed=i) for i, v in enumerate(voices)],
                                    *[run(f"t{i}", v, seed=i, walk="generate") for i, v in enumerate(voices)])
        speech_runs, text_runs = runs[:4], runs[4:]
        for tokens_run, chunks in zip(text_runs, speech_runs):
            tokens = [t for c in tokens_run for t in c.token_ids]
            audio_tokens = sum(AUDIO_TOKEN_BASE <= t < AUDIO_TOKEN_END for t in tokens)
            assert len(tokens) == 60 and audio_tokens > 40  # orpheus-tiny leans toward audio ids
            audio = [c for c in chunks if c.audio is not None]
            assert audio and {c.sample_rate for c in audio} == {24000} and {c.modality for c in audio} == {"audio"}
            pcm = np.frombuffer(b"".join(c.audio for c in audio), dtype="<i2")
            # 2048 samples for every whole frame but the first: one per full window, the rest in the last one
            assert len(pcm) == (audio_tokens // 7 - 1) * SPF
            assert all(len(c.audio) == 2 * SPF for c in audio[:-1])
            assert np.abs(pcm).max() > 0
            assert chunks[-1].finished and chunks[-1].finish_reason == "length" and chunks[-1].error is None
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_short_walk_beside_a_running_speech_group_finishes_within_a_few_steps() -> None:
    """Two groups of one component (the speak and generate walks' decode
    loops): a group left with no row has its last launched step read at
    once, not at the next settle, which only a new request's prefill brings."""
    eng = Engine(EngineConfig(model="orpheus-tiny"))
    await eng.start()
    steps: list[tuple[str, str]] = []
    eng.add_report_hook(lambda r: steps.append((r.component, r.mode)) if r.rows > 0 and r.component else None)

    async def speak(rid: str) -> None:
        request = GenerateRequest(rid, eng.model_name, {"text": "a long answer", "voice": "tara"},
                                  SamplingParams(max_tokens=600, ignore_eos=True))
        async for _ in eng.submit(request):
            pass

    try:
        background = [asyncio.ensure_future(speak(f"bg{i}")) for i in range(2)]
        while steps.count(("llm", "decode")) < 5:
            await asyncio.sleep(0.001)
        start = len(steps)
        short = GenerateRequest("short", eng.model_name, {"prompt_ids": [5, 6, 7]},
                                SamplingParams(max_tokens=2, ignore_eos=True), walk="generate")
        tokens = [t async for chunk in eng.submit(short) for t in chunk.token_ids]
        assert len(tokens) == 2
        assert steps[start:].count(("llm", "decode")) <= 6  # its own step and the speech group's few beside
        assert not any(t.done() for t in background)
        for rid in ("bg0", "bg1"):
            eng.abort(rid)
        await asyncio.gather(*background)
    finally:
        await eng.shutdown()
