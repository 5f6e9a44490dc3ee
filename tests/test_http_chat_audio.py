"""Chat answers spoken as well as written: the official `openai` client
against qwen3-omni-tiny (its code2wav made loud enough for PCM16 to hold
what it says) with `modalities: ["text", "audio"]`. The whole
answer's WAV (and FLAC, MP3, Opus) decodes to the engine's own samples for
the same seeded request, as long as the talker's frames make it, its
transcript the engine's text; streamed, the pcm16 pieces and transcript
pieces join to the same answer under one audio id, ending with the expiry
update; an `input_audio` part in, a spoken answer out; n samples each speak;
usage tells the talker's tokens from the text's; every misuse is a 400
naming its field, and a text model refuses a spoken answer naming
`modalities`."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile as sf
from http_support import MODEL as TEXT_MODEL
from http_support import running_engine, serving
from test_http_chat_media import asking, audio_part, clip, encoded

from mstar.engine.engine import Engine
from mstar.models import media
from mstar.types import GenerateRequest, SamplingParams

on_module_loop = pytest.mark.asyncio(loop_scope="module")

OMNI = "qwen3-omni-tiny"
RATE = 24_000
TOKENS = 4           # the thinker's text
TALKER_TOKENS = 6    # the talker's draws; without its codec EOS it draws them all
FRAMES = TALKER_TOKENS - 1  # the last draw starts a frame the budget never lets it finish
SAMPLES = 1920 * FRAMES - 555  # code2wav: 1920 samples a frame, less what the first holds back
SEED = 7
# greedy: random weights' codes are near a tie, so drawn ones would follow the seed rather than the voice
TALKER = {"max_tokens": TALKER_TOKENS, "ignore_eos": True, "temperature": 0}
GREEDY_TALK = {"talker": TALKER, "cp": {"temperature": 0}}
SPOKEN: dict[str, Any] = {"modalities": ["text", "audio"], "max_tokens": TOKENS, "temperature": 0, "seed": SEED,
                          "extra_body": {"ignore_eos": True, "sampling_by": GREEDY_TALK}}
HELLO = [{"role": "user", "content": "Say hello."}]
@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni() -> AsyncIterator[Engine]:
    async with running_engine(OMNI, 512) as engine:
        yield engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(omni: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving(omni) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        yield api
        await api.close()


async def refused(call: Awaitable[Any]) -> dict[str, Any]:
    """The 400 error body `call` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    body = caught.value.body
    assert caught.value.status_code == 400 and isinstance(body, dict)
    return body


async def in_process(engine: Engine, messages: list[dict[str, Any]], voice: str = "ethan") -> tuple[str, np.ndarray]:
    """What the engine speaks for `messages` (media decoded) under SPOKEN's sampling: its text and samples."""
    request = GenerateRequest("in-process", OMNI, {"messages": messages, "voice": voice},
                              SamplingParams(max_tokens=TOKENS, temperature=0, seed=SEED, ignore_eos=True),
                              walk="speak", sampling_by=GREEDY_TALK)
    chunks = [c async for c in engine.submit(request, await engine.prepare(request))]
    pcm = b"".join(c.audio for c in chunks if c.audio)
    return "".join(c.text for c in chunks), np.frombuffer(pcm, dtype="<i2")


def decoded(data: str) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(base64.b64decode(data)), dtype="int16")
    assert rate == RATE
    return samples


# ------------------------------------------------------------------ answers

@on_module_loop
async def test_a_spoken_answer_is_the_engines_audio_as_a_wav(client: openai.AsyncOpenAI, omni: Engine) -> None:
    answer = await client.chat.completions.create(model=OMNI, messages=HELLO, audio={"voice": "ethan",
                                                                                     "format": "wav"}, **SPOKEN)
    [choice] = answer.choices
    message = choice.message
    assert message.content is None and message.audio is not None
    # kept for later turns an hour, as OpenAI keeps it (`transcripts.py`)
    assert message.audio.id.startswith("audio_") and message.audio.expires_at == answer.created + 3600
    samples = decoded(message.audio.data)
    text, want = await in_process(omni, HELLO)
    assert len(samples) == SAMPLES and np.array_equal(samples, want) and np.abs(samples).max() > 0
    assert message.audio.transcript == text
    usage = answer.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.text_tokens == TOKENS
    assert usage.completion_tokens_details.audio_tokens == TALKER_TOKENS
    assert usage.completion_tokens == TOKENS + TALKER_TOKENS


@on_module_loop
async def test_another_voice_speaks_otherwise(client: openai.AsyncOpenAI, omni: Engine) -> None:
    answer = await client.chat.completions.create(model=OMNI, messages=HELLO, audio={"voice": {"id": "Chelsie"},
                                                                                     "format": "wav"}, **SPOKEN)
    assert answer.choices[0].message.audio is not None
    samples = decoded(answer.choices[0].message.audio.data)
    _, chelsie = await in_process(omni, HELLO, voice="chelsie")
    _, ethan = await in_process(omni, HELLO)
    assert np.array_equal(samples, chelsie) and not np.array_equal(samples, ethan)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus", "pcm16"])
@on_module_loop
async def test_every_format_holds_the_same_audio(client: openai.AsyncOpenAI, omni: Engine, fmt: str) -> None:
    answer = await client.chat.completions.create(model=OMNI, messages=HELLO, audio={"voice": "ethan",
                                                                                     "format": fmt}, **SPOKEN)
    assert answer.choices[0].message.audio is not None
    data = answer.choices[0].message.audio.data
    _, want = await in_process(omni, HELLO)
    if fmt == "pcm16":
        assert np.array_equal(np.frombuffer(base64.b64decode(data), dtype="<i2"), want)
    elif fmt == "flac":  # lossless
        assert np.array_equal(decoded(data), want)
    else:  # lossy: as long, but for the codec's delay and padding
        assert SAMPLES <= len(decoded(data)) <= SAMPLES + 3000


@on_module_loop
async def test_a_stream_sends_the_same_answer_in_pieces(client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(model=OMNI, messages=HELLO, audio={"voice": "ethan",
                                                                                    "format": "pcm16"}, **SPOKEN)
    stream = await client.chat.completions.create(model=OMNI, messages=HELLO, audio={"voice": "ethan",
                                                                                     "format": "pcm16"},
                                                  stream=True, stream_options={"include_usage": True}, **SPOKEN)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    deltas = [c.choices[0] for c in chunks if c.choices]
    pieces = [d.delta.audio for d in deltas if d.delta.audio is not None]
    *spoken, last = pieces
    assert len(spoken) >= FRAMES  # the audio went out as it was made, a frame a chunk
    assert len({p.id for p in pieces}) == 1 and pieces[0].id.startswith("audio_")  # one audio, all its pieces
    assert last.expires_at == chunks[0].created + 3600 and last.data is None and last.transcript is None
    assert all(p.expires_at is None for p in spoken)
    pcm = b"".join(base64.b64decode(p.data) for p in spoken if p.data)
    assert pcm == base64.b64decode(whole.choices[0].message.audio.data)
    assert "".join(p.transcript or "" for p in spoken) == whole.choices[0].message.audio.transcript
    assert all(d.delta.content is None for d in deltas)  # the text rides in the transcript only
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason and deltas[-1].delta.audio is None
    assert chunks[-1].usage == whole.usage


@on_module_loop
async def test_heard_and_answered_aloud(client: openai.AsyncOpenAI, omni: Engine) -> None:
    data = encoded(clip(1.0, seed=2), "wav")
    messages = asking(audio_part(data))
    answer = await client.chat.completions.create(model=OMNI, messages=messages, audio={"voice": "aiden",
                                                                                        "format": "wav"}, **SPOKEN)
    audio = answer.choices[0].message.audio
    assert audio is not None
    heard = asking({"type": "audio", "audio": media.audio_from_base64(data, "x", max_seconds=10)})
    text, want = await in_process(omni, heard, voice="aiden")
    assert np.array_equal(decoded(audio.data), want) and len(want) == SAMPLES and audio.transcript == text
    _, unheard = await in_process(omni, asking(), voice="aiden")
    assert not np.array_equal(want, unheard)  # what it hears moves what it says
    silent = await client.chat.completions.create(model=OMNI, messages=asking(), audio={"voice": "aiden",
                                                                                        "format": "wav"}, **SPOKEN)
    assert answer.usage is not None and silent.usage is not None
    assert answer.usage.prompt_tokens > silent.usage.prompt_tokens + 10  # 1 s: ~13 audio tokens


@on_module_loop
async def test_max_tokens_caps_the_spoken_frames_too(client: openai.AsyncOpenAI) -> None:
    """OpenAI counts a spoken answer's audio tokens among its completion
    tokens: `max_tokens` alone (no `sampling_by`) caps the talker's draws as
    well as the text, where they would run to the talker's own default of
    thousands; a `sampling_by` entry for the talker still wins."""
    body = {"ignore_eos": True, "sampling_by": {"talker": {"ignore_eos": True}}}
    capped = await client.chat.completions.create(model=OMNI, messages=HELLO, modalities=["text", "audio"],
                                                  audio={"voice": "ethan", "format": "pcm16"}, max_tokens=3,
                                                  seed=SEED, extra_body=body)
    usage = capped.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert (usage.completion_tokens_details.text_tokens, usage.completion_tokens_details.audio_tokens) == (3, 3)
    body["sampling_by"]["talker"]["max_tokens"] = 5
    own = await client.chat.completions.create(model=OMNI, messages=HELLO, modalities=["text", "audio"],
                                               audio={"voice": "ethan", "format": "pcm16"}, max_tokens=3,
                                               seed=SEED, extra_body=body)
    assert own.usage is not None and own.usage.completion_tokens_details is not None
    assert own.usage.completion_tokens_details.audio_tokens == 5


@on_module_loop
async def test_an_answer_whose_frames_ran_out_ends_length(client: openai.AsyncOpenAI, omni: Engine) -> None:
    """Its text stopped on its own (a stop id), its frames at max_tokens: the
    answer was cut short, so it ends "length", as OpenAI's does at its budget
    (the text alone would say "stop")."""
    chat = GenerateRequest("ids", OMNI, {"messages": HELLO}, SamplingParams(max_tokens=4, temperature=0, seed=SEED,
                                                                            ignore_eos=True), walk="chat")
    ids = [t for c in [c async for c in omni.submit(chat, await omni.prepare(chat))] for t in c.token_ids]
    text = {"ignore_eos": True, "stop_token_ids": [ids[1]]}
    talker = {"sampling_by": {"talker": {"ignore_eos": True, "temperature": 0}}}
    for audio, reason in ((None, "stop"), ({"voice": "ethan", "format": "pcm16"}, "length")):
        spoken: dict[str, Any] = {"modalities": ["text", "audio"], "audio": audio} if audio else {}
        answer = await client.chat.completions.create(model=OMNI, messages=HELLO, temperature=0, seed=SEED,
                                                      max_tokens=8, extra_body={**text, **(talker if audio else {})},
                                                      **spoken)
        assert answer.choices[0].finish_reason == reason, audio
    usage = answer.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert (usage.completion_tokens_details.text_tokens, usage.completion_tokens_details.audio_tokens) == (2, 8)


@on_module_loop
async def test_a_stop_string_in_the_text_leaves_every_frame_counted(client: openai.AsyncOpenAI) -> None:
    """A stop string ends the text, not the talker's frames: usage counts the
    text up to the stop and every frame the answer holds (the stopped text's
    row, taken out of its decode group, had not handed its count back)."""
    body = {**SPOKEN, "max_tokens": 8}
    full = await client.chat.completions.create(model=OMNI, messages=HELLO, logprobs=True, max_tokens=8,
                                                temperature=0, seed=SEED, extra_body={"ignore_eos": True})
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content is not None
    pieces = [t.token for t in full.choices[0].logprobs.content]
    stop = "".join(pieces[2:5])
    at = next(i for i in range(len(pieces)) if stop in "".join(pieces[:i + 1]))  # the token that brings it
    assert at < len(pieces) - 1
    for stream in (False, True):
        answer = await client.chat.completions.create(
            model=OMNI, messages=HELLO, audio={"voice": "ethan", "format": "pcm16"}, stop=[stop],
            stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}), **body)
        if stream:
            chunks = [c async for c in answer]
            pcm = b"".join(base64.b64decode(c.choices[0].delta.audio.data) for c in chunks
                           if c.choices and c.choices[0].delta.audio and c.choices[0].delta.audio.data)
            usage = chunks[-1].usage
        else:  # the frames ran to their max_tokens: cut short, as when a stop id ends the text
            assert answer.choices[0].message.audio is not None and answer.choices[0].finish_reason == "length"
            pcm, usage = base64.b64decode(answer.choices[0].message.audio.data), answer.usage
        assert usage is not None and usage.completion_tokens_details is not None
        details = usage.completion_tokens_details
        assert details.text_tokens == at + 1, stream
        assert details.audio_tokens == TALKER_TOKENS and len(pcm) // 2 == SAMPLES, stream
        assert usage.completion_tokens == at + 1 + TALKER_TOKENS


@on_module_loop
async def test_frames_cut_after_a_stop_string_end_length(client: openai.AsyncOpenAI) -> None:
    """A stop string ends the text as a stop id does; frames that then run
    out at their max_tokens still cut the answer short: "length", streamed
    or not (a stop string used to win, so the cut audio said "stop")."""
    full = await client.chat.completions.create(model=OMNI, messages=HELLO, max_tokens=8, temperature=0, seed=SEED,
                                                extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert text is not None and len(text) > 3
    talker = {"sampling_by": {"talker": {"max_tokens": 2, "stop_token_ids": [], "temperature": 0}}}
    for stream in (False, True):
        answer = await client.chat.completions.create(
            model=OMNI, messages=HELLO, audio={"voice": "ethan", "format": "pcm16"}, modalities=["text", "audio"],
            stop=[text[2:4]], max_tokens=8, temperature=0, seed=SEED, stream=stream,
            extra_body={"ignore_eos": True, **talker})
        if stream:
            reasons = [c.choices[0].finish_reason async for c in answer if c.choices and c.choices[0].finish_reason]
        else:
            reasons = [answer.choices[0].finish_reason]
        assert reasons == ["length"], stream


@on_module_loop
async def test_each_of_n_samples_speaks(client: openai.AsyncOpenAI) -> None:
    drawn = {**SPOKEN, "extra_body": {"ignore_eos": True, "sampling_by": {"talker": {**TALKER, "temperature": 1}}}}
    answer = await client.chat.completions.create(model=OMNI, messages=HELLO, n=2, audio={"voice": "ethan",
                                                                                          "format": "wav"}, **drawn)
    audios = [c.message.audio for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1] and all(a is not None for a in audios)
    first, second = (decoded(a.data) for a in audios)  # type: ignore[union-attr]
    assert len(first) == len(second) == SAMPLES and not np.array_equal(first, second)  # seeds 7 and 8
    assert audios[0].id != audios[1].id  # type: ignore[union-attr]
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.audio_tokens == 2 * TALKER_TOKENS


# ------------------------------------------------------------------ refusals

WAV = {"voice": "ethan", "format": "wav"}


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"modalities": ["text", "audio"]}, "audio", "required"),
    ({"audio": WAV}, "modalities", "'audio'"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan"}}, "audio.format", "required"),
    ({"modalities": ["text", "audio"], "audio": {"format": "wav"}}, "audio.voice", "required"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "aac"}}, "audio.format", "AAC"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "ogg"}}, "audio.format", "pcm16"),
    ({"modalities": ["text", "audio"], "audio": {**WAV, "speed": 2}}, "audio.speed", "unknown"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice",
     "aiden, chelsie, ethan"),
    ({"modalities": ["text", "audio"], "audio": WAV, "stream": True}, "audio.format", "pcm16"),
    ({"modalities": ["text", "audio"], "audio": WAV, "logprobs": True}, "logprobs", "spoken"),
    ({"modalities": ["text", "text"]}, "modalities", "text"),
    ({"modalities": ["audio", "video"], "audio": WAV}, "modalities", "video"),
    ({"modalities": ["audio"], "audio": WAV}, "modalities", "[\"text\", \"audio\"]"),  # never audio alone
    ({"modalities": []}, "modalities", "[\"text\"]"),
    ({"messages": [*HELLO, {"role": "tool", "content": "42"}]}, "messages[1].role", "developer"),
    # 10 samples at 24 kHz: the message gives its length in time, whatever rate it came at
    ({"messages": asking(audio_part(encoded(clip(10 / 24000, 24000), "wav", 24000)))},
     "messages[0].content[1].input_audio.data",
     "audio is 0.438 ms long (7 samples at 16 kHz); at least 12.6 ms (201 samples) are needed"),
    ({"modalities": ["text", "audio"], "audio": WAV,
      "messages": [*HELLO, {"role": "assistant", "audio": {"id": "audio_1"}}, *HELLO]}, "messages[1].audio.id",
     "transcript"),
    ({"messages": [*HELLO, {"role": "assistant", "audio": {"id": "audio_1", "data": "x"}}, *HELLO]},
     "messages[1].audio.data", "unknown"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "audio_1"}}]}, "messages[0].audio",
     "assistant"),
])
@on_module_loop
async def test_misuse_is_a_400_naming_the_field(client: openai.AsyncOpenAI, omni: Engine, fields: dict[str, Any],
                                                param: str, says: str) -> None:
    error = await refused(client.chat.completions.create(model=OMNI, **{"messages": HELLO, "max_tokens": 2,
                                                                        **fields}))
    assert error["param"] == param and says in error["message"], error
    assert omni.num_running() == 0


@on_module_loop
async def test_a_later_turn_names_an_earlier_spoken_answer_by_its_audio_id(client: openai.AsyncOpenAI,
                                                                         omni: Engine) -> None:
    """OpenAI's multi-turn audio: the assistant's earlier answer comes back as
    `{"audio": {"id": ...}}`, and the model reads its transcript there, as if
    the client had sent the transcript as the message's content."""
    for stream in (False, True):
        if stream:
            pieces = [c async for c in await client.chat.completions.create(
                model=OMNI, messages=HELLO, audio={"voice": "ethan", "format": "pcm16"}, stream=True, **SPOKEN)]
            deltas = [c.choices[0].delta.model_dump().get("audio") for c in pieces if c.choices]
            audio_id = next(d["id"] for d in deltas if d)
            transcript = "".join(d.get("transcript") or "" for d in deltas if d)
        else:
            first = await client.chat.completions.create(model=OMNI, messages=HELLO,
                                                         audio={"voice": "ethan", "format": "wav"}, **SPOKEN)
            audio_id, transcript = first.choices[0].message.audio.id, first.choices[0].message.audio.transcript
        later = [{"role": "user", "content": "And again?"}]
        named = await client.chat.completions.create(
            model=OMNI, messages=[*HELLO, {"role": "assistant", "audio": {"id": audio_id}}, *later],
            max_tokens=3, temperature=0)
        written = await client.chat.completions.create(
            model=OMNI, messages=[*HELLO, {"role": "assistant", "content": transcript}, *later],
            max_tokens=3, temperature=0)
        assert named.usage.prompt_tokens == written.usage.prompt_tokens
        assert named.choices[0].message.content == written.choices[0].message.content
    assert omni.num_running() == 0


@on_module_loop
async def test_a_text_model_refuses_a_spoken_answer(engine: Engine) -> None:
    async with serving(engine) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        spoken: dict[str, Any] = {"modalities": ["text", "audio"], "audio": WAV}
        error = await refused(api.chat.completions.create(model=TEXT_MODEL, messages=HELLO, max_tokens=2, **spoken))
        assert error["param"] == "modalities" and "text only" in error["message"], error
        text = await api.chat.completions.create(model=TEXT_MODEL, messages=HELLO, max_tokens=2, modalities=["text"])
        assert text.choices[0].message.content is not None and text.choices[0].message.audio is None
        await api.close()
