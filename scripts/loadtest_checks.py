"""How scripts/loadtest.py judges an answer: a complete stream (SSE, NDJSON
or speech SSE) of exactly the tokens asked for, and a 4xx naming the field.
Each judge returns '' when the answer is right, else what is wrong."""

from __future__ import annotations

import base64
import json
from typing import Any

SPEECH_ROUTE = "/v1/audio/speech"


def check_stream(route: str, events: list[Any], max_tokens: int) -> str:
    """'' if a complete stream is right, else what is wrong with it."""
    if not events:
        return "empty stream"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return f"error event: {json.dumps(errors[0])[:200]}"
    if route == SPEECH_ROUTE:
        return check_speech(events, max_tokens)
    if route == "/generate":
        last = events[-1]
        if not last.get("finished") or any(e.get("finished") for e in events[:-1]):
            return "the finished line is not exactly the last one"
        got = sum(len(e.get("token_ids", [])) for e in events)
        usage = last.get("usage", {}).get("completion_tokens")
        finish = last.get("finish_reason")
    else:
        if events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
            return "does not end with exactly one [DONE]"
        finishes = [c.get("finish_reason") for e in events[:-1] for c in e.get("choices", [])
                    if c.get("finish_reason") is not None]
        if len(finishes) != 1:
            return f"{len(finishes)} finish_reasons"
        finish = finishes[0]
        usage = next((e["usage"].get("completion_tokens") for e in events[:-1] if e.get("usage")), None)
        got = usage
    if finish != "length":
        return f"finish_reason {finish!r}, not 'length'"
    if got != max_tokens or usage != max_tokens:
        return f"{got} tokens (usage {usage}), asked for {max_tokens}"
    return ""


def check_speech(events: list[Any], max_tokens: int) -> str:
    """'' if a complete /v1/audio/speech SSE stream is right: audio deltas of
    whole PCM16 samples, then exactly one done event whose usage counts
    max_tokens sampled tokens."""
    kinds = [e.get("type") if isinstance(e, dict) else e for e in events]
    if kinds[-1] != "speech.audio.done" or "speech.audio.done" in kinds[:-1]:
        return "does not end with exactly one speech.audio.done"
    if any(k != "speech.audio.delta" for k in kinds[:-1]):
        return f"unexpected events {sorted(set(kinds[:-1]) - {'speech.audio.delta'})}"
    size = sum(len(base64.b64decode(e["audio"])) for e in events[:-1])
    if size % 2:
        return f"{size} bytes of PCM16: not whole samples"
    usage = events[-1].get("usage", {}).get("output_tokens")
    if usage != max_tokens:
        return f"usage says {usage} tokens, asked for {max_tokens}"
    return ""


def check_error(status: int, text: str, param: str) -> str:
    """'' if a malformed request got a 4xx naming `param`, else what is wrong."""
    if not 400 <= status < 500:
        return f"HTTP {status}, not 4xx: {text[:200]}"
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} without a JSON error: {text[:200]}"
    if err.get("param") != param:
        return f"error names {err.get('param')!r}, not {param!r}: {err.get('message')}"
    return ""
