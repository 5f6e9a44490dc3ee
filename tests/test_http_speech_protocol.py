"""`/v1/audio/speech` bodies parsed without a model: defaults, OpenAI's
voice object, only the sampling fields the client gave, and a 400 naming the
field for everything refused."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from mstar.errors import RequestError
from mstar.http.speech.protocol import MAX_INPUT_CHARS, parse_speech
from mstar.http.speech.routes import speech_sampling
from mstar.types import SamplingParams


def parse(**fields: Any):
    return parse_speech(orjson.dumps({"input": "hi", **fields}))


def refused(field: str, **fields: Any) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(**fields)
    assert e.value.field == field and e.value.status == 400, e.value
    return e.value


def test_defaults() -> None:
    body = parse()
    assert (body.model, body.input, body.voice, body.response_format, body.stream_format, body.sampling) == (
        None, "hi", None, "mp3", "audio", {})


def test_fields() -> None:
    body = parse(model="m", voice={"id": "leo"}, response_format="flac", stream_format="sse", speed=1,
                 instructions="", max_tokens=50, temperature=0, seed=3, ignore_eos=True)
    assert (body.model, body.voice, body.response_format, body.stream_format) == ("m", "leo", "flac", "sse")
    assert body.sampling == {"max_tokens": 50, "temperature": 0.0, "seed": 3, "ignore_eos": True}


def test_model_defaults_under_the_clients_fields() -> None:
    defaults = SamplingParams(max_tokens=1200, temperature=0.6, top_p=0.8, repetition_penalty=1.3)
    params = speech_sampling(defaults, parse(temperature=0.2, max_tokens=10))
    assert (params.max_tokens, params.temperature, params.top_p, params.repetition_penalty) == (10, 0.2, 0.8, 1.3)
    # ranges are the engine's to check, once, when it prepares the request (test_http_speech.py: top_p 0 is a 400)
    assert speech_sampling(defaults, parse(top_p=0)).top_p == 0


def test_refusals() -> None:
    assert "not supported" in refused("response_format", response_format="aac").message
    refused("response_format", response_format="ogg")
    refused("response_format", response_format=3)
    refused("stream_format", stream_format="chunks")
    refused("speed", speed=1.5)
    refused("speed", speed=True)
    refused("instructions", instructions="calm")
    refused("voice", voice="")
    refused("voice", voice={"name": "x"})
    refused("voice.x", voice={"id": "leo", "x": 1})   # as any object's unknown field
    refused("voice", voice=5)
    refused("max_tokens", max_tokens=0)
    refused("temperature", temperature="hot")
    refused("ignore_eos", ignore_eos="yes")
    refused("strem", strem=False)  # unknown fields are refused, not ignored
    refused("stream", stream="no")
    refused("stream", stream=False, stream_format="sse")
    with pytest.raises(RequestError) as e:
        parse_speech(orjson.dumps({"voice": "tara"}))
    assert e.value.field == "input"
    refused("input", input="")
    refused("input", input=" \n")
    refused("input", input=["a"])
    assert str(MAX_INPUT_CHARS) in refused("input", input="a" * (MAX_INPUT_CHARS + 1)).message
    parse(input="a" * MAX_INPUT_CHARS)
    with pytest.raises(RequestError) as e:
        parse_speech(b"[]")
    assert e.value.field == "body"
