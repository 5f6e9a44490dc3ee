"""A realtime response while it runs: one engine request's chunks out as the
GA server events (`response.created` ... deltas ... `response.done`).

Audio goes out as `response.output_audio.delta` (base64 PCM16, 24 kHz mono),
the text being spoken as `response.output_audio_transcript.delta` (sent when
it is handed to a model that reads it aloud, or as a model that writes its
own answer writes it), a text model's answer as
`response.output_text.delta`. `cancel` aborts the engine request (the worker
drops it at its next step) and drops audio not sent yet; the response then
ends with status "cancelled".
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import structlog

from mstar.http.realtime.protocol import event, new_id
from mstar.http.submission import ABORTED_MESSAGE
from mstar.types import GenerateRequest, OutputChunk

if TYPE_CHECKING:
    from mstar.engine.engine import Prepared, RequestStream
    from mstar.http.realtime.session import RealtimeSession

log = structlog.get_logger("mstar.realtime")

SAMPLE_RATE = 24_000
SETTLE_S = 1.0  # how long a cancelled response waits for the workers' count of what they sampled


@dataclass(frozen=True)
class ResponsePlan:
    """What `response.create` starts: the engine request and what the
    engine prepared it from, the output modality, and for speech the text it
    says first and the voice."""

    id: str
    request: GenerateRequest
    prepared: Prepared
    modality: str             # "audio" | "text"
    spoken: str | None = None
    voice: str | None = None
    writes_transcript: bool = False  # the model's own text is the transcript of its audio
    answers: tuple[str, ...] = ()    # the ids of the user items whose text it speaks
    metadata: dict[str, Any] | None = None  # the client's, given back on the response object (OpenAI's)


# finish reason -> (status, reason) of response.done; a client's cancel is "cancelled" whatever the chunk says.
# "abort" without one: the server stopped it (its drain at shutdown), so the response failed
_STATUS = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "abort": ("failed", None),
    "timeout": ("failed", None),
    "error": ("failed", None),
}
# a failed response's error code and default message where they are not the finish reason's own (HTTP's too)
_CODES = {"abort": "aborted"}
_MESSAGES = {"abort": ABORTED_MESSAGE}


class ActiveResponse:
    def __init__(self, session: RealtimeSession, plan: ResponsePlan, stream: RequestStream) -> None:
        self.session = session
        self.plan = plan
        self.id = plan.id
        self.stream = stream
        self.audio = plan.modality == "audio"
        self.item: dict[str, Any] = {
            "id": new_id("item"), "type": "message", "object": "realtime.item", "role": "assistant",
            "status": "in_progress", "content": []}
        self.transcript: list[str] = []
        self.audio_bytes = 0
        self.text_tokens = 0  # the answer's text tokens (the rest of its output tokens are audio frames)
        # a response reading text aloud takes more text until it closes its input
        self.more_input_open = self.audio and not plan.writes_transcript
        self.cancelled = False
        self.cancel_reason = "client_cancelled"
        self._linger: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None

    def _previous_id(self) -> str | None:
        """The id of the conversation item before this response's (the
        session put it in the conversation as the response began)."""
        items = self.session.items
        at = next((i for i, item in enumerate(items) if item is self.item), 0)
        return items[at - 1]["id"] if at > 0 else None

    # ------------------------------------------------------------ control

    def start(self, on_done: Callable[[ActiveResponse], None]) -> None:
        """Announce the response, then stream it from a task of its own (text
        appended from now on is announced after these events)."""
        self._on_done = on_done
        self._send("response.created", response=self._response("in_progress"))
        self._send("response.output_item.added", response_id=self.id, output_index=0, item=self.item)
        for kind in ("conversation.item.added", "conversation.item.created"):  # GA's, then the one both APIs send
            self._send(kind, previous_item_id=self._previous_id(), item=self.item)
        self._send("response.content_part.added", part=self._part(False), **self._where())
        if self.audio and self.plan.spoken:
            self._say(self.plan.spoken)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"realtime-{self.id}")

    def append(self, text: str) -> None:
        """More text to speak in this response (raises `RequestError` when the
        engine refuses it)."""
        engine = self.session.engine
        engine.append(self.stream.request_id, {"text": text, "voice": self.plan.voice})
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._say(text)

    def cancel(self, why: str = "client_cancelled") -> None:
        """Stop now: the engine frees the request; audio not sent is dropped.
        `why`: response.done's reason (GA's "turn_detected" for a barge-in)."""
        if self.cancelled:
            return
        self.cancelled = True
        self.cancel_reason = why
        self.more_input_open = False
        if self._linger is not None:
            self._linger.cancel()
        self.session.engine.abort(self.stream.request_id)

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    @property
    def audio_ms(self) -> int:
        """Milliseconds of audio sent to the client so far."""
        return self.audio_bytes * 1000 // (2 * SAMPLE_RATE)

    def _close_input(self) -> None:
        self._linger = None
        self.more_input_open = False
        self.session.engine.close_input(self.stream.request_id)

    # ------------------------------------------------------------- events

    def _send(self, kind: str, **fields: Any) -> None:
        self.session.send(event(kind, **fields))

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item["id"], "output_index": 0, "content_index": 0}

    def _say(self, text: str) -> None:
        piece = text if not self.transcript else " " + text
        self.transcript.append(piece)
        self._send("response.output_audio_transcript.delta", delta=piece, **self._where())

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"object": "realtime.response", "id": self.id, "status": status,
                "output_modalities": [self.plan.modality], "conversation_id": self.session.conversation_id,
                "metadata": self.plan.metadata,
                "output": [self.item] if self.item["content"] or status != "in_progress" else [],
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
                                     "voice": self.plan.voice}} if self.audio else None,
                **extra}

    def _part(self, done: bool) -> dict[str, Any]:
        """The answer's content part as `response.content_part.*` events carry it."""
        if self.audio:
            return {"type": "audio", "transcript": "".join(self.transcript) if done else ""}
        return {"type": "text", "text": "".join(self.transcript) if done else ""}

    # --------------------------------------------------------------- body

    async def _run(self) -> None:
        last: OutputChunk | None = None
        try:
            async for chunk in self.stream:
                last = chunk
                self._chunk(chunk)
                if chunk.finished:
                    break
        except Exception:
            log.exception("realtime response failed", response_id=self.id)
            self.session.engine.abort(self.stream.request_id)
        finally:
            if self._linger is not None:
                self._linger.cancel()
            self.more_input_open = False
            # a chunk that ends a response early cannot count the tokens of a walk that emits audio; with no
            # chunk at all there is no usage to count them into
            early = last is not None and (self.cancelled or last.finish_reason not in ("stop", "length"))
            generated = await self._generated() if early else None
            self._finish(last, generated)
            self._on_done(self)

    def _chunk(self, chunk: OutputChunk) -> None:
        self.text_tokens += len(chunk.token_ids)
        if self.cancelled:
            return  # audio and text not sent yet are dropped
        if chunk.audio:
            self.audio_bytes += len(chunk.audio)
            self._send("response.output_audio.delta", delta=base64.b64encode(chunk.audio).decode("ascii"),
                       **self._where())
        if chunk.text and not self.audio:
            self.transcript.append(chunk.text)
            self._send("response.output_text.delta", delta=chunk.text, **self._where())
        elif chunk.text and self.plan.writes_transcript:
            self.transcript.append(chunk.text)
            self._send("response.output_audio_transcript.delta", delta=chunk.text, **self._where())
        if chunk.awaiting_input and self.more_input_open and self._linger is None:
            linger = self.session.config.input_linger_ms / 1000
            self._linger = asyncio.get_running_loop().call_later(linger, self._close_input)

    async def _generated(self) -> int | None:
        """The tokens the engine sampled before a cancel (or a timeout, an
        error, the server's abort). The ending chunk comes at once and cannot
        know them for a walk that emits audio, not tokens; the workers tell
        within a step."""
        return await self.stream.settled(SETTLE_S)

    def _finish(self, last: OutputChunk | None, generated: int | None) -> None:
        reason = (last.finish_reason if last is not None else None) or "error"
        status, why = ("cancelled", self.cancel_reason) if self.cancelled else _STATUS.get(reason, ("failed", None))
        done_part = self._part(True)
        self.item["status"] = "completed" if status == "completed" else "incomplete"
        # the same part in the assistant item, typed as GA's item content is (the events' part is not)
        self.item["content"] = [{**done_part, "type": f"output_{done_part['type']}"}]
        where = self._where()
        if self.audio:
            self._send("response.output_audio.done", **where)
            self._send("response.output_audio_transcript.done", transcript=done_part["transcript"], **where)
        else:
            self._send("response.output_text.done", text=done_part["text"], **where)
        self._send("response.content_part.done", part=done_part, **where)
        self._send("response.output_item.done", response_id=self.id, output_index=0, item=self.item)
        self._send("conversation.item.done", previous_item_id=self._previous_id(), item=self.item)
        details: dict[str, Any] = {"type": status, "reason": why}
        if status == "failed":
            details["error"] = {"type": "server_error", "code": _CODES.get(reason, reason),
                                "message": (last.error if last is not None else None)
                                or _MESSAGES.get(reason, "the response failed")}
        usage = None
        if last is not None:
            output = max(last.num_output_tokens, generated or 0)
            # a text answer's tokens sampled but never sent (a cancel's) are text too, not audio frames
            text = min(self.text_tokens, output) if self.audio else output
            usage = {"input_tokens": last.num_prompt_tokens, "output_tokens": output,
                     "total_tokens": last.num_prompt_tokens + output,
                     "output_token_details": {"text_tokens": text, "audio_tokens": output - text}}
        self._send("response.done", response=self._response(status, status_details=details, usage=usage))
