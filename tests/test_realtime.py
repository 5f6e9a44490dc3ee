"""`/v1/realtime` with the official `openai` client (GA events), on CPU:
text in, audio deltas out, `response.done`; cancel mid-response; text
appended while a response speaks; error events for bad events and bad
base64, with the session still usable after them; a closed socket frees
everything; a text model answers in text deltas."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import structlog
from http_support import running_engine, serving
from openai import AsyncOpenAI

from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.http.realtime import routes as realtime_routes
from mstar.http.realtime.conversation import fitted
from mstar.types import GenerateRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

SHORT = 35  # tokens a turn: five frames, four of them played (8192 samples)
FAST = {"type": "realtime", "max_output_tokens": SHORT, "mstar": {"input_linger_ms": 0, "seed": 7}}


def _frames(audio: bytes) -> int:
    assert len(audio) % 4096 == 0  # whole 2048-sample frames
    return len(audio) // 4096


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speech() -> AsyncIterator[tuple[Engine, str]]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield engine, url


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def _until(conn, kind: str, seen: list[Any]) -> Any:
    async for ev in conn:
        seen.append(ev)
        if ev.type == kind:
            return ev
    raise AssertionError(f"the socket closed before {kind}")


def _audio(events: list[Any]) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


async def _settled(engine: Engine) -> None:
    for _ in range(200):
        if engine.pages_in_use() == 0 and engine.num_running() == 0 and len(engine.store) == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"held: {engine.pages_in_use()} pages, {engine.num_running()} requests")


async def test_text_in_audio_out(speech) -> None:
    engine, url = speech
    async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.audio.output.voice == "tara"
        await conn.session.update(session={**FAST, "audio": {"output": {"voice": "leo"}}})
        seen: list[Any] = []
        updated = await _until(conn, "session.updated", seen)
        assert updated.session.audio.output.voice == "leo"
        await conn.conversation.item.create(item=_user("hello world"))
        await conn.response.create()
        done = await _until(conn, "response.done", seen)
    kinds = [e.type for e in seen]
    assert kinds.index("conversation.item.added") < kinds.index("response.created") < kinds.index(
        "response.output_audio.delta") < kinds.index("response.output_audio.done")
    # the assistant's item follows the user's in the conversation, as OpenAI's events say
    user, answer = [e for e in seen if e.type == "conversation.item.added"]
    assert user.item.role == "user" and answer.item.role == "assistant"
    assert user.previous_item_id is None and answer.previous_item_id == user.item.id
    finished = next(e for e in seen if e.type == "conversation.item.done" and e.item.id == answer.item.id)
    assert finished.previous_item_id == user.item.id
    assert done.response.status == "incomplete"  # cut by max_output_tokens
    assert done.response.status_details.reason == "max_output_tokens"
    assert 0 < _frames(_audio(seen)) <= 4  # one turn of five frames plays four
    transcript = next(e for e in seen if e.type == "response.output_audio_transcript.done").transcript
    assert transcript == "hello world"
    assert done.response.usage.output_tokens == SHORT and done.response.usage.input_tokens > 0
    details = done.response.usage.output_token_details  # a speech model writes no text: every token is audio
    assert details is not None and (details.text_tokens, details.audio_tokens) == (0, SHORT)
    assert done.response.output[0].content[0].transcript == "hello world"
    # GA's item content is typed output_audio (the content_part events' part stays "audio")
    assert done.response.output[0].content[0].type == finished.item.content[0].type == "output_audio"
    assert next(e for e in seen if e.type == "response.content_part.done").part.type == "audio"
    # the response joined the session's conversation ("auto"): its id, as OpenAI's GA responses give it
    created_event = next(e for e in seen if e.type == "response.created")
    assert done.response.conversation_id.startswith("conv_")
    assert created_event.response.conversation_id == done.response.conversation_id
    await _settled(engine)


async def test_cancel_mid_response_then_the_session_goes_on(speech) -> None:
    engine, url = speech
    async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 1000})
        seen: list[Any] = []
        await conn.conversation.item.create(item=_user("a long answer"))
        await conn.response.create()
        first = await _until(conn, "response.output_audio.delta", seen)
        await conn.response.cancel()
        done = await _until(conn, "response.done", seen)
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "client_cancelled"
        assert len(_audio(seen)) < 100 * 2048 * 2  # far short of the 1000 tokens it would have said
        await _settled(engine)  # cancelled within a step: pages and tensors are back
        # barge-in: the client heard 40 ms of it
        await conn.conversation.item.truncate(item_id=first.item_id, content_index=0, audio_end_ms=40)
        truncated = await _until(conn, "conversation.item.truncated", seen)
        assert truncated.audio_end_ms == 40
        await conn.session.update(session=FAST)
        await conn.conversation.item.create(item=_user("again"))
        await conn.response.create()
        again = await _until(conn, "response.done", seen)
        assert again.response.status == "incomplete"


async def test_text_appended_mid_response_is_spoken_in_the_same_request(speech) -> None:
    engine, url = speech
    async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": SHORT,
                                           "mstar": {"input_linger_ms": 3000, "seed": 7}})
        seen: list[Any] = []
        await conn.conversation.item.create(item=_user("first part"))
        await conn.response.create()
        await _until(conn, "response.output_audio.delta", seen)
        await conn.conversation.item.create(item=_user("second part"))
        await _until(conn, "conversation.item.done", seen)
        await conn.send({"type": "session.update", "session": {"mstar": {"input_linger_ms": 0}}})
        done = await _until(conn, "response.done", seen)
    responses = {e.response.id for e in seen if e.type == "response.created"}
    assert len(responses) == 1
    assert done.response.status == "incomplete"
    assert 0 < _frames(_audio(seen)) <= 8  # two turns in one response
    assert done.response.usage.output_tokens == 2 * SHORT
    deltas = [e.delta for e in seen if e.type == "response.output_audio_transcript.delta"]
    assert deltas == ["first part", " second part"]
    await _settled(engine)


async def test_a_speech_model_says_the_conversations_unanswered_user_items_in_order(speech) -> None:
    """What a response speaks is the user items no response has taken, as
    the conversation holds them now: a deleted item is not said, an item
    inserted before another is said first, and a text too long for the
    context, once deleted, no longer fails every response."""
    engine, url = speech
    async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session=FAST)
        seen: list[Any] = []
        await _until(conn, "session.updated", seen)

        async def item(text: str, **where: Any) -> str:
            await conn.send({"type": "conversation.item.create", "item": _user(text), **where})
            return (await _until(conn, "conversation.item.done", seen)).item.id

        async def spoken() -> str:
            await conn.response.create()
            done = await _until(conn, "response.done", seen)
            return done.response.output[0].content[0].transcript

        first = await item("first item")
        await item("second item")
        await conn.conversation.item.delete(item_id=first)
        await _until(conn, "conversation.item.deleted", seen)
        assert await spoken() == "second item"
        later = await item("later")
        await item("sooner", previous_item_id=_prior(seen, later))
        assert await spoken() == "sooner later"
        long = await item("hello " * 400)  # more tokens than the context (2048) holds
        await conn.response.create()
        error = await _until(conn, "error", seen)
        assert error.error.code == "context_length_exceeded"
        await conn.conversation.item.delete(item_id=long)
        await _until(conn, "conversation.item.deleted", seen)
        await item("short")
        assert await spoken() == "short"
    await _settled(engine)


async def test_under_auto_truncation_a_text_too_long_to_say_gives_way_to_newer_ones(speech) -> None:
    """A speech model's unspoken text too long for the context fails its response; a newer text then is
    said alone, and the long one, left out, is never offered again. With truncation disabled it stays."""
    engine, url = speech
    for truncation, after in (("auto", "short"), ("disabled", None)):
        async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
            await conn.session.update(session={**FAST, "truncation": truncation})
            seen: list[Any] = []
            await _until(conn, "session.updated", seen)
            for text in ("hello " * 400, "short"):  # more tokens than the context (2048) holds, then a few
                await conn.send({"type": "conversation.item.create", "item": _user(text)})
                await _until(conn, "conversation.item.done", seen)
                await conn.response.create()
                if text == "short" and after is not None:
                    done = await _until(conn, "response.done", seen)
                    assert done.response.output[0].content[0].transcript == after
                else:
                    assert (await _until(conn, "error", seen)).error.code == "context_length_exceeded"
            if after is not None:
                await conn.send({"type": "conversation.item.create", "item": _user("again")})
                await _until(conn, "conversation.item.done", seen)
                await conn.response.create()
                done = await _until(conn, "response.done", seen)
                assert done.response.output[0].content[0].transcript == "again"
    await _settled(engine)


def _prior(seen: list[Any], item_id: str) -> str:
    """The id of the item before `item_id` in the conversation (from its
    `conversation.item.done` event)."""
    return next(e.previous_item_id for e in seen if e.type == "conversation.item.done" and e.item.id == item_id)


async def test_bad_events_get_error_events_and_the_socket_stays(speech) -> None:
    engine, url = speech
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=orpheus-tiny"
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url) as ws:
        assert (await ws.receive_json())["type"] == "session.created"

        async def error_for(message: Any) -> dict[str, Any]:
            await (ws.send_str(message) if isinstance(message, str) else ws.send_json(message))
            ev = await ws.receive_json()
            assert ev["type"] == "error", ev
            return ev["error"]

        assert (await error_for("{not json"))["code"] == "invalid_json"
        assert (await error_for({"type": "no.such.event"}))["code"] == "unknown_event_type"
        # a model that does not hear refuses the buffer before looking at the audio (its base64, its samples)
        for audio in ("***", base64.b64encode(b"\0\0\0").decode(), base64.b64encode(b"\0\0").decode()):
            err = await error_for({"type": "input_audio_buffer.append", "audio": audio, "event_id": "ev1"})
            assert err["code"] == "audio_input_not_supported" and "no audio input" in err["message"], err
            assert err["event_id"] == "ev1"
        err = await error_for({"type": "input_audio_buffer.commit"})  # the same refusal, not "the buffer is empty"
        assert err["code"] == "audio_input_not_supported" and "no audio input" in err["message"]
        assert (await error_for({"type": "response.cancel"}))["code"] == "response_cancel_not_active"
        assert (await error_for({"type": "response.create"}))["code"] == "empty_input"
        err = await error_for({"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}})
        assert err["param"] == "session.audio.output.voice"
        err = await error_for({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad"}}}}})
        assert err["code"] == "unsupported_turn_detection"
        err = await error_for({"type": "conversation.item.create", "item": {"type": "message", "role": "robot",
                                                                              "content": []}})
        assert err["param"] == "item.role"
        err = await error_for({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0,
                               "audio_end_ms": 0})
        assert err["code"] == "item_not_found"
        # still usable: a response runs, and a second create while it runs is refused
        await ws.send_json({"type": "session.update", "session": FAST})
        await ws.send_json({"type": "conversation.item.create", "item": _user("still here")})
        await ws.send_json({"type": "response.create"})
        await ws.send_json({"type": "response.create"})
        kinds, codes = [], []
        while "response.done" not in kinds:
            ev = await ws.receive_json()
            kinds.append(ev["type"])
            if ev["type"] == "error":
                codes.append(ev["error"]["code"])
        assert codes == ["conversation_already_has_active_response"]
        assert "response.output_audio.delta" in kinds
    await _settled(engine)


async def test_closing_the_socket_mid_response_frees_everything(speech) -> None:
    """Freed on the engine, and the session's own close runs to its end (the handler a hang-up cancels
    does not cut it short): its writer stops and it says it closed."""
    engine, url = speech
    with structlog.testing.capture_logs() as logs:
        async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 1000})
            await conn.conversation.item.create(item=_user("talk for a while"))
            await conn.response.create()
            await _until(conn, "response.output_audio.delta", [])
            assert engine.pages_in_use() > 0
        await _settled(engine)
        await _all_closed(logs)


async def _all_closed(logs: list[dict[str, Any]]) -> None:
    """Every session opened in `logs` says it closed, and no close is still running (a session of an earlier
    test may close meanwhile too)."""
    def ids(event: str) -> set[str]:
        return {e["session_id"] for e in logs if e["event"] == event}

    def closing() -> bool:  # a session's close task still running (`routes._close`)
        return any(t.get_name() == "realtime-close" for t in asyncio.all_tasks())
    for _ in range(100):
        if ids("realtime session opened") <= ids("realtime session closed") and not closing():
            break
        await asyncio.sleep(0.05)
    opened = ids("realtime session opened")
    assert opened and opened <= ids("realtime session closed") and not closing()
    # and their writers have stopped
    assert not {t.get_name() for t in asyncio.all_tasks()} & {f"realtime-writer-{s}" for s in opened}


async def test_a_fault_while_closing_a_session_still_closes_it(speech, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session whose response fails to end cleanly is still closed: its writer stops, and the close and the
    fault are logged."""
    engine, url = speech

    async def failing(self) -> None:
        raise RuntimeError("a response that would not end")
    monkeypatch.setattr(realtime_routes.RealtimeSession, "close", failing)
    with structlog.testing.capture_logs() as logs:
        async with _client(url).realtime.connect(model="orpheus-tiny") as conn:
            await conn.session.update(session=FAST)
            await _until(conn, "session.updated", [])
        await _all_closed(logs)
    assert "realtime session's response did not end cleanly" in [e["event"] for e in logs]


async def test_unknown_model_is_refused_before_the_upgrade(speech) -> None:
    _, url = speech
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await http.ws_connect(url.replace("http://", "ws://") + "/v1/realtime?model=nope")
        assert e.value.status == 404


async def test_a_text_model_answers_in_text() -> None:
    async with running_engine("tiny-llama") as engine, serving(engine) as url:
        async with _client(url).realtime.connect(model="tiny-llama") as conn:
            created = await conn.recv()
            assert created.session.output_modalities == ["text"]
            # seeded: unseeded random weights sometimes draw EOS before the cap
            await conn.session.update(session={"type": "realtime", "mstar": {"seed": 7}})
            await conn.conversation.item.create(item=_user("say something"))
            await conn.response.create(response={"max_output_tokens": 12})
            seen: list[Any] = []
            done = await _until(conn, "response.done", seen)
        deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert done.response.usage.output_tokens == 12
        details = done.response.usage.output_token_details
        assert details is not None and (details.text_tokens, details.audio_tokens) == (12, 0)
        assert done.response.status == "incomplete" and done.response.status_details.reason == "max_output_tokens"
        assert deltas and next(e for e in seen if e.type == "response.output_text.done").text == deltas
        assert done.response.output[0].content[0].model_dump(exclude_none=True) == {"type": "output_text",
                                                                                   "text": deltas}


async def test_a_negative_seed_is_an_int64_seed_as_the_http_routes_take_it() -> None:
    """`session.mstar.seed` -1 is echoed as given and draws as the HTTP
    routes' seed -1 does: the engine's 2**63 - 1."""
    async with running_engine("tiny-llama") as engine, serving(engine) as url:
        texts = []
        for seed in (-1, 2**63 - 1, 7):
            async with _client(url).realtime.connect(model="tiny-llama") as conn:
                await conn.recv()
                await conn.session.update(session={"type": "realtime", "mstar": {"seed": seed}})
                updated = await _until(conn, "session.updated", [])
                assert updated.session.model_dump()["mstar"]["seed"] == seed
                await conn.conversation.item.create(item=_user("say something"))
                await conn.response.create(response={"max_output_tokens": 12})
                seen: list[Any] = []
                await _until(conn, "response.done", seen)
                texts.append("".join(e.delta for e in seen if e.type == "response.output_text.delta"))
        assert texts[0] == texts[1] != texts[2]


async def test_a_conversations_next_response_starts_from_the_cached_conversation() -> None:
    """Each response is a request over the conversation so far: its prompt
    starts with the last one's, whose full KV pages the prefix cache holds."""
    async with running_engine("tiny-llama") as engine, serving(engine) as url:
        async with _client(url).realtime.connect(model="tiny-llama") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "mstar": {"seed": 7}})
            first = "tell me a long story about a lighthouse keeper and the ships that pass at night"
            await conn.conversation.item.create(item=_user(first))
            await conn.response.create(response={"max_output_tokens": 8})
            await _until(conn, "response.done", [])
            before = engine.health()["devices"][0]["prefix_cache"]["llm"]
            await conn.conversation.item.create(item=_user("and then?"))
            await conn.response.create(response={"max_output_tokens": 8})
            await _until(conn, "response.done", [])
            after = engine.health()["devices"][0]["prefix_cache"]["llm"]
        # the first prompt's full pages (16 tokens each) at least: the first message alone fills four
        assert after["hits"] - before["hits"] >= 4 * 16
        await _settled(engine)


async def test_a_conversation_longer_than_the_context_drops_its_oldest_messages() -> None:
    """Truncation "auto" (OpenAI's default): each response answers over the
    newest messages that fit the context, the instructions kept; with
    truncation "disabled" the context's error stands."""
    async with running_engine("tiny-llama", max_model_len=256) as engine, serving(engine) as url:
        async with _client(url).realtime.connect(model="tiny-llama") as conn:
            created = await conn.recv()
            assert created.session.truncation == "auto"
            await conn.session.update(session={"type": "realtime", "instructions": "be brief",
                                               "mstar": {"seed": 7}})
            seen: list[Any] = []
            prompts = []
            for turn in range(6):
                await conn.conversation.item.create(item=_user(f"turn {turn}: " + "tell me more " * 4))
                await conn.response.create(response={"max_output_tokens": 20})
                done = await _until(conn, "response.done", seen)
                assert done.response.status == "incomplete", done.response
                assert done.response.usage.output_tokens == 20  # its whole limit: truncation left it the room
                prompts.append(done.response.usage.input_tokens)
            assert not [e for e in seen if e.type == "error"]
            # the conversation outgrew 256 tokens, and every prompt still fits with room to answer
            assert max(prompts) <= 256 - 20  # room for each answer's 20 tokens
            assert sum(p >= 120 for p in prompts) >= 3
            # no limit: the conversation is cut to leave a quarter of the context for the answer
            await conn.conversation.item.create(item=_user("and without a limit"))
            await conn.response.create()
            done = await _until(conn, "response.done", seen)
            assert done.response.usage.input_tokens <= 256 - 256 // 4
            await conn.session.update(session={"type": "realtime", "truncation": "disabled"})
            await conn.conversation.item.create(item=_user("once more"))
            await conn.response.create(response={"max_output_tokens": 20})
            error = await _until(conn, "error", seen)
            assert error.error.code == "context_length_exceeded"
        await _settled(engine)


async def test_truncation_leaves_out_the_fewest_oldest_messages() -> None:
    """`conversation.fitted` against a stand-in prepare whose prompt is the
    sum of the messages' sizes: the system message stays, the fewest oldest
    others go, so that the answer has its room (else so that the rest fits)."""
    sizes = {"sys": 10, **{f"m{i}": 30 for i in range(10)}}
    messages = [{"role": "system", "content": "sys"}] + [{"role": "user", "content": f"m{i}"} for i in range(10)]

    class Prepared:
        def __init__(self, n: int) -> None:
            self.num_prompt_tokens = n

    async def prepare(request: GenerateRequest) -> Prepared:
        n = sum(sizes[m["content"]] for m in request.inputs["messages"])
        if n >= 200:
            raise RequestError(f"too long: {n}", code="context_length_exceeded")
        return Prepared(n)

    def make(kept: list[dict[str, Any]]) -> GenerateRequest:
        return GenerateRequest("r", "m", {"messages": kept})

    async def kept(answer: int, truncate: bool = True) -> list[str]:
        request, _, dropped = await fitted(messages, make, prepare, truncate, 200, answer)
        names = [m["content"] for m in request.inputs["messages"]]
        assert len(names) == len(messages) - dropped
        return names

    assert await kept(1) == ["sys"] + [f"m{i}" for i in range(4, 10)]      # 190 tokens: the most that fit
    assert await kept(40) == ["sys"] + [f"m{i}" for i in range(5, 10)]     # 160: 40 left for the answer
    assert await kept(195) == ["sys"] + [f"m{i}" for i in range(4, 10)]    # room for none: the most that fit
    with pytest.raises(RequestError):
        await kept(1, truncate=False)
    only = [messages[0]]  # instructions alone, leaving less than the answer asks: they are the prompt
    request, prepared, dropped = await fitted(only, make, prepare, True, 200, 195)
    assert request.inputs["messages"] == only and dropped == 0
    sizes["m9"] = 250  # the newest alone is longer than the context: its own error (with the system message's 10),
    with pytest.raises(RequestError, match="too long: 260$"):  # not the whole conversation's
        await kept(1)
    with pytest.raises(RequestError, match="too long: 530$"):  # without truncation: the whole conversation's
        await kept(1, truncate=False)
