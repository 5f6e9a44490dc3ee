"""`/v1/realtime` with audio in, against qwen3-omni-tiny, with the official
`openai` client: a clip of tone bursts between silences appended in 100 ms
chunks with server VAD on gives speech_started / speech_stopped at the
bursts' edges, a committed user item and a response of transcript and
audio deltas; with VAD off an explicit commit and response.create; new
speech during a response cancels it and a new one follows; clear empties
the buffer; bad base64, an unknown turn detection type, transcription and
an over-long buffer are errors naming their field."""

from __future__ import annotations

import base64
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from http_support import running_engine, serving, serving_app
from openai import AsyncOpenAI

from mstar.client import AsyncClient, MstarError
from mstar.config import MediaLimits, ServerConfig
from mstar.http.server import build_app
from mstar.engine.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

OMNI = "qwen3-omni-tiny"
RATE = 24_000
CHUNK_MS = 100
SHORT = {"type": "realtime", "max_output_tokens": 4, "mstar": {"seed": 7}}
NO_VAD = {**SHORT, "audio": {"input": {"turn_detection": None}}}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni() -> AsyncIterator[tuple[Engine, str]]:
    async with running_engine(OMNI) as engine, serving(engine) as url:
        yield engine, url


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")


def silence(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, dtype=np.float32)


def burst(ms: int, level: float = 0.3) -> np.ndarray:
    """A voiced-like tone (150 Hz and its harmonics) at about -13 dBFS."""
    t = np.arange(RATE * ms // 1000) / RATE
    wave = sum(np.sin(2 * np.pi * 150 * k * t) / k for k in (1, 2, 3))
    return (level * wave / np.abs(wave).max()).astype(np.float32)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes()


def chunks(x: np.ndarray) -> list[str]:
    data = pcm16(x)
    step = 2 * RATE * CHUNK_MS // 1000
    return [base64.b64encode(data[i:i + step]).decode() for i in range(0, len(data), step)]


async def _send(conn, x: np.ndarray) -> None:
    for piece in chunks(x):
        await conn.input_audio_buffer.append(audio=piece)


async def _until(conn, kind: str, seen: list[Any]) -> Any:
    async for ev in conn:
        seen.append(ev)
        if ev.type == "error" and kind != "error":
            raise AssertionError(f"error before {kind}: {ev.error}")
        if ev.type == kind:
            return ev
    raise AssertionError(f"the socket closed before {kind}")


def _audio(events: list[Any]) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


async def test_server_vad_commits_a_turn_and_answers_it(omni) -> None:
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        created = await conn.recv()
        assert created.session.audio.input.turn_detection.type == "server_vad"  # on by default
        assert created.session.audio.output.voice == "ethan"  # the model's default, as chat and speech speak
        await conn.session.update(session=SHORT)
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        await _send(conn, np.concatenate([silence(500), burst(500), silence(800)]))
        started = await _until(conn, "input_audio_buffer.speech_started", seen)
        stopped = await _until(conn, "input_audio_buffer.speech_stopped", seen)
        committed = await _until(conn, "input_audio_buffer.committed", seen)
        done = await _until(conn, "response.done", seen)
    assert 150 <= started.audio_start_ms <= 250  # the burst at 500 ms less 300 ms of padding
    assert 980 <= stopped.audio_end_ms <= 1040  # the burst's end
    assert committed.item_id == started.item_id == stopped.item_id
    kinds = [e.type for e in seen]
    added = next(e for e in seen if e.type == "conversation.item.added" and e.item.id == committed.item_id)
    assert added.item.role == "user" and added.item.content[0].type == "input_audio"
    assert kinds.index("input_audio_buffer.committed") < kinds.index("conversation.item.done") \
        < kinds.index("response.created")
    assert done.response.status in ("completed", "incomplete")
    audio = _audio(seen)
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert np.frombuffer(audio, dtype=np.int16).size == len(audio) // 2
    # the tiny model's random tokens mostly lie past its tokenizer's vocabulary: their text may be empty
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert done.response.output[0].content[0].transcript == transcript
    assert done.response.usage.input_tokens > 0 and done.response.usage.output_tokens > 0
    details = done.response.usage.output_token_details  # the text's tokens and the talker's frames, told apart
    assert details is not None and details.text_tokens > 0 and details.audio_tokens > 0
    assert details.text_tokens + details.audio_tokens == done.response.usage.output_tokens
    assert details.text_tokens <= SHORT["max_output_tokens"]  # the limit is on the text; the frames follow it


async def test_explicit_commit_without_vad(omni) -> None:
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session=NO_VAD)
        seen: list[Any] = []
        updated = await _until(conn, "session.updated", seen)
        assert updated.session.audio.input.turn_detection is None
        await _send(conn, np.concatenate([burst(300), silence(900)]))
        await conn.input_audio_buffer.commit()
        committed = await _until(conn, "input_audio_buffer.committed", seen)
        await conn.response.create()
        done = await _until(conn, "response.done", seen)
    assert not any(e.type.startswith("input_audio_buffer.speech") for e in seen)  # no VAD: the silence ends nothing
    assert committed.item_id and done.response.status in ("completed", "incomplete")
    assert len(_audio(seen)) > 0
    # every item, the committed turn's and the answer's as a client's, is added, created and done, in that order
    for item_id in (committed.item_id, done.response.output[0].id):
        kinds = [e.type for e in seen if e.type.startswith("conversation.item.") and e.item.id == item_id]
        assert kinds == ["conversation.item.added", "conversation.item.created", "conversation.item.done"], kinds


async def test_a_text_only_session_answers_heard_audio_in_text(omni) -> None:
    """`output_modalities: ["text"]`: the model hears the committed audio and
    answers as a chat completion without audio out does, in text deltas; a
    response may ask for audio again, and a speech-only model refuses text."""
    engine, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session={**NO_VAD, "output_modalities": ["text"]})
        seen: list[Any] = []
        updated = await _until(conn, "session.updated", seen)
        assert updated.session.output_modalities == ["text"]
        await _send(conn, np.concatenate([burst(300), silence(300)]))
        await conn.input_audio_buffer.commit()
        await _until(conn, "input_audio_buffer.committed", seen)
        await conn.response.create()
        done = await _until(conn, "response.done", seen)
        assert done.response.output_modalities == ["text"]
        deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
        text = next(e.text for e in seen if e.type == "response.output_text.done")
        assert deltas and "".join(deltas) == text and not _audio(seen)
        assert done.response.usage.output_tokens == SHORT["max_output_tokens"]  # the session's limit, on the text
        seen.clear()
        await conn.response.create(response={"output_modalities": ["audio"]})  # this response speaks
        done = await _until(conn, "response.done", seen)
        assert done.response.output_modalities == ["audio"] and len(_audio(seen)) > 0
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text", "audio"]})
        error = await _until(conn, "error", seen)
        assert error.error.param == "session.output_modalities"


async def test_speech_during_a_response_cancels_it(omni) -> None:
    engine, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session={**SHORT, "max_output_tokens": 400})
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        await _send(conn, np.concatenate([burst(300), silence(600)]))
        first = await _until(conn, "response.created", seen)
        await _until(conn, "response.output_audio.delta", seen)
        await conn.session.update(session=SHORT)  # what follows is short
        await _send(conn, burst(300))
        cut = await _until(conn, "response.done", seen)
        assert cut.response.id == first.response.id and cut.response.status == "cancelled"
        assert cut.response.status_details.reason == "turn_detected"  # GA's: a barge-in, not the client's cancel
        await _send(conn, silence(600))
        second = await _until(conn, "response.created", seen)
        done = await _until(conn, "response.done", seen)
    assert second.response.id != first.response.id and done.response.id == second.response.id
    assert done.response.status in ("completed", "incomplete")
    kinds = [e.type for e in seen]
    assert kinds.count("input_audio_buffer.speech_started") == 2
    # the barge-in's speech_started came before the cancelled response ended
    barge_in = [i for i, k in enumerate(kinds) if k == "input_audio_buffer.speech_started"][1]
    assert barge_in < kinds.index("response.done")


async def test_clear_empties_the_buffer(omni) -> None:
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session=NO_VAD)
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        await _send(conn, burst(300))
        await conn.input_audio_buffer.clear()
        await _until(conn, "input_audio_buffer.cleared", seen)
        await conn.input_audio_buffer.commit()
        err = await _until(conn, "error", seen)
    assert err.error.code == "input_audio_buffer_commit_empty"


async def _speech_started(conn, session: dict[str, Any], seen: list[Any]) -> Any:
    """`session` set, then half a second of speech: the speech_started event."""
    await conn.session.update(session=session)
    await _until(conn, "session.updated", seen)
    await _send(conn, burst(500))
    return await _until(conn, "input_audio_buffer.speech_started", seen)


async def test_clear_mid_speech_forgets_the_turn_it_announced(omni) -> None:
    """With server VAD, speech started, then the buffer cleared: its silence
    after stops nothing (the announced item would never be committed), and
    the next speech is a new turn, committed and answered."""
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        seen: list[Any] = []
        first = await _speech_started(conn, SHORT, seen)
        await conn.input_audio_buffer.clear()
        await _until(conn, "input_audio_buffer.cleared", seen)
        await _send(conn, np.concatenate([silence(900), burst(300), silence(900)]))
        committed = await _until(conn, "input_audio_buffer.committed", seen)
        await _until(conn, "response.done", seen)
    stops = [e for e in seen if e.type == "input_audio_buffer.speech_stopped"]
    assert [e.item_id for e in stops] == [committed.item_id] != [first.item_id]


async def test_a_turn_too_short_to_commit_is_said_to_be(omni) -> None:
    """Server VAD heard 50 ms of speech, under a commit's 100 ms: its item is
    never committed, and an error says so rather than leaving a client
    waiting on the item speech_stopped named."""
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session=SHORT)
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        await _send(conn, np.concatenate([burst(50), silence(1500)]))
        stopped = await _until(conn, "input_audio_buffer.speech_stopped", seen)
        err = await _until(conn, "error", seen)
    assert err.error.code == "input_audio_buffer_commit_empty" and stopped.item_id in err.error.message
    assert not any(e.type == "input_audio_buffer.committed" for e in seen)


async def test_turning_vad_off_mid_speech_ends_the_announced_turn(omni) -> None:
    """Speech started, then turn detection turned off: the announced item is
    stopped and committed (a client waiting on it is answered), and with no
    detection no response starts by itself."""
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        seen: list[Any] = []
        started = await _speech_started(conn, SHORT, seen)
        await conn.session.update(session=NO_VAD)
        stopped = await _until(conn, "input_audio_buffer.speech_stopped", seen)
        committed = await _until(conn, "input_audio_buffer.committed", seen)
        await _until(conn, "conversation.item.done", seen)
        await conn.response.create()
        await _until(conn, "response.done", seen)
    assert started.item_id == stopped.item_id == committed.item_id
    assert [e.type for e in seen].count("response.created") == 1  # the one asked for


async def test_a_commit_mid_speech_commits_the_announced_turn(omni) -> None:
    """With server VAD, a client's commit during speech ends the turn VAD
    announced: that item is committed once, and the silence after stops
    nothing more."""
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        seen: list[Any] = []
        started = await _speech_started(conn, {**SHORT, "audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False}}}}, seen)
        await conn.input_audio_buffer.commit()
        committed = await _until(conn, "input_audio_buffer.committed", seen)
        await _send(conn, silence(1500))
        await conn.conversation.item.retrieve(item_id=committed.item_id)
        await _until(conn, "conversation.item.retrieved", seen)
    assert committed.item_id == started.item_id
    assert [e.item_id for e in seen if e.type == "input_audio_buffer.speech_stopped"] == [started.item_id]
    assert [e.type for e in seen].count("input_audio_buffer.committed") == 1
    assert not [e for e in seen if e.type == "error"]


@pytest.mark.parametrize(("event", "param", "code"), [
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "audio", "invalid_base64"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad"}}}}}, "session.audio.input.turn_detection.type",
     "unsupported_turn_detection"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "threshold": 2}}}}}, "session.audio.input.turn_detection.threshold",
     "invalid_value"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "transcription": {"model": "whisper-1"}}}}}, "session.audio.input.transcription", "unsupported_transcription"),
])
async def test_bad_events_name_their_field(omni, event: dict[str, Any], param: str, code: str) -> None:
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.recv()
        await conn.send(event)
        seen: list[Any] = []
        err = await _until(conn, "error", seen)
        assert (err.error.param, err.error.code) == (param, code)
        # the session goes on, its turn detection as it was
        await conn.session.update(session={"type": "realtime"})
        updated = await _until(conn, "session.updated", seen)
        assert updated.session.audio.input.turn_detection.type == "server_vad"


async def test_sdk_streams_a_wav_file_and_hears_the_answer(omni, tmp_path: Path) -> None:
    _, url = omni
    clip = np.concatenate([silence(400), burst(400), silence(700)])
    # 16 kHz stereo: the SDK mixes and resamples to what the session takes
    at16k = np.interp(np.arange(clip.size * 2 // 3) * 1.5, np.arange(clip.size), clip)
    path = tmp_path / "turn.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(pcm16(np.repeat(at16k[:, None], 2, axis=1).reshape(-1)))
    async with AsyncClient(url) as client, await client.realtime(OMNI, max_output_tokens=4, seed=7) as rt:
        assert rt.session["mstar"]["audio_input"] is True
        sent = await rt.stream_audio(path, speed=0)
        assert abs(sent - 1500) <= 10
        started = await rt.until("input_audio_buffer.speech_started")
        stopped = await rt.until("input_audio_buffer.speech_stopped")
        assert 60 <= started["audio_start_ms"] <= 140 and 780 <= stopped["audio_end_ms"] <= 840
        reply = await rt.reply()
        assert reply.status in ("completed", "incomplete") and len(reply.audio) > 0
        # VAD off: the SDK commits itself; an empty buffer's commit is refused
        await rt.update(turn_detection=None)
        await rt.append_audio(pcm16(burst(200)))
        await rt.clear_audio()
        await rt.commit_audio()
        with pytest.raises(MstarError) as e:
            await rt.until("input_audio_buffer.committed")
        assert e.value.code == "input_audio_buffer_commit_empty"
        await rt.append_audio(pcm16(burst(200)))
        await rt.commit_audio()
        assert (await rt.until("input_audio_buffer.committed"))["item_id"]


async def test_the_buffer_limit_is_the_servers_max_audio_seconds(omni) -> None:
    engine, _ = omni
    config = ServerConfig(media_limits=MediaLimits(max_audio_seconds=1.0))
    async with serving_app(build_app(engine, manage_engine=False, config=config), shutdown_timeout=1.0) as url:
        async with _client(url).realtime.connect(model=OMNI) as conn:
            await conn.session.update(session=NO_VAD)
            seen: list[Any] = []
            await _until(conn, "session.updated", seen)
            await _send(conn, burst(1100))  # the eleventh 100 ms chunk is one too many
            err = await _until(conn, "error", seen)
            assert (err.error.param, err.error.code) == ("audio", "input_audio_buffer_full")
            await conn.input_audio_buffer.commit()  # what fitted is still there
            committed = await _until(conn, "input_audio_buffer.committed", seen)
            assert committed.item_id


async def test_an_audio_item_is_heard_and_the_conversation_carries_on(omni) -> None:
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session={**NO_VAD, "instructions": "Be brief."})
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        clip = base64.b64encode(pcm16(burst(300))).decode()
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": clip}, {"type": "input_text", "text": "What is this?"}]})
        added = await _until(conn, "conversation.item.added", seen)
        assert "audio" not in added.item.content[0].model_dump(exclude_none=True)  # kept, not echoed
        # shaped as a committed turn's part: its transcript there, null (no transcription runs)
        assert "transcript" in added.item.content[0].model_fields_set and added.item.content[0].transcript is None
        await conn.response.create()
        first = await _until(conn, "response.done", seen)
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "And again?"}]})
        await conn.response.create()
        second = await _until(conn, "response.done", seen)
    # the second request's prompt holds the first turn, its answer and the new text
    assert second.response.usage.input_tokens > first.response.usage.input_tokens
    assert len(_audio(seen)) > 0



async def test_an_audio_item_too_short_to_hear_is_refused_where_it_is_sent(omni) -> None:
    """As a commit under 100 ms is: refused at conversation.item.create, naming
    the part, not taken and then failing every later response."""
    _, url = omni
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session=NO_VAD)
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        for pcm in (b"", pcm16(burst(10)), pcm16(burst(99))):
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hi"}, {"type": "input_audio", "audio": base64.b64encode(pcm).decode()}]})
            err = await _until(conn, "error", seen)
            assert (err.error.param, err.error.code) == ("item.content[1].audio", "audio_too_short"), err
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": base64.b64encode(pcm16(burst(100))).decode()}]})
        await conn.response.create()
        done = await _until(conn, "response.done", seen)
        assert done.response.status in ("completed", "incomplete")


async def _answer_then_ask(url: str, truncate_at: float | None) -> tuple[str, str, int]:
    """A spoken answer (truncated at `truncate_at` of its audio, if given),
    then a text question: the answer's transcript as spoken, as the
    conversation keeps it, and the question's input tokens."""
    async with _client(url).realtime.connect(model=OMNI) as conn:
        await conn.session.update(session={**NO_VAD, "max_output_tokens": 12})
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me about lighthouses."}]})
        await conn.response.create()
        done = await _until(conn, "response.done", seen)
        item = done.response.output[0]
        spoken = item.content[0].transcript
        sent_ms = len(_audio(seen)) // 2 * 1000 // RATE
        if truncate_at is not None:
            await conn.conversation.item.truncate(item_id=item.id, content_index=0,
                                                  audio_end_ms=int(sent_ms * truncate_at))
            await _until(conn, "conversation.item.truncated", seen)
            if truncate_at < 1:  # a later truncation stays before the earlier one
                await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=sent_ms)
                err = await _until(conn, "error", seen)
                assert "past where this item was truncated before" in err.error.message
        await conn.conversation.item.retrieve(item_id=item.id)
        kept = (await _until(conn, "conversation.item.retrieved", seen)).item.content[0].transcript
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "And?"}]})
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 1})
        asked = await _until(conn, "response.done", seen)
        return spoken, kept or "", asked.response.usage.input_tokens


async def test_a_truncated_answer_keeps_only_what_was_heard_in_the_context(omni) -> None:
    """OpenAI's truncate deletes the text the listener did not hear: the
    transcript is cut to the share of its audio played, and the next
    response's prompt holds only that."""
    _, url = omni
    spoken, kept, whole = await _answer_then_ask(url, None)
    assert kept == spoken and len(spoken) > 2  # random weights: no spaces, so it is cut by characters
    spoken_half, half, cut = await _answer_then_ask(url, 0.5)
    assert spoken_half == spoken and spoken.startswith(half) and len(half) < len(spoken)
    _, nothing, bare = await _answer_then_ask(url, 0.0)
    assert nothing == "" and bare < cut < whole


async def test_a_spoken_answer_item_reads_back_as_the_assistants_text() -> None:
    """The next response's prompt holds each earlier answer as text: the
    transcript of an assistant item as this server types it (output_audio,
    output_text) or as older clients do (audio, text); a user item's heard
    audio stays audio."""
    from mstar.http.realtime.conversation import chat_messages

    clip = np.zeros(1600, dtype=np.float32)
    for audio_part, text_part in (("output_audio", "output_text"), ("audio", "text")):
        items = [
            {"id": "u1", "type": "message", "role": "user", "content": [{"type": "input_audio", "transcript": None}]},
            {"id": "a1", "type": "message", "role": "assistant",
             "content": [{"type": audio_part, "transcript": "Hi."}]},
            {"id": "a2", "type": "message", "role": "assistant", "content": [{"type": text_part, "text": "Yes."}]},
        ]
        messages = chat_messages(items, {"u1": [clip]}, "Be brief.")
        assert messages[0] == {"role": "system", "content": "Be brief."}
        assert messages[1]["role"] == "user" and messages[1]["content"][0]["type"] == "audio"
        assert messages[2:] == [{"role": "assistant", "content": "Hi."}, {"role": "assistant", "content": "Yes."}]
