"""`mstar.client`'s chat with a spoken answer, against qwen3-omni-tiny on CPU:
`modalities` and `audio` go to the server, and each choice gives back the
answer's audio (its id, PCM16 or the encoded file, the transcript), whole
or as the streamed pieces, which join to the same answer for a seeded
request. Without them a choice has no audio."""

from __future__ import annotations

import io
import wave
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from http_support import running_engine, serving

from mstar.client import AsyncClient

pytestmark = pytest.mark.asyncio(loop_scope="module")

HELLO = [{"role": "user", "content": "Say hello."}]
SPOKEN = {"modalities": ["text", "audio"], "max_tokens": 4, "seed": 7, "ignore_eos": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni_url() -> AsyncIterator[str]:
    async with running_engine("qwen3-omni-tiny", 512) as engine, serving(engine) as url:
        yield url


async def test_chat_choices_carry_the_spoken_answer(omni_url: str) -> None:
    async with AsyncClient(omni_url, timeout=120) as c:
        whole = await c.chat(HELLO, audio={"voice": "ethan", "format": "wav"}, **SPOKEN)
        [choice] = whole.choices
        assert choice.audio is not None and choice.audio.id.startswith("audio_")
        assert choice.audio.transcript and choice.audio.expires_at
        with wave.open(io.BytesIO(choice.audio.data)) as w:
            assert w.getframerate() == 24_000 and w.getnframes() > 0
            pcm = w.readframes(w.getnframes())

        stream = await c.chat(HELLO, audio={"voice": "ethan", "format": "pcm16"}, stream=True, **SPOKEN)
        pieces = [ch.audio for chunk in [chunk async for chunk in stream] for ch in chunk.choices if ch.audio]
        assert {p.id for p in pieces} == {pieces[0].id}  # one answer's id on every piece
        assert b"".join(p.data for p in pieces) == pcm
        assert "".join(p.transcript for p in pieces) == choice.audio.transcript

        text = await c.chat(HELLO, max_tokens=2)
        assert text.choices[0].audio is None
