"""The Python SDK of an mstar server: calls in, typed results and streams out.

    from mstar.client import Client
    with Client("http://127.0.0.1:8000") as client:
        print(client.completions("Hello", max_tokens=8).text)
        audio = client.speech("Hello there.", voice="tara")
        for pcm in audio:
            ...                                 # PCM16 chunks as they arrive
        audio.collect().to_wav("hello.wav")

`AsyncClient` is the same with `await` (aiohttp on the caller's loop);
`Client` runs it on a private loop thread, so it also works in Jupyter.
Importable without torch: nothing here imports the rest of mstar (the layer
test checks it).

Modules: `async_client` and `client` (the clients), `results` (answers and
chunks as dataclasses), `sampling` (the sampling options), `audio`
(`Speech`, WAV), `streams` (streamed answers), `events` (SSE and NDJSON
decoding), `errors` (`MstarError`), `loop_thread`.
`realtime`: a session on the `/v1/realtime` websocket (`client.realtime()`).
"""

from mstar.client.async_client import AsyncClient, Prompt
from mstar.client.audio import Speech
from mstar.client.client import Client
from mstar.client.errors import MstarError
from mstar.client.realtime import AsyncRealtimeSession, RealtimeReply, RealtimeSession
from mstar.client.results import ChatAudio, Choice, Completion, Generation, Health, ModelCard, Usage
from mstar.client.sampling import ChatOptions, Sampling, TextSampling
from mstar.client.streams import AsyncSpeechStream, AsyncStream, SpeechStream, Stream

__all__ = ["AsyncClient", "AsyncRealtimeSession", "AsyncSpeechStream", "AsyncStream", "ChatAudio", "ChatOptions",
           "Choice", "Client", "Completion", "Generation", "Health", "ModelCard", "MstarError", "Prompt",
           "RealtimeReply", "RealtimeSession", "Sampling", "Speech", "SpeechStream", "Stream", "TextSampling",
           "Usage"]
