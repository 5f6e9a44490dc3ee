"""`/v1/realtime` against malformed client events, on CPU: every field the
session reads, given a wrong type or value, gets an `error` event naming its
full path and the client's event_id, and the socket then runs a response;
a message over the size limit closes with 1009 and a reason; a plain GET is
told to upgrade (426); a response cut
by max_output_tokens ends `incomplete`; a cancelled one counts the tokens
the engine sampled, and so does one the server stopped (its timeout, its
abort at shutdown), which ends `failed` with the reason, not as a cancel."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from http_support import running_engine, serving

from mstar.engine.engine import Engine
from mstar.http.realtime import known_fields
from mstar.http.realtime.protocol import CLIENT_EVENTS
from mstar.http.realtime.routes import MAX_MESSAGE_BYTES
from mstar.models.orpheus.model import DEFAULT_MAX_TOKENS
from mstar.types import GenerateRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

SHORT = 35  # tokens a turn: five frames


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _with(content: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speech() -> AsyncIterator[tuple[Engine, str]]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield engine, url


async def _socket(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientWebSocketResponse:
    """A session whose responses end as soon as the model has spoken."""
    ws = await http.ws_connect(url.replace("http://", "ws://") + "/v1/realtime?model=orpheus-tiny")
    assert (await ws.receive_json())["type"] == "session.created"
    await ws.send_json({"type": "session.update", "session": {"mstar": {"input_linger_ms": 0, "seed": 7}}})
    assert (await ws.receive_json())["type"] == "session.updated"
    return ws


async def _until(ws: aiohttp.ClientWebSocketResponse, kind: str, seen: list[dict[str, Any]] | None = None,
                 ) -> dict[str, Any]:
    while True:
        ev = await ws.receive_json(timeout=30)
        if seen is not None:
            seen.append(ev)
        if ev["type"] == kind:
            return ev


# (event, the param its error names); "known" is a user item each socket creates first
MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"type": "session.update", "session": 5}, "session"),
    ({"type": "session.update", "session": {"type": 5}}, "session.type"),
    ({"type": "session.update", "session": {"model": 5}}, "session.model"),
    ({"type": "session.update", "session": {"instructions": 5}}, "session.instructions"),
    ({"type": "session.update", "session": {"output_modalities": [1, "a"]}}, "session.output_modalities[0]"),
    ({"type": "session.update", "session": {"output_modalities": ["audio", "a"]}}, "session.output_modalities[1]"),
    ({"type": "session.update", "session": {"output_modalities": [["audio"]]}}, "session.output_modalities[0]"),
    ({"type": "session.update", "session": {"output_modalities": "audio"}}, "session.output_modalities"),
    ({"type": "session.update", "session": {"output_modalities": ["text"]}}, "session.output_modalities"),
    ({"type": "session.update", "session": {"max_output_tokens": 2**63}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": "x"}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"max_output_tokens": [1]}}, "session.max_output_tokens"),
    ({"type": "session.update", "session": {"audio": 5}}, "session.audio"),
    ({"type": "session.update", "session": {"audio": {"output": "x"}}}, "session.audio.output"),
    ({"type": "session.update", "session": {"audio": {"input": 5}}}, "session.audio.input"),
    ({"type": "session.update", "session": {"audio": {"output": {"voice": 5}}}}, "session.audio.output.voice"),
    ({"type": "session.update", "session": {"audio": {"output": {"format": "pcm16"}}}},
     "session.audio.output.format"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": "x"}}}}},
     "session.audio.input.format"),
    ({"type": "session.update", "session": {"mstar": 5}}, "session.mstar"),
    ({"type": "session.update", "session": {"mstar": {"seed": "x"}}}, "session.mstar.seed"),
    ({"type": "session.update", "session": {"mstar": {"seed": 2**64}}}, "session.mstar.seed"),
    ({"type": "session.update", "session": {"mstar": {"seed": -(2**63) - 1}}}, "session.mstar.seed"),
    ({"type": "session.update", "session": {"mstar": {"input_linger_ms": 1.5}}}, "session.mstar.input_linger_ms"),
    # fields the GA session does not have (the beta API's, or none at all), and values mstar does not serve
    ({"type": "session.update", "session": {"voice": "leo"}}, "session.voice"),
    ({"type": "session.update", "session": {"type": "realtime", "output_audio_format": "g711_ulaw"}},
     "session.output_audio_format"),
    ({"type": "session.update", "session": {"type": "realtime", "bogus": 1}}, "session.bogus"),
    ({"type": "session.update", "session": {"audio": {"output": {"bogus": 1}}}}, "session.audio.output.bogus"),
    ({"type": "session.update", "session": {"audio": {"input": {"bogus": 1}}}}, "session.audio.input.bogus"),
    ({"type": "session.update", "session": {"audio": {"output": {"speed": 2.0}}}}, "session.audio.output.speed"),
    ({"type": "session.update", "session": {"mstar": {"bogus": 1}}}, "session.mstar.bogus"),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}, "session.tools"),
    ({"type": "session.update", "session": {"tool_choice": "required"}}, "session.tool_choice"),
    ({"type": "session.update", "session": {"truncation": {"type": "retention_ratio"}}}, "session.truncation"),
    ({"type": "session.update", "session": {"tracing": "auto"}}, "session.tracing"),
    ({"type": "session.update", "session": {"reasoning": {"effort": "low"}}}, "session.reasoning"),
    ({"type": "session.update", "session": {"input_audio_transcription": None}}, "session.input_audio_transcription"),
    ({"type": "session.update", "bogus": 1, "session": {"type": "realtime"}}, "bogus"),
    ({"type": "response.create", "bogus": 2}, "bogus"),
    ({"type": "conversation.item.delete", "item_id": "known", "item": {}}, "item"),
    ({"type": "session.update", "session": {"instructions": "be nice"}}, "session.instructions"),
    ({"type": "response.create", "response": {"voice": "zoe"}}, "response.voice"),
    ({"type": "response.create", "response": {"modalities": ["text"]}}, "response.modalities"),
    ({"type": "response.create", "response": {"conversation": "none"}}, "response.conversation"),
    ({"type": "response.create", "response": {"instructions": "be brief"}}, "response.instructions"),
    ({"type": "response.create", "response": {"audio": {"output": {"speed": 1.0}}}}, "response.audio.output.speed"),
    ({"type": "response.create", "response": {"tools": [{"type": "function"}]}}, "response.tools"),
    ({"type": "response.create", "response": 5}, "response"),
    ({"type": "response.create", "response": {"audio": 5}}, "response.audio"),
    ({"type": "response.create", "response": {"audio": {"output": 5}}}, "response.audio.output"),
    ({"type": "response.create", "response": {"audio": {"output": "x"}}}, "response.audio.output"),
    ({"type": "response.create", "response": {"audio": {"output": {"voice": 5}}}}, "response.audio.output.voice"),
    ({"type": "response.create", "response": {"audio": {"output": {"voice": "nobody"}}, "input": [_user("hi")]}},
     "response.audio.output.voice"),
    ({"type": "response.create", "response": {"audio": {"output": {"format": {"type": "audio/pcmu"}}}}},
     "response.audio.output.format"),
    ({"type": "response.create", "response": {"instructions": 5}}, "response.instructions"),
    ({"type": "response.create", "response": {"max_output_tokens": 2**63}}, "response.max_output_tokens"),
    ({"type": "response.create", "response": {"max_output_tokens": 0}}, "response.max_output_tokens"),
    ({"type": "response.create", "response": {"max_output_tokens": True}}, "response.max_output_tokens"),
    ({"type": "response.create", "response": {"max_output_tokens": "infinite"}}, "response.max_output_tokens"),
    ({"type": "response.create", "response": {"output_modalities": [1, "a"]}}, "response.output_modalities[0]"),
    ({"type": "response.create", "response": {"input": "hi"}}, "response.input"),
    ({"type": "response.create", "response": {"input": [5]}}, "response.input[0]"),
    ({"type": "response.create", "response": {"input": [{"type": "function_call"}]}}, "response.input[0].type"),
    ({"type": "response.create", "response": {"input": [{**_user("hi"), "role": "robot"}]}},
     "response.input[0].role"),
    ({"type": "response.create", "response": {"input": [{**_user("hi"), "role": 5}]}}, "response.input[0].role"),
    ({"type": "response.create", "response": {"input": [{"type": "item_reference", "id": 5}]}},
     "response.input[0].id"),
    ({"type": "response.create", "response": {"input": [{"type": "item_reference", "id": "nope"}]}},
     "response.input[0].id"),
    ({"type": "response.create", "response": {"input": [_with("hi")]}}, "response.input[0].content"),
    ({"type": "response.create", "response": {"input": [_with([{"type": "input_text", "text": 5}])]}},
     "response.input[0].content[0].text"),
    ({"type": "response.create", "response": {"input": [_with([{"type": "input_audio", "transcript": 5}])]}},
     "response.input[0].content[0].transcript"),
    ({"type": "response.create", "response": {"input": [_with([5])]}}, "response.input[0].content[0]"),
    # a text longer than the context (2048 tokens), whatever the cap
    ({"type": "response.create", "response": {"input": [_user("hello " * 400)]}}, "response.input"),
    ({"type": "response.create", "response": {"input": [_user("hello " * 400)], "max_output_tokens": 10}},
     "response.input"),
    ({"type": "conversation.item.create", "item": 5}, "item"),
    ({"type": "conversation.item.create", "item": {"type": "function_call"}}, "item.type"),
    ({"type": "conversation.item.create", "item": {**_user("hi"), "role": 5}}, "item.role"),
    ({"type": "conversation.item.create", "item": _with("hi")}, "item.content"),
    ({"type": "conversation.item.create", "item": _with([{"type": "input_text", "text": 5}])},
     "item.content[0].text"),
    ({"type": "conversation.item.create", "item": _with([{"type": "output_audio", "transcript": [5]}])},
     "item.content[0].transcript"),
    ({"type": "conversation.item.create", "item": _with([{"type": "image", "url": "x"}])}, "item.content[0]"),
    ({"type": "conversation.item.create", "item": {**_user("hi"), "id": 5}}, "item.id"),
    ({"type": "conversation.item.create", "item": {**_user("hi"), "id": "known"}}, "item.id"),
    ({"type": "conversation.item.create", "item": _user("hi"), "previous_item_id": 5}, "previous_item_id"),
    ({"type": "conversation.item.create", "item": _user("hi"), "previous_item_id": "nope"}, "previous_item_id"),
    ({"type": "conversation.item.truncate", "item_id": 5, "content_index": 0, "audio_end_ms": 0}, "item_id"),
    ({"type": "conversation.item.truncate", "item_id": "known", "content_index": "0", "audio_end_ms": 0},
     "content_index"),
    ({"type": "conversation.item.truncate", "item_id": "known", "content_index": 0, "audio_end_ms": 1.5},
     "audio_end_ms"),
    ({"type": "conversation.item.truncate", "item_id": "known", "content_index": 0}, "audio_end_ms"),
    ({"type": "conversation.item.truncate", "item_id": "known", "content_index": 0, "audio_end_ms": 0},
     "item_id"),
    ({"type": "conversation.item.delete", "item_id": [5]}, "item_id"),
    ({"type": "conversation.item.delete"}, "item_id"),
    ({"type": "conversation.item.retrieve", "item_id": {}}, "item_id"),
    ({"type": "conversation.item.retrieve", "item_id": "nope"}, "item_id"),
    ({"type": "input_audio_buffer.append", "audio": 5}, "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\0").decode()}, "audio"),
    ({"type": "response.cancel", "response_id": 5}, "response_id"),
    ({"type": "foo.bar"}, "type"),  # an unknown type's refusal still names the client's event_id
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "foo": 1}}}}}, "session.audio.input.turn_detection.foo"),
    ({"type": 5}, "type"),
]


@pytest.mark.parametrize("bad,param", MALFORMED, ids=[f"{e['type']}->{p}" for e, p in MALFORMED])
async def test_a_malformed_event_names_its_param_and_the_socket_goes_on(speech, bad, param) -> None:
    engine, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        await ws.send_json({"type": "conversation.item.create", "item": {**_user("hello"), "id": "known"}})
        await _until(ws, "conversation.item.done")
        await ws.send_json({**bad, "event_id": "ev_bad"})
        ev = await ws.receive_json(timeout=30)
        assert ev["type"] == "error", ev
        assert ev["error"]["type"] == "invalid_request_error", ev
        assert ev["error"]["param"] == param and ev["error"]["event_id"] == "ev_bad", ev
        # the refused event changed nothing, and the session answers the next response
        await ws.send_json({"type": "response.create", "response": {"max_output_tokens": 14}})
        seen: list[dict[str, Any]] = []
        done = await _until(ws, "response.done", seen)
        assert done["response"]["status"] == "incomplete", done
        assert not [e for e in seen if e["type"] == "error"]
        assert any(e["type"] == "response.output_audio.delta" for e in seen)
        await ws.close()


async def test_the_envelopes_refusals_say_what_is_wrong(speech) -> None:
    """A `type` that is not a string is an invalid value, not a missing one; an `event_id` must be a string."""
    engine, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        for bad, code, param in (({"type": 5}, "invalid_value", "type"), ({}, "missing_field", "type"),
                                 ({"type": "response.cancel", "event_id": 7}, "invalid_value", "event_id")):
            await ws.send_json(bad)
            ev = await ws.receive_json(timeout=30)
            assert (ev["type"], ev["error"]["code"], ev["error"]["param"]) == ("error", code, param), ev
        # a value out of its range: the message names the field too, not only `param`
        await ws.send_json({"type": "session.update", "session": {"mstar": {"input_linger_ms": -1}}})
        ev = await ws.receive_json(timeout=30)
        assert ev["error"]["message"].startswith("'session.mstar.input_linger_ms' must be in [0, "), ev
        await ws.close()


async def test_a_plain_request_is_told_to_upgrade(speech) -> None:
    _, url = speech
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/realtime?model=orpheus-tiny") as r:
            assert r.status == 426 and r.headers["Upgrade"] == "websocket"
            assert r.headers["Connection"].lower() == "upgrade"
            body = await r.json()
        assert body["error"]["code"] == "upgrade_required" and "websocket" in body["error"]["message"], body
        # a websocket handshake that is malformed (no key) is not told to upgrade: it gets aiohttp's 400
        headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
        async with http.get(url + "/v1/realtime?model=orpheus-tiny", headers=headers) as r:
            assert r.status == 400, r.status
            error = (await r.json())["error"]
        assert error["code"] == "bad_request" and error["message"].startswith("Handshake error"), error


async def test_the_session_a_client_was_given_may_be_sent_back(speech) -> None:
    """`session.created`'s object as `session.update` (a client that keeps
    the session and sends it back changed): its read-only fields pass; a
    beta field's error says where the GA session keeps it."""
    _, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url.replace("http://", "ws://") + "/v1/realtime?model=orpheus-tiny")
        session = (await ws.receive_json())["session"]
        session["audio"]["output"]["voice"] = "leo"
        session["truncation"] = "disabled"
        session.update(parallel_tool_calls=True, reasoning=None, tracing=None)  # as the openai SDK's model dumps it
        await ws.send_json({"type": "session.update", "session": session})
        updated = (await _until(ws, "session.updated"))["session"]
        assert updated["audio"]["output"]["voice"] == "leo" and updated["truncation"] == "disabled"
        await ws.send_json({"type": "session.update", "session": {"voice": "leo"}})
        error = (await _until(ws, "error"))["error"]
        assert error["code"] == "unknown_parameter" and "session.audio.output.voice" in error["message"]
        await ws.close()


async def test_every_client_event_has_its_fields_listed() -> None:
    assert set(known_fields.EVENT) == CLIENT_EVENTS


async def test_a_beta_fields_error_names_where_the_ga_api_keeps_it_and_metadata_comes_back(speech) -> None:
    _, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        for response, where in (({"speed": 1.0}, "session.audio.output.speed"),
                                ({"voice": "leo"}, "response.audio.output.voice")):
            await ws.send_json({"type": "response.create", "response": response})
            error = (await _until(ws, "error"))["error"]
            assert error["code"] == "unknown_parameter" and f"'{where}'" in error["message"], error
        await ws.send_json({"type": "response.create", "response": {
            "input": [_user("hello")], "max_output_tokens": 14, "metadata": {"topic": "greeting"}}})
        created = (await _until(ws, "response.created"))["response"]
        done = (await _until(ws, "response.done"))["response"]
        assert created["metadata"] == done["metadata"] == {"topic": "greeting"}
        await ws.close()


async def test_a_message_over_the_limit_closes_with_1009_and_a_reason(speech) -> None:
    _, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        await ws.send_str("x" * (MAX_MESSAGE_BYTES + 2**20))
        msg = await ws.receive(timeout=30)
        assert msg.type == aiohttp.WSMsgType.CLOSE, msg
        assert msg.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG and str(MAX_MESSAGE_BYTES) in msg.extra
    async with aiohttp.ClientSession() as http:  # the server goes on
        ws = await _socket(http, url)
        await ws.close()


async def _response(ws: aiohttp.ClientWebSocketResponse, session: dict[str, Any], response: dict[str, Any],
                    ) -> dict[str, Any]:
    if session:
        await ws.send_json({"type": "session.update", "session": session})
        await _until(ws, "session.updated")
    await ws.send_json({"type": "response.create", "response": {"input": [_user("hello world")], **response}})
    return await _until(ws, "response.done")


@pytest.mark.parametrize("session,response", [({"max_output_tokens": SHORT}, {}),
                                              ({}, {"max_output_tokens": SHORT})], ids=["session", "response"])
async def test_a_response_cut_by_max_output_tokens_is_incomplete(speech, session, response) -> None:
    engine, url = speech
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        done = (await _response(ws, session, response))["response"]
        assert done["usage"]["output_tokens"] == SHORT
        assert done["status"] == "incomplete"
        assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
        assert done["output"][0]["status"] == "incomplete"
        await ws.close()


@pytest.mark.parametrize("response", [{}, {"max_output_tokens": 1000}], ids=["model-default", "response-cap"])
async def test_a_cap_larger_than_the_room_the_text_leaves_is_a_ceiling(speech, response) -> None:
    """Orpheus's default budget (1200 tokens) and a response's cap are
    ceilings: a text that leaves less room in the context (2048) gets an
    answer within that room, not an error."""
    engine, url = speech
    text = "hello " * 300
    prompt = engine.model.prepare(GenerateRequest("r", "orpheus-tiny", {"text": text})).num_prompt_tokens
    room = engine.model.max_model_len - prompt
    assert room < 1000 < DEFAULT_MAX_TOKENS
    async with aiohttp.ClientSession() as http:
        ws = await _socket(http, url)
        await ws.send_json({"type": "response.create", "response": {"input": [_user(text)], **response}})
        seen: list[dict[str, Any]] = []
        done = (await _until(ws, "response.done", seen))["response"]
        assert not [e for e in seen if e["type"] == "error"], seen
        assert done["status"] in ("completed", "incomplete"), done
        assert done["usage"]["input_tokens"] == prompt
        assert 0 < done["usage"]["output_tokens"] <= room
        await ws.close()


async def _stopped_mid_answer(http: aiohttp.ClientSession, url: str,
                              stop: Callable[[aiohttp.ClientWebSocketResponse], Awaitable[None]]) -> dict[str, Any]:
    """A long answer stopped by `stop` after its third audio delta: its response.done's response, checked to
    count at least the tokens of the frames sent (7 a frame of 2,048 samples; more were sampled than heard)."""
    ws = await _socket(http, url)
    await ws.send_json({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 1000}})
    await ws.send_json({"type": "response.create", "response": {"input": [_user("a long answer")]}})
    seen: list[dict[str, Any]] = []
    for _ in range(3):
        await _until(ws, "response.output_audio.delta", seen)
    await stop(ws)
    done = (await _until(ws, "response.done", seen))["response"]
    frames = sum(len(base64.b64decode(e["delta"])) for e in seen if e["type"] == "response.output_audio.delta")
    assert frames % 4096 == 0 and frames > 0
    assert 7 * frames // 4096 <= done["usage"]["output_tokens"] < 1000
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]
    await ws.close()
    return done


async def test_a_cancelled_response_counts_the_tokens_sampled(speech, monkeypatch: pytest.MonkeyPatch) -> None:
    from mstar.http.realtime import response as response_module
    monkeypatch.setattr(response_module, "SETTLE_S", 20.0)  # the count comes within a step: before _until's 30 s
    _, url = speech
    async with aiohttp.ClientSession() as http:
        done = await _stopped_mid_answer(http, url, lambda ws: ws.send_json({"type": "response.cancel"}))
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"


@pytest.mark.parametrize("how", ["timeout", "abort"])
async def test_a_response_the_server_stops_fails_and_counts_the_tokens_sampled(
        speech, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine's own endings of a running request: its deadline (--request-timeout) and the abort its drain
    # sends at shutdown; neither is the client's cancel
    from mstar.http.realtime import response as response_module
    monkeypatch.setattr(response_module, "SETTLE_S", 20.0)
    engine, url = speech

    async def stop(_: aiohttp.ClientWebSocketResponse) -> None:
        (request_id,) = list(engine._states)
        (engine._expire if how == "timeout" else engine.abort)(request_id)
    async with aiohttp.ClientSession() as http:
        done = await _stopped_mid_answer(http, url, stop)
    assert done["status"] == "failed", done
    error = done["status_details"]["error"]
    assert error["code"] == {"timeout": "timeout", "abort": "aborted"}[how] and error["message"]


async def test_a_cancelled_text_answer_counts_no_audio_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A text model's cancelled response: the tokens sampled past the deltas sent are text, not audio."""
    from mstar.http.realtime import response as response_module
    monkeypatch.setattr(response_module, "SETTLE_S", 20.0)
    async with running_engine("tiny-llama") as engine, serving(engine) as url, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url.replace("http://", "ws://") + "/v1/realtime?model=tiny-llama")
        assert (await ws.receive_json())["type"] == "session.created"
        await ws.send_json({"type": "session.update", "session": {"mstar": {"seed": 7}}})
        await ws.send_json({"type": "response.create",
                            "response": {"max_output_tokens": 1000, "input": [_user("a long answer")]}})
        for _ in range(3):
            await _until(ws, "response.output_text.delta")
        await ws.send_json({"type": "response.cancel"})
        done = (await _until(ws, "response.done"))["response"]
        await ws.close()
    assert done["status"] == "cancelled"
    usage = done["usage"]
    assert usage["output_token_details"] == {"text_tokens": usage["output_tokens"], "audio_tokens": 0}, usage
