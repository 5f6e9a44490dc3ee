"""The realtime session's energy VAD and input audio buffer, on synthetic
PCM16: speech is dated at its edges (less the prefix padding), a click or a
quiet room starts nothing, the threshold moves with its setting, an idle
open microphone keeps only what a start could reach back to, and the limit
refuses appends with VAD off and ends a turn with VAD on; a hearing
model's conversation becomes chat messages."""

from __future__ import annotations

import numpy as np
import pytest

from mstar.http.realtime.conversation import chat_messages
from mstar.http.realtime.input_audio import INPUT_RATE, InputAudioBuffer
from mstar.http.realtime.protocol import ProtocolError
from mstar.http.realtime.vad import EnergyVad, TurnDetection


def tone(ms: int, dbfs: float) -> np.ndarray:
    t = np.arange(INPUT_RATE * ms // 1000) / INPUT_RATE
    rms = 10 ** (dbfs / 20)
    return (np.sqrt(2) * rms * 32767 * np.sin(2 * np.pi * 200 * t)).astype(np.int16)


def quiet(ms: int, dbfs: float = -200.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal(INPUT_RATE * ms // 1000) * 10 ** (dbfs / 20) * 32767).astype(np.int16)


def feed(vad: EnergyVad, *parts: np.ndarray) -> list[tuple[str, int]]:
    audio = np.concatenate(parts)
    out = []
    for i in range(0, audio.size, 2400):  # 100 ms appends, not frame aligned across parts
        out += [(e.kind, e.ms) for e in vad.feed(audio[i:i + 2400])]
    return out


def test_speech_is_dated_at_its_edges() -> None:
    vad = EnergyVad(INPUT_RATE, TurnDetection(prefix_padding_ms=300, silence_duration_ms=500))
    assert feed(vad, quiet(1000, -60), tone(800, -25), quiet(700, -60)) == [("started", 700), ("stopped", 1800)]


def test_a_pause_shorter_than_the_silence_does_not_end_the_turn() -> None:
    vad = EnergyVad(INPUT_RATE, TurnDetection(silence_duration_ms=500))
    events = feed(vad, quiet(400), tone(300, -20), quiet(300), tone(300, -20), quiet(600))
    assert events == [("started", 100), ("stopped", 1300)]


@pytest.mark.parametrize("audio", [np.concatenate([quiet(500), tone(40, -6), quiet(800)]),  # a click
                                   quiet(2000, -55)])                                        # a quiet room
def test_clicks_and_room_noise_start_nothing(audio: np.ndarray) -> None:
    assert feed(EnergyVad(INPUT_RATE, TurnDetection()), audio) == []


def test_the_threshold_moves_the_level() -> None:
    speech = (quiet(500), tone(500, -30), quiet(800))
    assert feed(EnergyVad(INPUT_RATE, TurnDetection(threshold=0.5)), *speech)  # -40 dBFS: heard
    assert feed(EnergyVad(INPUT_RATE, TurnDetection(threshold=0.8)), *speech) == []  # -22 dBFS: not


def test_an_idle_microphone_keeps_only_the_padding() -> None:
    buf = InputAudioBuffer(2.0, TurnDetection(prefix_padding_ms=300))
    for _ in range(100):  # 10 s of silence, past the 2 s limit
        assert buf.append(quiet(100).tobytes()) == []
    assert buf.buffered_ms <= 300 + 5 * 20 + 100


def test_the_limit_refuses_appends_without_vad() -> None:
    buf = InputAudioBuffer(1.0, None)
    buf.append(tone(900, -20).tobytes())
    with pytest.raises(ProtocolError) as e:
        buf.append(tone(200, -20).tobytes())
    assert (e.value.param, e.value.code) == ("audio", "input_audio_buffer_full")
    assert buf.commit().end_ms == 900  # the refused append added nothing


def test_the_limit_ends_a_turn_with_vad() -> None:
    buf = InputAudioBuffer(1.0, TurnDetection(prefix_padding_ms=0))
    events = []
    for _ in range(15):
        events += buf.append(tone(100, -20).tobytes())
    assert [(e.kind, e.ms) for e in events][:2] == [("started", 0), ("stopped", 1000)]
    turn = buf.commit(1000)
    assert (turn.start_ms, turn.end_ms, len(turn.pcm)) == (0, 1000, 2 * INPUT_RATE)


def test_chat_messages_of_a_conversation() -> None:
    clip = np.zeros(1600, dtype=np.float32)
    items = [{"id": "a", "type": "message", "role": "user", "content": [{"type": "input_audio", "transcript": None}]},
             {"id": "b", "type": "message", "role": "assistant", "content": [{"type": "audio", "transcript": "Hi."}]},
             {"id": "c", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "More."}]}]
    messages = chat_messages(items, {"a": [clip]}, "Be brief.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"][0]["audio"] is clip and messages[2]["content"] == "Hi."
    assert messages[3]["content"] == [{"type": "text", "text": "More."}]
