"""Request bodies of the HTTP routes, parsed and refused without an engine:
every refusal is a `RequestError` that names the field at fault."""

from __future__ import annotations

import orjson
import pytest

from mstar.errors import RequestError
from mstar.http.text.protocol import (COMPLETIONS_MAX_TOKENS, MAX_CHOICES, MAX_N, parse_chat, parse_completion,
                                      parse_generate, parse_json_object)
from mstar.types import SamplingParams


def body(**fields: object) -> bytes:
    return orjson.dumps(fields)


def refused(parse, raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(raw)
    err = info.value
    assert err.status == 400 and err.field, f"a 400 must name its field: {err!r}"
    return err


# ------------------------------------------------------------------ JSON


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"{'a': 1}", b"[1, 2]", b"\"text\"", b"null"])
def test_bad_json_names_the_body(raw: bytes) -> None:
    assert refused(parse_json_object, raw).field == "body"


# ----------------------------------------------------------- completions


def test_completion_defaults() -> None:
    req = parse_completion(body(model="m", prompt="hello"))
    assert req.model == "m" and req.prompts == ("hello",)
    assert req.max_tokens == COMPLETIONS_MAX_TOKENS and req.n == 1
    assert not req.stream and not req.include_usage
    assert req.sampling == SamplingParams()
    # an explicit null is vLLM's "all the room the prompt leaves", not the default's 16
    assert parse_completion(body(model="m", prompt="hello", max_tokens=None)).max_tokens is None


def test_completion_reads_every_sampling_field() -> None:
    req = parse_completion(body(
        prompt=[1, 2, 3], max_tokens=7, temperature=0, top_p=0.5, top_k=4, min_p=0.1,
        repetition_penalty=1.2, seed=9, stop=["a", "bc"], stop_token_ids=[5], ignore_eos=True, min_tokens=3,
        n=2, best_of=2, stream=True, stream_options={"include_usage": True},
        presence_penalty=0, frequency_penalty=0.0, logprobs=None, echo=False, user="u",
        response_format={"type": "text"}))
    assert req.prompts == ((1, 2, 3),) and req.max_tokens == 7 and req.n == 2
    assert req.stream and req.include_usage
    assert req.sampling == SamplingParams(temperature=0.0, top_p=0.5, top_k=4, min_p=0.1, repetition_penalty=1.2,
                                          seed=9, stop=("a", "bc"), stop_token_ids=(5,), ignore_eos=True,
                                          min_tokens=3)


def test_completion_prompt_forms() -> None:
    assert parse_completion(body(prompt="x")).prompts == ("x",)
    assert parse_completion(body(prompt=[7])).prompts == ((7,),)
    assert parse_completion(body(prompt=["a", "b"])).prompts == ("a", "b")
    assert parse_completion(body(prompt=[[1, 2], [3]])).prompts == ((1, 2), (3,))
    assert parse_completion(body(prompt=["a", [3]])).prompts == ("a", (3,))
    assert parse_completion(body(prompt="")).prompts == ("",)  # the tokenizer decides if it has tokens


def test_stop_string_becomes_a_tuple() -> None:
    assert parse_completion(body(prompt="x", stop="\n")).sampling.stop == ("\n",)


@pytest.mark.parametrize("fields, field", [
    ({}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [1.5]}, "prompt"),
    ({"model": 3}, "model"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 2**63}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": True}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "text"}, "response_format"),
])
def test_completion_refusals_name_the_field(fields: dict, field: str) -> None:
    fields = {"prompt": "hi", **fields} if "prompt" not in fields and fields != {} else fields
    assert refused(parse_completion, orjson.dumps(fields)).field == field


def test_integers_beyond_64_bits_are_refused_naming_the_field() -> None:
    # no tensor or counter downstream could hold them: refused before they get that far
    err = refused(parse_completion, b'{"prompt": "x", "max_tokens": 99999999999999999999999}')
    assert err.field == "max_tokens" and "out of range" in err.message
    assert "64 bits" in err.message and "e+" not in err.message and "9999999999999999" not in err.message
    assert refused(parse_completion, b'{"prompt": "x", "seed": 100000000000000000000000}').field == "seed"
    assert refused(parse_completion, b'{"prompt": "x", "seed": -9223372036854775809}').field == "seed"
    assert refused(parse_completion, b'{"prompt": "x", "top_k": 9223372036854775808}').field == "top_k"
    assert parse_completion(b'{"prompt": "x", "seed": 9223372036854775807}').sampling.seed == 2**63 - 1


def test_any_int64_seed_is_taken() -> None:
    """OpenAI and vLLM take any int64 seed; a negative one lands on the
    engine's top half of [0, 2**63), distinct from every other negative one."""
    seeds = {s: parse_completion(orjson.dumps({"prompt": "x", "seed": s})).sampling.seed
             for s in (-1, -5, -(2**63), 0, 5)}
    assert seeds == {-1: 2**63 - 1, -5: 2**63 - 5, -(2**63): 0, 0: 0, 5: 5}
    # a sampling key's own seed too; one past int64 is left for the model to refuse, naming its field
    by = parse_completion(orjson.dumps({"prompt": "x", "sampling_by": {"llm": {"seed": -5, "top_k": 3},
                                                                       "codec": {"seed": 7}}})).sampling_by
    assert by == {"llm": {"seed": 2**63 - 5, "top_k": 3}, "codec": {"seed": 7}}
    assert parse_completion(b'{"prompt": "x", "sampling_by": {"llm": {"seed": 9223372036854775808}}}') \
        .sampling_by == {"llm": {"seed": 2**63}}


def test_too_many_choices() -> None:
    assert refused(parse_completion, body(prompt=["a"] * 10, n=MAX_N)).field == "n"
    # a list of prompts alone past the limit names the prompts, not an n the client never sent
    err = refused(parse_completion, body(prompt=["a"] * (MAX_CHOICES + 1)))
    assert err.field == "prompt" and f"{MAX_CHOICES + 1} prompts x n = 1" in str(err)


def test_a_body_that_is_not_utf8_says_so() -> None:
    err = refused(parse_json_object, b'{"prompt": "\xff\xfe", "max_tokens": 2}')
    assert err.field == "body" and "not valid UTF-8 (byte 12)" in str(err)


def test_unsupported_feature_says_so() -> None:
    err = refused(parse_completion, body(prompt="x", logit_bias={"5": 1}))
    assert "not supported" in err.message


def test_presence_and_frequency_penalties_are_read() -> None:
    sampling = parse_completion(body(prompt="x", presence_penalty=0.5, frequency_penalty=-1)).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert refused(parse_completion, body(prompt="x", frequency_penalty=-2.5)).field == "frequency_penalty"


# ------------------------------------------------------------------ chat


def test_chat_messages_and_limits() -> None:
    req = parse_chat(body(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ], max_completion_tokens=5, max_tokens=99))
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""})
    assert req.max_tokens == 5  # max_completion_tokens wins over the older name
    assert req.template_kwargs == {}
    kwargs = parse_chat(body(messages=[{"role": "user", "content": "x"}],
                             chat_template_kwargs={"enable_thinking": False})).template_kwargs
    assert kwargs == {"enable_thinking": False}
    assert refused(parse_chat, body(messages=[{"role": "user", "content": "x"}],
                                    chat_template_kwargs=[1])).field == "chat_template_kwargs"
    assert parse_chat(body(messages=[{"role": "user", "content": "x"}], max_tokens=3)).max_tokens == 3
    assert parse_chat(body(messages=[{"role": "user", "content": "x"}])).max_tokens is None


@pytest.mark.parametrize("fields, field", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": False}, "max_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"modalities": ["text", "audio"]}, "audio"),  # spoken, but in no voice or format
    ({"modalities": ["text", "video"]}, "modalities"),
    ({"audio": {"voice": "ethan", "format": "wav"}}, "modalities"),  # audio not asked for
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"temperature": None, "top_p": 3}, "top_p"),
])
def test_chat_refusals_name_the_field(fields: dict, field: str) -> None:
    if "messages" not in fields and fields:
        fields = {"messages": [{"role": "user", "content": "hi"}], **fields}
    assert refused(parse_chat, orjson.dumps(fields)).field == field


# ---------------------------------------------------------------- native


def test_generate_reads_sampling_params_by_name() -> None:
    req = parse_generate(body(text="hi", stream=True, sampling_params={"max_tokens": 3, "temperature": 0,
                                                                      "stop": ["x"], "seed": 1}))
    assert req.prompt == "hi" and req.stream and req.model is None
    assert req.sampling == SamplingParams(max_tokens=3, temperature=0.0, stop=("x",), seed=1)
    assert parse_generate(body(input_ids=[1, 2])).prompt == (1, 2)
    assert parse_generate(body(input_ids=[1])).sampling == SamplingParams()


@pytest.mark.parametrize("fields, field", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": 5}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [False]}, "input_ids"),
    ({"text": "a", "prompt": "b"}, "prompt"),
    ({"text": "a", "stream": 1}, "stream"),
    ({"text": "a", "sampling_params": []}, "sampling_params"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 3}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"text": "a", "sampling_params": {"max_tokens": True}}, "sampling_params.max_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": "1"}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1.5]}}, "sampling_params.stop_token_ids"),
])
def test_generate_refusals_name_the_field(fields: dict, field: str) -> None:
    assert refused(parse_generate, orjson.dumps(fields)).field == field
