"""What the objects of `session.update` and `response.create` may hold: a
client's object in, an error event naming the first field out of place.

Every route refuses a field it does not know (OpenAI's realtime API answers
"Unknown parameter"), so a client written for the beta API (`voice`,
`modalities`, `output_audio_format` at the session's top level) learns where
the GA session keeps them instead of getting defaults it did not ask for.
Fields of OpenAI's that ask for something mstar does not serve (tools, a
prompt template, tracing, another speed) are refused with the reason; the
neutral values (no tools, speed 1.0, ...) pass. Read-only fields a client
may send back from `session.created` (`id`, `object`, the `mstar` lists)
pass too.
"""

from __future__ import annotations

from typing import Any

from mstar.http.realtime.protocol import ProtocolError

SESSION = frozenset({"type", "object", "id", "model", "instructions", "output_modalities", "max_output_tokens",
                     "audio", "tools", "tool_choice", "parallel_tool_calls", "tracing", "truncation", "prompt",
                     "include", "reasoning", "mstar", "expires_at"})
SESSION_AUDIO = frozenset({"input", "output"})
SESSION_INPUT = frozenset({"format", "transcription", "noise_reduction", "turn_detection"})
TURN_DETECTION = frozenset({"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                            "interrupt_response", "idle_timeout_ms", "eagerness"})  # the last: semantic_vad's
SESSION_OUTPUT = frozenset({"format", "voice", "speed"})
SESSION_MSTAR = frozenset({"input_linger_ms", "seed", "voices", "audio_input"})
RESPONSE = frozenset({"conversation", "input", "instructions", "max_output_tokens", "metadata",
                      "output_modalities", "audio", "tools", "tool_choice", "parallel_tool_calls", "prompt",
                      "reasoning"})
RESPONSE_AUDIO = frozenset({"output"})
RESPONSE_OUTPUT = frozenset({"format", "voice"})

# the beta API's session and response fields, and where the GA objects keep them (a response's audio settings
# but its voice and format are the session's)
_SESSION_BETA = {"voice": "audio.output.voice", "modalities": "output_modalities",
                 "output_audio_format": "audio.output.format", "input_audio_format": "audio.input.format",
                 "turn_detection": "audio.input.turn_detection", "max_response_output_tokens": "max_output_tokens",
                 "input_audio_noise_reduction": "audio.input.noise_reduction", "speed": "audio.output.speed",
                 "input_audio_transcription": "audio.input.transcription"}
BETA = {"session": {k: f"session.{v}" for k, v in _SESSION_BETA.items()},
        "response": {**{k: f"session.{v}" for k, v in _SESSION_BETA.items()},
                     "voice": "response.audio.output.voice", "modalities": "response.output_modalities",
                     "output_audio_format": "response.audio.output.format",
                     "max_response_output_tokens": "response.max_output_tokens"}}
# what each client event may hold besides its `type` and `event_id`
EVENT = {"session.update": {"session"}, "input_audio_buffer.append": {"audio"}, "input_audio_buffer.commit": set(),
         "input_audio_buffer.clear": set(), "conversation.item.create": {"item", "previous_item_id"},
         "conversation.item.truncate": {"item_id", "content_index", "audio_end_ms"},
         "conversation.item.delete": {"item_id"}, "conversation.item.retrieve": {"item_id"},
         "response.create": {"response"}, "response.cancel": {"response_id"}}
TRUNCATION = ("auto", "disabled")


def refuse_unknown(obj: dict[str, Any], known: frozenset[str] | set[str], where: str) -> None:
    """An error naming the first key of `obj` not in `known` (`where`: its
    path; "" for an event's own keys)."""
    for key in obj:
        if key not in known:
            param = f"{where}.{key}" if where else key
            hint = BETA.get(where, {}).get(key)
            moved = f"; the GA API keeps it as '{hint}'" if hint is not None else ""
            raise ProtocolError(f"unknown parameter '{param}'{moved}", "unknown_parameter", param)


def check_event(obj: dict[str, Any]) -> None:
    """A client event's own keys (its `type` is a known one)."""
    refuse_unknown(obj, EVENT[obj["type"]] | {"type", "event_id"}, "")


def check_session(session: dict[str, Any], speaks_only: bool) -> None:
    """The session object's fields, at every depth mstar reads; the values
    of those it does not serve. `speaks_only`: the model reads text aloud
    (it takes no instructions, as `/v1/audio/speech` takes none)."""
    refuse_unknown(session, SESSION, "session")
    audio = _object(session, "audio", "session")
    refuse_unknown(audio, SESSION_AUDIO, "session.audio")
    inp = _object(audio, "input", "session.audio")
    refuse_unknown(inp, SESSION_INPUT, "session.audio.input")
    if isinstance(inp.get("turn_detection"), dict):
        refuse_unknown(inp["turn_detection"], TURN_DETECTION, "session.audio.input.turn_detection")
    output = _object(audio, "output", "session.audio")
    refuse_unknown(output, SESSION_OUTPUT, "session.audio.output")
    refuse_unknown(_object(session, "mstar", "session"), SESSION_MSTAR, "session.mstar")
    speed = output.get("speed")
    if speed is not None and speed != 1.0:
        raise ProtocolError("only speed 1.0 is supported", "invalid_value", "session.audio.output.speed")
    truncation = session.get("truncation")
    if truncation is not None and truncation not in TRUNCATION:
        raise ProtocolError(f"'session.truncation' must be one of {', '.join(TRUNCATION)} (a retention ratio is "
                            "not supported)", "invalid_value", "session.truncation")
    _no_tools(session, "session")
    for name in ("tracing", "prompt", "reasoning"):
        if session.get(name) is not None:
            raise ProtocolError(f"'session.{name}' is not supported; leave it null", "invalid_value",
                                f"session.{name}")
    if session.get("include"):
        raise ProtocolError("'session.include' is not supported; leave it empty", "invalid_value", "session.include")
    instructions = session.get("instructions")
    if speaks_only and isinstance(instructions, str) and instructions:
        raise ProtocolError("this model reads the user's text aloud; it takes no instructions", "invalid_value",
                            "session.instructions")


def check_response(params: dict[str, Any], speaks_only: bool) -> None:
    """`response.create`'s response object, as `check_session` checks a session's."""
    refuse_unknown(params, RESPONSE, "response")
    audio = _object(params, "audio", "response")
    refuse_unknown(audio, RESPONSE_AUDIO, "response.audio")
    refuse_unknown(_object(audio, "output", "response.audio"), RESPONSE_OUTPUT, "response.audio.output")
    conversation = params.get("conversation")
    if conversation is not None and conversation != "auto":
        raise ProtocolError("a response outside the conversation is not supported ('conversation' must be 'auto')",
                            "invalid_value", "response.conversation")
    _no_tools(params, "response")
    for name in ("prompt", "reasoning"):
        if params.get(name) is not None:
            raise ProtocolError(f"'response.{name}' is not supported; leave it null", "invalid_value",
                                f"response.{name}")
    instructions = params.get("instructions")
    if speaks_only and isinstance(instructions, str) and instructions:
        raise ProtocolError("this model reads the user's text aloud; it takes no instructions", "invalid_value",
                            "response.instructions")


def _object(obj: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """`obj[name]` where it is an object, else {} (its type is checked where it is read)."""
    value = obj.get(name)
    return value if isinstance(value, dict) else {}


def _no_tools(obj: dict[str, Any], where: str) -> None:
    if obj.get("tools"):
        raise ProtocolError("tools are not supported; leave 'tools' empty", "invalid_value", f"{where}.tools")
    choice = obj.get("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        raise ProtocolError("tools are not supported; 'tool_choice' may only be 'none' or 'auto'", "invalid_value",
                            f"{where}.tool_choice")
