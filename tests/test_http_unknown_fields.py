"""One policy on every route: a field the route does not know is a 400
`unknown field` naming it, with the fields it does know (OpenAI answers an
unrecognized argument with a 400 too). Every real OpenAI field of the
completions and chat routes is known: served, accepted where it asks for
nothing this server lacks, or refused with a reason. The OpenAPI document
lists exactly the known fields. A `voice` sent to a model that does not speak
is refused naming `voice`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import pytest_asyncio
from http_support import running_engine, serving

from mstar.errors import RequestError
from mstar.http.openapi.document import document
from mstar.http.text.protocol import CHAT_KEYS, COMPLETION_KEYS, GENERATE_KEYS
from mstar.http.speech.protocol import SPEECH_KEYS, parse_speech

ON_LOOP = pytest.mark.asyncio(loop_scope="module")
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url() -> AsyncIterator[str]:
    async with running_engine() as engine, serving(engine) as base:
        yield base


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as r:
            return r.status, await r.json()


@ON_LOOP
@pytest.mark.parametrize("path, body, known", [
    ("/v1/completions", COMPLETION, COMPLETION_KEYS),
    ("/v1/chat/completions", CHAT, CHAT_KEYS),
    ("/generate", {"text": "hi"}, GENERATE_KEYS),
])
async def test_a_typo_is_a_400_naming_it(url: str, path: str, body: dict[str, Any], known: frozenset[str]) -> None:
    status, answer = await _post(url, path, {**body, "max_toknes": 3})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "max_toknes" and error["type"] == "invalid_request_error"
    assert "unknown field" in error["message"] and str(sorted(known)) in error["message"]


def test_the_speech_route_answers_the_same() -> None:
    with pytest.raises(RequestError) as caught:
        parse_speech(orjson.dumps({"input": "hi", "max_toknes": 3}))
    assert caught.value.field == "max_toknes" and str(sorted(SPEECH_KEYS)) in caught.value.message


@pytest.mark.parametrize("path, known", [
    ("/v1/completions", COMPLETION_KEYS), ("/v1/chat/completions", CHAT_KEYS), ("/generate", GENERATE_KEYS),
    ("/v1/audio/speech", SPEECH_KEYS),
])
def test_the_document_lists_exactly_the_known_fields(path: str, known: frozenset[str]) -> None:
    ref = document()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document()["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == known


# OpenAI's own fields that ask for nothing this server lacks, at values a client commonly sends
ACCEPTED_CHAT = {"user": "u1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                 "parallel_tool_calls": True, "safety_identifier": "s", "prompt_cache_key": "k", "seed": 1,
                 "stop": ["\n\n"], "n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0,
                 "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                 "functions": [], "function_call": "none", "modalities": ["text"], "max_completion_tokens": 2,
                 "stream": False, "audio": None, "prediction": None, "reasoning_effort": None, "verbosity": None,
                 "web_search_options": None, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0,
                 "repetition_penalty": 1, "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0,
                 "add_generation_prompt": True, "sampling_by": {}, "priority": 0, "chat_template_kwargs": {},
                 "skip_special_tokens": True, "include_stop_str_in_output": False}
ACCEPTED_COMPLETION = {"user": "u1", "seed": 1, "stop": "\n\n", "n": 1, "best_of": 1, "echo": False,
                       "suffix": None, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
                       "logit_bias": {}, "stream": False, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0,
                       "repetition_penalty": 1, "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0,
                       "sampling_by": {}, "priority": 3, "skip_special_tokens": True,
                       "include_stop_str_in_output": False}


@ON_LOOP
async def test_every_openai_field_at_a_neutral_value_is_accepted(url: str) -> None:
    assert set(ACCEPTED_CHAT) | set(CHAT) >= CHAT_KEYS - {"stream_options", "top_logprobs"}
    assert set(ACCEPTED_COMPLETION) | set(COMPLETION) >= COMPLETION_KEYS - {"stream_options", "response_format"}
    status, answer = await _post(url, "/v1/chat/completions", {**CHAT, **ACCEPTED_CHAT})
    assert status == 200, answer
    status, answer = await _post(url, "/v1/completions", {**COMPLETION, **ACCEPTED_COMPLETION})
    assert status == 200, answer


@ON_LOOP
@pytest.mark.parametrize("field, value", [
    ("store", True), ("service_tier", "flex"),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "low"), ("verbosity", "high"),
    ("web_search_options", {"search_context_size": "low"}), ("function_call", {"name": "f"}),
    ("metadata", {"n": 5}), ("metadata", "tags"), ("parallel_tool_calls", "yes"), ("safety_identifier", 7),
])
async def test_chat_fields_that_would_change_the_answer_are_refused(url: str, field: str, value: Any) -> None:
    status, answer = await _post(url, "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400, answer
    assert answer["error"]["param"].split(".")[0] == field, answer


@ON_LOOP
async def test_the_openai_client_gets_a_bad_request_naming_the_typo(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = await client.chat.completions.create(model="tiny-llama", messages=CHAT["messages"], max_tokens=2,
                                                 user="u1", metadata={"team": "a"}, store=False, seed=1,
                                                 service_tier="auto")
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="tiny-llama", prompt="hi", extra_body={"max_toknes": 3})
    assert caught.value.body["param"] == "max_toknes"  # type: ignore[index]


@ON_LOOP
async def test_a_voice_for_a_model_that_does_not_speak_names_voice(url: str) -> None:
    status, answer = await _post(url, "/generate", {"text": "a", "voice": "tara"})
    assert status == 400, answer
    assert answer["error"]["param"] == "voice" and "does not speak" in answer["error"]["message"]
