"""The realtime session object of `session.created` / `session.updated`,
and what `session.update` may change: instructions, the output limit, the
voice, turn detection (server VAD, for a model that hears), and mstar's own
fields under `session.mstar`. An update is checked whole before any of it
applies, so a refused one changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.http.realtime.protocol import (AUDIO_FORMAT, DEFAULT_INPUT_LINGER_MS, MAX_INPUT_LINGER_MS, MODALITIES,
                                          ProtocolError, check_format, field_of, output_limit)
from mstar.http.realtime.vad import TurnDetection

UNSET: Any = object()  # a field the update leaves as it is


@dataclass
class SessionConfig:
    """The session object; `speaks`: the model has audio out (then audio is
    its output modality), else text; `hears`: it takes audio in (then
    server VAD is on unless turned off); `text_only`: a model that hears and
    speaks answers in text (`output_modalities: ["text"]`), as it does in a
    chat completion without audio out."""

    session_id: str
    model: str
    speaks: bool
    voices: tuple[str, ...]
    voice: str | None
    max_model_len: int
    instructions: str = ""
    max_output_tokens: int | None = None
    input_linger_ms: int = DEFAULT_INPUT_LINGER_MS
    seed: int | None = None  # responses draw reproducibly (each response from this seed)
    hears: bool = False
    turn_detection: TurnDetection | None = None
    text_only: bool = False
    truncation: str = "auto"  # "auto": a conversation too long for the context drops its oldest items (OpenAI's)
    names: tuple[str, ...] = ()  # the model's other served names (--served-model-name), which name it too

    def __post_init__(self) -> None:
        if self.hears and self.turn_detection is None:
            self.turn_detection = TurnDetection()  # on by default, as OpenAI's is

    @property
    def modalities(self) -> list[str]:
        return ["audio"] if self.speaks and not self.text_only else ["text"]

    @property
    def answers(self) -> tuple[str, ...]:
        """The output modalities the model can answer in: a model that hears
        and speaks answers in text too (its chat walk)."""
        return ("audio", "text") if self.hears else ("audio",) if self.speaks else ("text",)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "realtime", "object": "realtime.session", "id": self.session_id, "model": self.model,
            "output_modalities": self.modalities, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "tools": [], "tool_choice": "none", "truncation": self.truncation,
            "audio": {
                "input": {"format": AUDIO_FORMAT, "transcription": None, "noise_reduction": None,
                          "turn_detection": self.turn_detection.to_json() if self.turn_detection else None},
                "output": {"format": AUDIO_FORMAT, "voice": self.voice, "speed": 1.0},
            },
            # the demo's microphone follows `audio_input`
            "mstar": {"input_linger_ms": self.input_linger_ms, "seed": self.seed, "voices": list(self.voices),
                      "audio_input": self.hears},
        }
        return out

    def update(self, session: dict[str, Any]) -> None:
        """Apply `session.update`'s session object; refuses what mstar cannot
        honour (server VAD, other audio formats, a text-only speech model)
        instead of ignoring it."""
        kind = session.get("type", "realtime")
        if kind != "realtime":
            raise ProtocolError(f"session type {kind!r} is not supported (only 'realtime')", "invalid_value",
                                "session.type")
        model = field_of(session, "model", str, "session", required=False)
        if model is not None and model != self.model and model not in self.names:
            raise ProtocolError(f"this session serves '{self.model}'; connect with ?model= to use another",
                                "invalid_value", "session.model")
        instructions = field_of(session, "instructions", str, "session", required=False)
        answer = self.check_modalities(session, "session")
        raw_limit = session.get("max_output_tokens")
        limit = (output_limit(raw_limit, "session.max_output_tokens", self.max_model_len)
                 if raw_limit is not None else None)
        audio = field_of(session, "audio", dict, "session", required=False) or {}
        voice, turns = self._audio(audio)
        linger, seed = self._extension(session)
        truncation = session.get("truncation")  # its value checked with the session's fields (`known_fields`)
        # all checked: apply together, so a refused update changes nothing
        if truncation is not None:
            self.truncation = truncation
        if answer is not None:
            self.text_only = self.speaks and answer == "text"
        if instructions is not None:
            self.instructions = instructions
        if raw_limit is not None:
            self.max_output_tokens = limit
        if voice is not None:
            self.voice = voice
        if linger is not None:
            self.input_linger_ms = linger
        if seed is not None:
            self.seed = seed
        if turns is not UNSET:
            self.turn_detection = turns

    def _audio(self, audio: dict[str, Any]) -> tuple[str | None, Any]:
        """(voice or None, turn detection or UNSET) of `session.audio`."""
        inp = field_of(audio, "input", dict, "session.audio", required=False) or {}
        out = field_of(audio, "output", dict, "session.audio", required=False) or {}
        for where, part in (("input", inp), ("output", out)):
            check_format(part.get("format"), f"session.audio.{where}.format")
        turns: Any = UNSET
        where = "session.audio.input.turn_detection"
        if "turn_detection" in inp:
            raw = inp["turn_detection"]
            if raw is not None and not self.hears:
                raise ProtocolError(f"model '{self.model}' takes no audio input, so there are no turns to detect",
                                    "unsupported_turn_detection", where)
            turns = None if raw is None else TurnDetection.parse(raw, where, self.turn_detection)
        if inp.get("transcription") is not None:
            raise ProtocolError(f"model '{self.model}' provides no input transcription (it has no separate speech "
                                "recogniser); leave it null", "unsupported_transcription",
                                "session.audio.input.transcription")
        if inp.get("noise_reduction") is not None:
            raise ProtocolError("noise reduction is not supported; leave it null", "invalid_value",
                                "session.audio.input.noise_reduction")
        voice = field_of(out, "voice", str, "session.audio.output", required=False)
        if voice is not None:
            voice = self.check_voice(voice, "session.audio.output.voice")
        return voice, turns

    def check_voice(self, voice: str, param: str) -> str:
        name = voice.strip().lower()
        if name not in self.voices:
            have = ", ".join(self.voices) or "none"
            raise ProtocolError(f"unknown voice {voice!r}; this model has {have}", "invalid_value", param)
        return name

    def check_modalities(self, obj: dict[str, Any], where: str) -> str | None:
        """`output_modalities`, if given: one modality the model answers in,
        which this returns (None: not given)."""
        modalities = field_of(obj, "output_modalities", list, where, required=False)
        if modalities is None:
            return None
        for i, modality in enumerate(modalities):
            if not isinstance(modality, str) or modality not in MODALITIES:
                param = f"{where}.output_modalities[{i}]"
                raise ProtocolError(f"'{param}' must be one of {', '.join(MODALITIES)}", "invalid_value", param)
        asked = sorted(set(modalities))
        if len(asked) != 1 or asked[0] not in self.answers:
            raise ProtocolError(f"model '{self.model}' answers in one of {list(self.answers)}, not {modalities}",
                                "invalid_value", f"{where}.output_modalities")
        return asked[0]

    @staticmethod
    def _extension(session: dict[str, Any]) -> tuple[int | None, int | None]:
        """mstar's own fields under `session.mstar`: (input_linger_ms, seed)."""
        ext = field_of(session, "mstar", dict, "session", required=False) or {}
        linger = field_of(ext, "input_linger_ms", int, "session.mstar", required=False)
        if linger is not None and not 0 <= linger <= MAX_INPUT_LINGER_MS:
            raise ProtocolError(f"'session.mstar.input_linger_ms' must be in [0, {MAX_INPUT_LINGER_MS}]",
                                "invalid_value", "session.mstar.input_linger_ms")
        seed = field_of(ext, "seed", int, "session.mstar", required=False)
        if seed is not None and not -2**63 <= seed < 2**63:  # any int64, as the HTTP routes take one
            raise ProtocolError("must be an int64, in [-2**63, 2**63)", "invalid_value", "session.mstar.seed")
        return linger, seed
