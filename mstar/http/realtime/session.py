"""One `/v1/realtime` websocket session: client events in, server events out.

The session holds the conversation (items as the client sees them), the
session config and at most one active response. Every client event is
handled in order by `handle`; what the session says goes through `send`
(one queue, one writer, so events keep their order). A refused event gets an
`error` event and changes nothing.

A response of a speech model is one engine request on the `speak` walk that
takes more input: user text that arrives while it runs is appended to the
same request (`Engine.append`) and spoken after what is queued, on the same
KV cache. When the model has spoken everything it was given, the request's
input stays open for `input_linger_ms`, then closes and the response ends.
A response of a model that hears and speaks (Qwen3-Omni) is one request on
its spoken-chat walk over the whole conversation (`conversation.py`): the
user's committed audio turns and text, the assistant's transcripts; it ends
when the model does. Its input audio buffer (`input_audio.py`) takes PCM16
appends; with server VAD on (the default) speech that stops commits a turn
and starts a response, and speech that starts cancels the running one.
With `output_modalities: ["text"]` such a model answers on its chat walk in
text, over the same conversation.
A response of a text model is a chat completion over the conversation,
streamed as `response.output_text.delta`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from mstar.config import MediaLimits
from mstar.engine import audio_resampler
from mstar.errors import MstarError, RequestError
from mstar.http.realtime.conversation import cut_transcripts, heard_parts
from mstar.http.realtime.input_audio import InputAudioBuffer, Turn
from mstar.http.realtime.known_fields import check_event, check_response, check_session
from mstar.http.realtime.planner import ROLES, Planner
from mstar.http.realtime.protocol import ProtocolError, decode_audio, error_event, event, field_of, item_text, new_id
from mstar.http.realtime.response import ActiveResponse
from mstar.http.realtime.settings import SessionConfig
from mstar.http.realtime.vad import VadEvent
from mstar.http.responses import error_type
from mstar.http.submission import SPEAK_WALK, Target
from mstar.types import ModelCard

if TYPE_CHECKING:
    from mstar.engine.engine import Engine

# an item whole at once (a client's, a committed turn): GA's added and done, and the created both APIs send
ITEM_EVENTS = ("conversation.item.added", "conversation.item.created", "conversation.item.done")
# the engine's and the model's names (before any '.' or '[') for what the client gave a response
ENGINE_FIELDS = {"input": "response.input", "prompt": "response.input", "messages": "response.input",
                 "voice": "response.audio.output.voice", "seed": "session.mstar.seed"}


class RealtimeSession:
    def __init__(self, engine: Engine, target: Target, card: ModelCard, send: Callable[[dict[str, Any]], None],
                 limits: MediaLimits | None = None) -> None:
        self.engine = engine
        self.target = target
        self.send = send
        # a model that hears and speaks converses; one that only reads text aloud speaks what it is given
        self.hears = target.spoken_chat_walk is not None and "audio" in target.input_modalities
        self.speaks = self.hears or SPEAK_WALK in target.walks
        self.config = SessionConfig(new_id("sess"), target.name, self.speaks, tuple(card.voices),
                                    (card.voices[0] if card.voices else None), target.max_model_len,
                                    hears=self.hears, names=(card.name, *card.aliases))
        self.buffer = InputAudioBuffer((limits or MediaLimits()).max_audio_seconds, self.config.turn_detection)
        self.heard: dict[str, list[np.ndarray]] = {}  # user item id -> its audio at the model's rate
        self._resample = audio_resampler() if self.hears else None
        self._vad_item: str | None = None  # the item id speech_started announced
        self.items: list[dict[str, Any]] = []
        self.conversation_id = new_id("conv")  # the session's one conversation, which every response joins
        # user items a response took (its input, or appended while it spoke, or refused then): a speech model
        # says the others next, in conversation order, so a deleted or inserted item changes what it says
        self.taken: set[str] = set()
        self.response: ActiveResponse | None = None
        self.audio_ms: dict[str, int] = {}  # item id -> ms of its audio sent (truncation stays within it)
        self.cut_ms: dict[str, int] = {}  # item id -> where it was truncated: a later truncation stays before it
        self.planner = Planner(self)

    def start(self) -> None:
        self.send(event("session.created", session=self.config.to_json()))

    # ------------------------------------------------------------ dispatch

    async def handle(self, obj: dict[str, Any]) -> None:
        """One client event; raises `ProtocolError` for one it refuses."""
        kind = obj["type"]
        check_event(obj)
        handler = getattr(self, "_on_" + kind.replace(".", "_"))
        await handler(obj)

    async def close(self) -> None:
        """The socket closed: end the active response and free what it holds."""
        if self.response is not None:
            self.response.cancel()
            await self.response.wait()

    # -------------------------------------------------------------- session

    async def _on_session_update(self, obj: dict[str, Any]) -> None:
        session = field_of(obj, "session", dict, "")
        check_session(session, speaks_only=self.speaks and not self.hears)
        before = self.config.turn_detection
        self.config.update(session)
        self.send(event("session.updated", session=self.config.to_json()))
        if self.config.turn_detection is not before:
            if self._vad_item is not None:  # a new detector ends the turn the old one announced
                await self._end_announced_turn()
            else:
                self.buffer.detect(self.config.turn_detection)

    # ---------------------------------------------------------------- audio

    async def _on_input_audio_buffer_append(self, obj: dict[str, Any]) -> None:
        self._needs_hearing("audio")  # before the audio's own faults: no audio is taken here at all
        pcm = decode_audio(field_of(obj, "audio", str, ""), "audio")
        for ev in self.buffer.append(pcm):
            await self._on_vad(ev)

    def _needs_hearing(self, param: str | None) -> None:
        """An input buffer event on a model that does not hear is refused (`param`: the field at fault)."""
        if not self.hears:
            raise ProtocolError(f"model '{self.target.name}' takes no audio input; send text with "
                                "conversation.item.create", "audio_input_not_supported", param)

    async def _on_vad(self, ev: VadEvent) -> None:
        """Speech started: the buffer keeps audio from there on, and a running
        response is cut (barge-in); stopped: the turn is committed and
        answered."""
        turns = self.config.turn_detection
        item_id = new_id("item")
        if ev.kind == "started":
            self.buffer.drop_before(ev.ms)
            self._vad_item = item_id
            self.send(event("input_audio_buffer.speech_started", audio_start_ms=ev.ms, item_id=item_id))
            if turns is not None and turns.interrupt_response and self.response is not None:
                resp = self.response
                resp.cancel("turn_detected")
                await resp.wait()
            return
        item_id, self._vad_item = self._vad_item or item_id, None
        self.send(event("input_audio_buffer.speech_stopped", audio_end_ms=ev.ms, item_id=item_id))
        try:
            turn = self.buffer.commit(ev.ms)
        except ProtocolError as e:  # too short to be a turn: said, so a client waiting on its item need not
            self.send(error_event(ProtocolError(f"the turn {item_id} was not committed: {e.message}", e.code)))
            return
        await self._commit(turn, item_id)
        if turns is not None and turns.create_response and self.response is None:
            await self._on_response_create({"type": "response.create"})

    async def _on_input_audio_buffer_commit(self, obj: dict[str, Any]) -> None:
        self._needs_hearing(None)
        if self._vad_item is not None:  # mid-speech: the turn server VAD announced ends here
            await self._end_announced_turn()
            return
        await self._commit(self.buffer.commit(), new_id("item"))

    async def _end_announced_turn(self) -> None:
        """The turn speech_started announced ends where the buffer does, as if
        the VAD had heard it stop: stopped, committed under its item id (a
        client pairs the two), answered if the session's detection says so."""
        self.buffer.detect(self.config.turn_detection)  # the detector's turn in progress is over
        await self._on_vad(VadEvent("stopped", self.buffer.ms(self.buffer.received)))

    async def _commit(self, turn: Turn, item_id: str) -> None:
        """A committed turn becomes a user item: `committed`, then the item's
        `added` and `done`."""
        assert self._resample is not None
        clip = await turn.for_model(self._resample)
        previous = self.items[-1]["id"] if self.items else None
        item = {"id": item_id, "type": "message", "object": "realtime.item", "role": "user",
                "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}
        self.items.append(item)
        self.heard[item_id] = [clip]
        self.send(event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        for kind in ITEM_EVENTS:
            self.send(event(kind, previous_item_id=previous, item=item))

    async def _on_input_audio_buffer_clear(self, obj: dict[str, Any]) -> None:
        self.buffer.clear()
        self._vad_item = None  # the turn it announced is gone with the audio
        self.send(event("input_audio_buffer.cleared"))

    # --------------------------------------------------------- conversation

    async def _on_conversation_item_create(self, obj: dict[str, Any]) -> None:
        item = dict(field_of(obj, "item", dict, ""))
        kind = item.get("type", "message")
        if kind != "message":
            raise ProtocolError(f"item type {kind!r} is not supported (only 'message')", "unsupported_item_type",
                                "item.type")
        role = field_of(item, "role", str, "item")
        if role not in ROLES:
            raise ProtocolError(f"'item.role' must be one of {', '.join(ROLES)}", "invalid_value", "item.role")
        clips: list[np.ndarray] = []
        if self.hears:
            parts = heard_parts(item, "item")
            text = "".join(p for p in parts if isinstance(p, str))
            for pcm in (p for p in parts if isinstance(p, bytes)):
                assert self._resample is not None
                clips.append(await Turn(pcm, 0, 0).for_model(self._resample))
            # the item as echoed and kept: its audio is held apart, not sent back
            item["content"] = [{**({"transcript": None} if part.get("type") == "input_audio" else {}),
                                **{k: v for k, v in part.items() if k != "audio"}} for part in item["content"]]
        else:
            text = item_text(item, "item")
        previous = field_of(obj, "previous_item_id", str, "", required=False)
        index = len(self.items)
        if previous == "root":
            index = 0
        elif previous is not None:
            index = self.index_of(previous, "previous_item_id") + 1
        field_of(item, "id", str, "item", required=False)
        if any(i["id"] == item.get("id") for i in self.items):
            raise ProtocolError(f"an item with id '{item['id']}' exists already", "duplicate_item_id", "item.id")
        item.setdefault("id", new_id("item"))
        item.update(type="message", object="realtime.item", status="completed")
        self.items.insert(index, item)
        if clips:
            self.heard[item["id"]] = clips
        before = self.items[index - 1]["id"] if index > 0 else None
        for kind in ITEM_EVENTS:
            self.send(event(kind, previous_item_id=before, item=item))
        if role == "user" and text.strip():
            self._user_text(item, text)

    def _user_text(self, item: dict[str, Any], text: str) -> None:
        """A user item's text: into the running speech response if there is
        one (an error event if it can not take it: the item stays in the
        conversation, unspoken), else left for the next response
        (`unanswered`)."""
        resp = self.response
        if self.hears or not self.speaks or resp is None or not resp.more_input_open:
            return  # the next response reads it from the conversation
        self.taken.add(item["id"])
        try:
            resp.append(text)
        except RequestError as e:
            raise ProtocolError(e.message, e.code or "invalid_request", "item.content") from None

    def unanswered(self) -> list[tuple[str, str]]:
        """(id, text) of the user items with text that no response has spoken, in conversation order."""
        texts = [(i["id"], item_text(i, "item")) for i in self.items
                 if i.get("role") == "user" and i["id"] not in self.taken]
        return [(item_id, text) for item_id, text in texts if text.strip()]

    async def _on_conversation_item_truncate(self, obj: dict[str, Any]) -> None:
        item_id = field_of(obj, "item_id", str, "")
        index = self.index_of(item_id, "item_id")
        content_index = field_of(obj, "content_index", int, "")
        audio_end_ms = field_of(obj, "audio_end_ms", int, "")
        item = self.items[index]
        if item.get("role") != "assistant" or not self.speaks:
            raise ProtocolError("only an assistant item with audio can be truncated", "invalid_value", "item_id")
        if content_index != 0 or audio_end_ms < 0:
            raise ProtocolError("'content_index' must be 0 and 'audio_end_ms' >= 0", "invalid_value",
                                "audio_end_ms" if content_index == 0 else "content_index")
        resp = self.response
        sent = resp.audio_ms if resp is not None and resp.item["id"] == item_id else self.audio_ms.get(item_id, 0)
        cut = self.cut_ms.get(item_id, sent)
        if audio_end_ms > cut:
            where = f"past where this item was truncated before ({cut} ms)" if cut < sent else \
                f"past the {sent} ms of audio sent for this item"
            raise ProtocolError(f"audio_end_ms {audio_end_ms} is {where}", "invalid_value", "audio_end_ms")
        if resp is not None and resp.item["id"] == item_id:
            resp.cancel()  # the client stopped playing it: nothing more of it is wanted
            await resp.wait()
            sent = self.audio_ms.get(item_id, sent)
        self.cut_ms[item_id] = audio_end_ms
        # the text the listener did not hear leaves the context (OpenAI's truncate deletes it too)
        cut_transcripts(item, audio_end_ms / sent if sent else 0.0)
        self.send(event("conversation.item.truncated", item_id=item_id, content_index=0,
                              audio_end_ms=audio_end_ms))

    async def _on_conversation_item_delete(self, obj: dict[str, Any]) -> None:
        item_id = field_of(obj, "item_id", str, "")
        index = self.index_of(item_id, "item_id")
        if self.response is not None and self.response.item["id"] == item_id:
            raise ProtocolError("the item of the active response cannot be deleted", "invalid_value", "item_id")
        del self.items[index]
        self.taken.discard(item_id)
        self.send(event("conversation.item.deleted", item_id=item_id))

    async def _on_conversation_item_retrieve(self, obj: dict[str, Any]) -> None:
        item_id = field_of(obj, "item_id", str, "")
        self.send(event("conversation.item.retrieved", item=self.items[self.index_of(item_id, "item_id")]))

    def index_of(self, item_id: Any, param: str) -> int:
        for i, item in enumerate(self.items):
            if item["id"] == item_id:
                return i
        raise ProtocolError(f"no item with id '{item_id}' in the conversation", "item_not_found", param)

    # ------------------------------------------------------------ responses

    async def _on_response_create(self, obj: dict[str, Any]) -> None:
        if self.response is not None:
            raise ProtocolError(f"response '{self.response.id}' is still in progress; cancel it or wait for "
                                "response.done", "conversation_already_has_active_response")
        params = field_of(obj, "response", dict, "", required=False) or {}
        check_response(params, speaks_only=self.speaks and not self.hears)
        metadata = field_of(params, "metadata", dict, "response", required=False)
        limit, limit_param = self.planner.limit(params)
        try:
            plan = dataclasses.replace(await self.planner.plan(params, limit), metadata=metadata)
            await self.engine.admit()
            stream = self.engine.submit(plan.request, plan.prepared)
        except RequestError as e:  # the type an HTTP answer of its status has (a full line's 429, a 503)
            raise ProtocolError(e.message, e.code or "invalid_request", _param(e.field, limit_param),
                                kind=error_type(e.status)) from None
        except MstarError as e:
            raise ProtocolError(str(e), "server_error", kind="server_error") from None
        self.taken.update(plan.answers)
        self.response = ActiveResponse(self, plan, stream)
        self.items.append(self.response.item)
        self.response.start(on_done=self._response_done)

    def _response_done(self, resp: ActiveResponse) -> None:
        self.audio_ms[resp.item["id"]] = resp.audio_ms
        if self.response is resp:
            self.response = None

    async def _on_response_cancel(self, obj: dict[str, Any]) -> None:
        resp = self.response
        wanted = field_of(obj, "response_id", str, "", required=False)
        if resp is None or (wanted is not None and wanted != resp.id):
            raise ProtocolError("there is no active response to cancel" if resp is None else
                                f"response '{wanted}' is not the active one", "response_cancel_not_active",
                                "response_id" if wanted is not None else None)
        resp.cancel()
        await resp.wait()


def _param(field: str | None, limit_param: str | None) -> str | None:
    """The realtime name of a field the engine or the model refused."""
    if field is None:
        return None
    # a limit the client did not set is the model's default: then the text is what does not fit
    renamed = {**ENGINE_FIELDS, "max_tokens": limit_param or "response.input"}
    return renamed.get(field.split(".")[0].split("[")[0], field)
