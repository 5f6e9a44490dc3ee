"""A session on the server's `/v1/realtime` websocket: client events out,
server events (plain dicts, the OpenAI Realtime GA shapes) in.

    async with AsyncClient(url) as client:
        async with await client.realtime(model="orpheus-tiny", voice="tara") as rt:
            reply = await rt.speak("Hello there.")       # audio until response.done
            reply.to_wav("hello.wav")

`speak` is the common case; for more control, `say` adds a user message (while
a speech response runs, the server appends it to that response), `respond`
starts a response, `cancel` stops it (barge-in), and `events()` yields every
server event. A model that hears (Qwen3-Omni) takes audio: `append_audio`,
`commit_audio` and `clear_audio` drive the input buffer; `stream_audio`
sends a WAV file or an array in 100 ms chunks at real time (or faster), and
with the server's VAD on (its default) the turn is committed and answered
when the speaker stops; `until("input_audio_buffer.speech_stopped")` waits
for such an event:

    async with await client.realtime(model="qwen3-omni-tiny") as rt:
        await rt.stream_audio("question.wav")
        reply = await rt.reply()                         # the answer the VAD's turn started

`RealtimeSession` is the blocking twin, on the `Client`'s loop thread.

The client's `timeout` bounds each wait for a server event (the first
`session.created`, every event of `events()`, `reply()`, `until()`):
that long without one raises `MstarError` with code `timeout` and leaves
the session open, to wait again or close. A failed or refused connect
raises `MstarError` too, and leaves no socket open.

Events the server does not acknowledge (`append_audio`, `say`) are refused,
if at all, by an `error` event that the next read raises, whatever it waits
for: its `MstarError` names the refused event (`event_type`, `event_id`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import itertools
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Self

import aiohttp

from mstar.client.audio import DEFAULT_SAMPLE_RATE, SAMPLE_WIDTH, Speech
from mstar.client.audio_in import CHUNK_MS, chunks, pcm16_input
from mstar.client.errors import MstarError, connection_error
from mstar.client.handshake import open_websocket
from mstar.client.streams import TRANSPORT_ERRORS

if TYPE_CHECKING:
    from mstar.client.loop_thread import LoopThread

UNSET: Any = object()  # a session field `update` leaves as it is
SENT_KEPT = 4096  # event types kept by id: a refusal comes within a few events of its own
END_S = 30.0  # seconds `speak` waits for the response it gives up on to end, when the client has no timeout


@dataclass
class RealtimeReply:
    """One response as it ended: its status, the audio (PCM16, 24 kHz) or
    text, the transcript, the usage, and the time from `response.create` to
    the first audio or text delta (measured here)."""

    response_id: str
    status: str
    audio: bytes = b""
    text: str = ""
    transcript: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    first_delta_s: float | None = None
    elapsed_s: float = 0.0

    def speech(self) -> Speech:
        return Speech(self.audio, "pcm", DEFAULT_SAMPLE_RATE, 1, self.first_delta_s, self.elapsed_s)

    def to_wav(self, target: Any) -> None:
        self.speech().to_wav(target)


@dataclass
class _Gathered:
    """What a reply's events brought so far: kept across a wait that timed
    out, so reading on gives the whole answer."""

    started: float
    audio: bytearray = field(default_factory=bytearray)
    text: list[str] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    first: float | None = None
    response_id: str | None = None  # from its response.created


class AsyncRealtimeSession:
    """Open with `await AsyncClient.realtime(...)`; close with `aclose()` or
    `async with`. Closing aborts whatever response is running."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session: dict[str, Any],
                 timeout: float | None = None) -> None:
        self.ws = ws
        self.session = session  # the latest session object the server sent
        self.timeout = timeout  # seconds each wait for a server event may take; None: forever
        self._gathered: _Gathered | None = None  # the reply being read, until its response.done
        # the type of each event sent, by the event_id the server's refusal of it names: an error read while
        # waiting for something else (an append refused, read by the next update) says what it refused
        self._sent: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._count = itertools.count(1)
        self._backlog: collections.deque[dict[str, Any]] = collections.deque()  # events read ahead, to read again
        self._quiet: set[str] = set()  # event_ids of this client's own cancels: their refusals are no news

    @classmethod
    async def connect(cls, http: aiohttp.ClientSession, url: str, *, timeout: float | None = None,
                      **update: Any) -> AsyncRealtimeSession:
        """The session at `url` once the server created it and took `update`."""
        rt = cls(await open_websocket(http, url, timeout), {}, timeout)
        try:
            first = await rt._next()
            if first is None:
                raise MstarError("the websocket closed before session.created", code="connection_error")
            if first.get("type") != "session.created":
                raise MstarError(f"expected session.created, got {first.get('type')!r}", code="protocol_error")
            rt.session = first["session"]
            if update:
                await rt.update(**update)
        except BaseException:
            # a session the caller never gets must not stay open on either side
            await rt.aclose()
            raise
        return rt

    async def aclose(self) -> None:
        await self.ws.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # ---------------------------------------------------------- events out

    async def send(self, event: dict[str, Any]) -> str:
        """Any client event, as is; one without an `event_id` gets one. Its event_id."""
        if "event_id" not in event:
            event = {**event, "event_id": f"sdk_{next(self._count)}"}
        self._sent[str(event["event_id"])] = str(event.get("type"))
        if len(self._sent) > SENT_KEPT:
            self._sent.popitem(last=False)
        try:
            await self.ws.send_json(event)
        except TRANSPORT_ERRORS as e:  # the socket is closed, or its connection was cut
            raise connection_error(e) from e
        return str(event["event_id"])

    async def update(self, *, voice: str | None = None, instructions: str | None = None,
                     max_output_tokens: int | str | None = None, input_linger_ms: int | None = None,
                     seed: int | None = None, turn_detection: dict[str, Any] | None = UNSET) -> dict[str, Any]:
        """`session.update`; returns the session as the server now has it.
        `turn_detection`: `{"type": "server_vad", ...}` or None (off: commit
        yourself). `input_linger_ms` and `seed` are mstar's own fields (how
        long a speech response waits for more text; reproducible draws)."""
        session: dict[str, Any] = {"type": "realtime"}
        if voice is not None:
            session.setdefault("audio", {})["output"] = {"voice": voice}
        if turn_detection is not UNSET:
            session.setdefault("audio", {})["input"] = {"turn_detection": turn_detection}
        if instructions is not None:
            session["instructions"] = instructions
        if max_output_tokens is not None:
            session["max_output_tokens"] = max_output_tokens
        ext = {k: v for k, v in (("input_linger_ms", input_linger_ms), ("seed", seed)) if v is not None}
        if ext:
            session["mstar"] = ext
        await self.send({"type": "session.update", "session": session})
        self.session = (await self.until("session.updated"))["session"]
        return self.session

    async def say(self, text: str, role: str = "user") -> None:
        """Add a message; a speech response that is running speaks it next."""
        await self.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}})

    async def respond(self, **response: Any) -> str:
        """`response.create` (fields of its `response` object as keywords); its event_id."""
        return await self.send({"type": "response.create", **({"response": response} if response else {})})

    async def cancel(self) -> None:
        await self.send({"type": "response.cancel"})

    async def truncate(self, item_id: str, audio_end_ms: int) -> None:
        await self.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                         "audio_end_ms": audio_end_ms})

    async def append_audio(self, pcm16: bytes) -> None:
        """24 kHz mono PCM16 into the input buffer."""
        await self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode("ascii")})

    async def commit_audio(self) -> None:
        """The buffer as a user turn (needed only with turn detection off)."""
        await self.send({"type": "input_audio_buffer.commit"})

    async def clear_audio(self) -> None:
        await self.send({"type": "input_audio_buffer.clear"})

    async def stream_audio(self, source: str | os.PathLike[str] | BinaryIO | Any, rate: int | None = None,
                           speed: float = 1.0, chunk_ms: int = CHUNK_MS) -> int:
        """Send a WAV file or an array of samples at `rate` Hz (see
        `pcm16_input`) in `chunk_ms` pieces, `speed` times real time (0: as
        fast as the socket takes them), as a microphone would; the
        milliseconds sent."""
        pcm = await asyncio.to_thread(pcm16_input, source, rate)
        started = time.perf_counter()
        sent = 0
        for piece in chunks(pcm, chunk_ms):
            await self.append_audio(piece)
            sent += len(piece)
            if speed > 0:
                due = started + sent / (SAMPLE_WIDTH * DEFAULT_SAMPLE_RATE) / speed
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
        return sent * 1000 // (SAMPLE_WIDTH * DEFAULT_SAMPLE_RATE)

    async def until(self, *kinds: str) -> dict[str, Any]:
        """The next server event of one of `kinds` (those before it are
        dropped): `input_audio_buffer.speech_started`, `...committed`, say."""
        async for ev in self.events():
            if ev["type"] in kinds:
                return ev
        raise MstarError(f"the websocket closed before {' or '.join(kinds)}", code="connection_error")

    # ----------------------------------------------------------- events in

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Server events as they come, until the socket closes; an `error`
        event raises `MstarError` (the session stays usable), as does
        `timeout` seconds without an event (code `timeout`)."""
        while (ev := await self._next()) is not None:
            if ev.get("type") == "error":
                err = ev.get("error") or {}
                event_id = err.get("event_id")
                if event_id in self._quiet:  # a cancel `speak` sent found its response over already
                    self._quiet.discard(event_id)
                    continue
                kind = self._sent.get(event_id) if isinstance(event_id, str) else None
                message = err.get("message", "error")
                raise MstarError(f"{kind} ({event_id}) refused: {message}" if kind else message,
                                 code=err.get("code"), param=err.get("param"), type=err.get("type"),
                                 event_id=event_id, event_type=kind)
            yield ev

    async def _next(self) -> dict[str, Any] | None:
        """The next server event as sent (None once the socket is closed)."""
        if self._backlog:
            return self._backlog.popleft()
        return await self._receive()

    async def _receive(self) -> dict[str, Any] | None:
        """The next event from the socket (past any read ahead)."""
        while True:
            try:
                # aiohttp answers pings itself, each resetting this wait: a server that pings is alive
                msg = await self.ws.receive(timeout=self.timeout)
            except TimeoutError:
                raise MstarError(f"no event from the server in {self.timeout} s", code="timeout") from None
            if msg.type == aiohttp.WSMsgType.TEXT:
                try:
                    return msg.json()
                except ValueError as e:
                    raise MstarError(f"a server event is not JSON: {e}", code="invalid_response") from e
            if msg.type == aiohttp.WSMsgType.ERROR:
                raise MstarError(f"the websocket failed: {self.ws.exception()}", code="connection_error")
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                return None

    async def reply(self, started: float | None = None) -> RealtimeReply:
        """Read events up to the running response's `response.done`. A wait
        that timed out (`MstarError` code `timeout`) keeps what came so far:
        calling it again reads on and gives the whole answer."""
        g = self._gathered
        if g is None:
            g = self._gathered = _Gathered(time.perf_counter() if started is None else started)
        async for ev in self.events():
            kind = ev["type"]
            if kind in ("response.output_audio.delta", "response.output_text.delta"):
                g.first = g.first if g.first is not None else time.perf_counter() - g.started
                if kind == "response.output_audio.delta":
                    g.audio += base64.b64decode(ev["delta"])
                else:
                    g.text.append(ev["delta"])
            elif kind == "response.output_audio_transcript.delta":
                g.transcript.append(ev["delta"])
            elif kind == "response.created":
                g.response_id = (ev.get("response") or {}).get("id")
            elif kind == "response.done":
                self._gathered = None
                r = ev["response"]
                return RealtimeReply(r["id"], r["status"], bytes(g.audio), "".join(g.text), "".join(g.transcript),
                                     r.get("usage") or {}, g.first, time.perf_counter() - g.started)
        self._gathered = None
        raise MstarError("the websocket closed before response.done", code="connection_error")

    async def speak(self, text: str, **response: Any) -> RealtimeReply:
        """Say `text` as a user message, start a response and read it to the
        end. A refusal read on the way of another event than its own
        `response.create` (an earlier audio append's, say) raises, as any
        read does, once the response this call started, if the server
        started it, is cancelled and read to its `response.done` (a refusal
        of this call's own create is then no news and is dropped): the
        session is free for the next response. Events read meanwhile that
        are not that response's wait for the next read."""
        await self.say(text)
        started = time.perf_counter()
        create = await self.respond(**response)
        try:
            return await self.reply(started)
        except MstarError as e:
            if e.event_id is not None and e.event_id != create:
                await self._end_response(create)
            raise

    async def _end_response(self, create: str) -> None:
        """Cancel the response `create` started, if the server started it, and
        read up to its `response.done` (or `create`'s refusal), at most the
        client's timeout (else `END_S`). What else is read meanwhile waits for
        the next read; the cancel's own refusal (the response was over) is
        dropped whenever it comes."""
        ours = self._gathered.response_id if self._gathered is not None else None
        self._gathered = None
        self._quiet.add(await self.send({"type": "response.cancel"}))
        try:
            async with asyncio.timeout(self.timeout or END_S):
                while (ev := await self._receive()) is not None:
                    kind = ev.get("type")
                    body = ev.get("response") or {}
                    if kind == "error":
                        event_id = (ev.get("error") or {}).get("event_id")
                        if event_id == create:  # it never started
                            return
                        if event_id in self._quiet:  # the cancel's: the response was over already
                            self._quiet.discard(event_id)
                        else:
                            self._backlog.append(ev)
                    elif kind == "response.created" and ours is None:
                        ours = body.get("id")
                    elif kind == "response.done" and body.get("id") == ours:
                        return
                    elif ours is None or ev.get("response_id") != ours:  # not this response's own output
                        self._backlog.append(ev)
        except (TimeoutError, MstarError):
            return


class RealtimeSession:
    """The blocking twin of `AsyncRealtimeSession` (from `Client.realtime`)."""

    def __init__(self, aio: AsyncRealtimeSession, runner: LoopThread) -> None:
        self.aio = aio
        self._runner = runner

    @property
    def session(self) -> dict[str, Any]:
        return self.aio.session

    def close(self) -> None:
        self._runner.run(self.aio.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def send(self, event: dict[str, Any]) -> str:
        return self._runner.run(self.aio.send(event))

    def update(self, **fields: Any) -> dict[str, Any]:
        return self._runner.run(self.aio.update(**fields))

    def say(self, text: str, role: str = "user") -> None:
        self._runner.run(self.aio.say(text, role))

    def respond(self, **response: Any) -> str:
        return self._runner.run(self.aio.respond(**response))

    def cancel(self) -> None:
        self._runner.run(self.aio.cancel())

    def truncate(self, item_id: str, audio_end_ms: int) -> None:
        self._runner.run(self.aio.truncate(item_id, audio_end_ms))

    def append_audio(self, pcm16: bytes) -> None:
        self._runner.run(self.aio.append_audio(pcm16))

    def commit_audio(self) -> None:
        self._runner.run(self.aio.commit_audio())

    def clear_audio(self) -> None:
        self._runner.run(self.aio.clear_audio())

    def stream_audio(self, source: str | os.PathLike[str] | BinaryIO | Any, rate: int | None = None,
                     speed: float = 1.0, chunk_ms: int = CHUNK_MS) -> int:
        return self._runner.run(self.aio.stream_audio(source, rate, speed, chunk_ms))

    def until(self, *kinds: str) -> dict[str, Any]:
        return self._runner.run(self.aio.until(*kinds))

    def events(self) -> Iterator[dict[str, Any]]:
        return self._runner.iterate(self.aio.events())

    def reply(self) -> RealtimeReply:
        return self._runner.run(self.aio.reply())

    def speak(self, text: str, **response: Any) -> RealtimeReply:
        return self._runner.run(self.aio.speak(text, **response))
