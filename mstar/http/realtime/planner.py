"""What a realtime `response.create` asks the engine for.

A `Planner` reads its session's conversation, settings and target and turns
the event's `response` object into a `ResponsePlan`: the engine request,
prepared (tokenised, media decoded) and cut to the context, with what the
response will say it answers. It changes nothing in the session; the session
submits the plan and owns what follows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import structlog

from mstar.http.fields import fold_seed
from mstar.http.realtime.conversation import chat_messages, fitted, heard_parts
from mstar.http.realtime.input_audio import Turn
from mstar.http.realtime.protocol import ProtocolError, check_format, field_of, item_text, new_id, output_limit
from mstar.http.realtime.response import ResponsePlan
from mstar.http.submission import SPEAK_WALK, model_defaults
from mstar.types import REALTIME_PRIORITY, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from mstar.engine.engine import Prepared
    from mstar.http.realtime.session import RealtimeSession

log = structlog.get_logger("mstar.realtime")

ROLES = ("user", "system", "assistant")
UNLIMITED_SHARE = 4  # a response without a limit has at least 1/4 of the context to answer in, under truncation


class Planner:
    def __init__(self, session: RealtimeSession) -> None:
        self.s = session

    def limit(self, params: dict[str, Any]) -> tuple[int | None, str | None]:
        """The response's max_output_tokens and the param that set it; (None,
        None): no limit, the model's default applies."""
        raw = params.get("max_output_tokens")
        if raw is None:
            limit, param = self.s.config.max_output_tokens, "session.max_output_tokens"
        else:
            param = "response.max_output_tokens"
            limit = output_limit(raw, param, self.s.target.max_model_len)
        return limit, (param if limit is not None else None)

    async def plan(self, params: dict[str, Any], limit: int | None) -> ResponsePlan:
        """The engine request a `response.create` starts."""
        answer = self.s.config.check_modalities(params, "response")
        in_text = answer == "text" if answer is not None else self.s.config.text_only
        instructions = field_of(params, "instructions", str, "response", required=False)
        audio = field_of(params, "audio", dict, "response", required=False) or {}
        output = field_of(audio, "output", dict, "response.audio", required=False) or {}
        check_format(output.get("format"), "response.audio.output.format")
        asked_voice = field_of(output, "voice", str, "response.audio.output", required=False)
        given = field_of(params, "input", list, "response", required=False)
        rid = new_id("resp")
        defaults = model_defaults(self.s.engine)
        # no limit: the model's default budget within the room the prompt leaves (`fit_context`)
        seed = self.s.config.seed  # as the client gave it (and the session echoes it); the engine's in [0, 2**63)
        sampling = dataclasses.replace(defaults, max_tokens=None, seed=None if seed is None else fold_seed(seed))
        if self.s.hears:
            return await self._conversation_plan(rid, given, instructions, asked_voice, sampling, limit, in_text)
        texts = self._input_texts(given) if given is not None else None
        if self.s.speaks:
            voice = self.s.config.voice
            if asked_voice is not None:
                voice = self.s.config.check_voice(asked_voice, "response.audio.output.voice")
            pending = self.s.unanswered() if texts is None else []
            said = [t["content"] for t in texts if t["role"] == "user"] if texts is not None \
                else [text for _, text in pending]
            if not " ".join(said).strip():
                raise ProtocolError("there is no text to speak: add a user message (input_text) first",
                                    "empty_input", "response.input")

            def make(kept: list[dict[str, Any]]) -> GenerateRequest:
                return GenerateRequest(rid, self.s.target.name, {"text": " ".join(m["content"] for m in kept),
                                                                 "voice": voice}, sampling,
                                       walk=SPEAK_WALK, more_input=True, priority=REALTIME_PRIORITY)
            # under "auto" truncation the oldest unspoken texts are left out when all of them leave the audio
            # too little room (as a chat's oldest messages are), and count as answered: one text too long for
            # the context must not refuse every later response
            request, prepared, dropped = await fitted(
                [{"role": "user", "content": t} for t in said], make, self.s.engine.prepare,
                self.s.config.truncation == "auto" and texts is None, self.s.target.max_model_len,
                self._answer_room(limit))
            if dropped:
                log.info("unspoken text truncated", session_id=self.s.config.session_id, dropped_items=dropped)
            return ResponsePlan(rid, self._within(request, prepared, limit), prepared, modality="audio",
                                spoken=request.inputs["text"], voice=voice,
                                answers=tuple(item_id for item_id, _ in pending))
        instructions = self.s.config.instructions if instructions is None else instructions
        messages = ([{"role": "system", "content": instructions}] if instructions else [])
        messages += texts if texts is not None else [
            {"role": i["role"], "content": item_text(i, "item")} for i in self.s.items if i.get("type") == "message"]
        if not messages:
            raise ProtocolError("the conversation is empty: add a message first", "empty_input", "response.input")
        # the model tokenises (off the event loop when long); a plain text if there is no chat template
        chat = self.s.target.tokenizer is not None and getattr(self.s.target.tokenizer, "chat_template", None)

        def make(kept: list[dict[str, Any]]) -> GenerateRequest:
            inputs = {"messages": kept} if chat else {"prompt": "\n".join(m["content"] for m in kept)}
            return GenerateRequest(rid, self.s.target.name, inputs, sampling, priority=REALTIME_PRIORITY)

        request, prepared = await self._fitted(messages, make, limit)
        return ResponsePlan(rid, self._within(request, prepared, limit), prepared, modality="text")

    async def _fitted(self, messages: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], GenerateRequest],
                      limit: int | None) -> tuple[GenerateRequest, Prepared]:
        """`make(messages)` prepared, the conversation cut to the context under the session's truncation,
        leaving the answer room for its limit, or without one for the model's default budget (else a quarter
        of the context), at most half the context: a large one keeps the conversation."""
        auto = self.s.config.truncation == "auto"
        request, prepared, dropped = await fitted(messages, make, self.s.engine.prepare, auto,
                                                  self.s.target.max_model_len, self._answer_room(limit))
        if dropped:
            log.info("conversation truncated", session_id=self.s.config.session_id, dropped_messages=dropped)
        return request, prepared

    def _answer_room(self, limit: int | None) -> int:
        """The tokens truncation leaves an answer: its limit, or without one the model's default budget (else a
        quarter of the context), at most half the context."""
        if limit is None:
            limit = model_defaults(self.s.engine).max_tokens or self.s.target.max_model_len // UNLIMITED_SHARE
        return min(limit, self.s.target.max_model_len // 2)

    def _within(self, request: GenerateRequest, prepared: Prepared, limit: int | None) -> GenerateRequest:
        """`request` with the response's limit, a ceiling: it takes what the
        context has room for, up to the limit (the engine samples the
        prepared prompt again with it, without tokenising it again)."""
        if limit is None:
            return request
        room = self.s.target.max_model_len - prepared.num_prompt_tokens
        return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                         max_tokens=min(limit, room)))

    async def _conversation_plan(self, rid: str, given: list[Any] | None, instructions: str | None,
                                 asked_voice: str | None, sampling: SamplingParams,
                                 limit: int | None, in_text: bool = False) -> ResponsePlan:
        """One spoken-chat request over the conversation (or `response.input`'s
        items); `limit` caps the text and the talker's frames alike, as
        OpenAI's counts audio tokens with text ones. `in_text`: the answer is
        the chat walk's text, as a chat completion without audio out gives."""
        voice = self.s.config.voice
        if asked_voice is not None:
            voice = self.s.config.check_voice(asked_voice, "response.audio.output.voice")
        items, heard = (self.s.items, self.s.heard) if given is None else await self._given_items(given)
        instructions = self.s.config.instructions if instructions is None else instructions
        messages = chat_messages(items, heard, instructions)
        if not any(m["role"] == "user" for m in messages):
            raise ProtocolError("the conversation has nothing from the user: commit audio or add a message first",
                                "empty_input", "response.input")
        key = self.s.target.spoken_audio_key
        by: dict[str, dict[str, Any]] = {key: {"max_tokens": limit}} if None not in (limit, key) and not in_text else {}

        def make(kept: list[dict[str, Any]]) -> GenerateRequest:
            inputs = {"messages": kept} if in_text else {"messages": kept, "voice": voice}
            return GenerateRequest(rid, self.s.target.name, inputs, sampling, sampling_by=by,
                                   walk=None if in_text else self.s.target.spoken_chat_walk, priority=REALTIME_PRIORITY)

        request, prepared = await self._fitted(messages, make, limit)
        request = self._within(request, prepared, limit)  # sampled again at submit: its audio is not prepared twice
        if in_text:
            return ResponsePlan(rid, request, prepared, modality="text")
        return ResponsePlan(rid, request, prepared, modality="audio", voice=voice, writes_transcript=True)

    async def _given_items(self, given: list[Any]) -> tuple[list[dict[str, Any]], dict[str, list[np.ndarray]]]:
        """`response.input` for a hearing model: its items (references
        resolved) and their audio by item id."""
        items: list[dict[str, Any]] = []
        heard: dict[str, list[np.ndarray]] = {}
        for i, raw in enumerate(given):
            where = f"response.input[{i}]"
            item, role = self._given_item(raw, where)
            if role is None:  # a reference to a conversation item
                items.append(item)
                heard[item["id"]] = self.s.heard.get(item["id"], [])
                continue
            parts = heard_parts(item, where)
            key = new_id("item")
            assert self.s._resample is not None
            heard[key] = [await Turn(p, 0, 0).for_model(self.s._resample) for p in parts if isinstance(p, bytes)]
            items.append({"id": key, "type": "message", "role": role,
                          "content": [{"type": "input_text", "text": p} for p in parts if isinstance(p, str)]})
        return items, heard

    def _input_texts(self, given: list[Any]) -> list[dict[str, str]]:
        """`response.input`: message items (or references to conversation
        items) as {role, content} pairs."""
        out = []
        for i, raw in enumerate(given):
            where = f"response.input[{i}]"
            item, role = self._given_item(raw, where)
            out.append({"role": role or field_of(item, "role", str, where), "content": item_text(item, where)})
        return out

    def _given_item(self, item: Any, where: str) -> tuple[dict[str, Any], str | None]:
        """One `response.input` entry checked: a message and its role, or the
        conversation item a reference names (role None)."""
        if not isinstance(item, dict):
            raise ProtocolError(f"'{where}' must be an object", "invalid_value", where)
        kind = item.get("type", "message")
        if kind == "item_reference":
            return self.s.items[self.s.index_of(field_of(item, "id", str, where), f"{where}.id")], None
        if kind != "message":
            raise ProtocolError(f"item type {kind!r} is not supported (only 'message' and 'item_reference')",
                                "unsupported_item_type", f"{where}.type")
        role = field_of(item, "role", str, where)
        if role not in ROLES:
            raise ProtocolError(f"'{where}.role' must be one of {', '.join(ROLES)}", "invalid_value", f"{where}.role")
        return item, role
