"""What scripts/loadtest.py sends besides well-formed streams: malformed
bodies with the field the server must name, poisoned requests (one field past
any bound) to send among good neighbours, and the big-prompt probe (/health
polled while a prompt of several MiB is refused)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# sibling module: the script's folder is first on sys.path
from loadtest_checks import SPEECH_ROUTE

# A body that is not JSON at all (bytes) or a JSON value, the route it goes
# to, and the field the server's error must name (its `error.param`).
MALFORMED: tuple[tuple[str, bytes | Any, str], ...] = (
    ("/v1/completions", b"{bad json", "body"),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [', "body"),
    ("/generate", b"\xff\xfe not utf-8", "body"),
    ("/v1/completions", [1, 2, 3], "body"),
    ("/v1/completions", {"prompt": 5, "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 1000}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 3}, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": -3}}, "sampling_params.max_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": 5}, "sampling_params"),
    ("/generate", {"input_ids": ["a"]}, "input_ids"),
)


# One field past any bound (an int64 overflow, were it let through): sent in a
# burst of good requests, it must be the only 4xx and its neighbours complete.
POISONED: tuple[tuple[str, Any, str], ...] = (
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 2**63}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "stop_token_ids": [2**63]}, "stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 3, "top_k": 2**63}}, "sampling_params.top_k"),
)

HEALTH_POLL_S = 0.02
HEALTH_LIMIT_S = 0.1  # /health must answer within this while a big prompt is being refused


@dataclass
class BigPrompt:
    """What the big-prompt probe saw."""

    mib: float
    expect: str = "prompt"   # the field that carries it, which the refusal must name
    status: int = 0
    param: str | None = None
    answer_s: float = 0.0
    health_s: list[float] = field(default_factory=list)  # each /health latency while the prompt was in flight

    def problems(self) -> list[str]:
        out = []
        if not 400 <= self.status < 500 or self.param != self.expect:
            out.append(f"a {self.mib:g} MiB prompt got HTTP {self.status} naming {self.param!r}, not a 4xx "
                       f"naming '{self.expect}'")
        if not self.health_s:
            out.append("/health was never polled while the big prompt was in flight")
        elif max(self.health_s) >= HEALTH_LIMIT_S:
            out.append(f"/health took {max(self.health_s) * 1e3:.0f} ms while a big prompt was refused "
                       f"(limit {HEALTH_LIMIT_S * 1e3:.0f} ms)")
        return out


async def big_prompt(url: str, model: str, mib: float, speech: bool = False) -> BigPrompt:
    """POST a prompt of `mib` MiB to /v1/completions (with `speech`, an input
    to /v1/audio/speech) and poll /health until it is answered. The prompt
    goes from a thread of its own, so that writing it does not hold up this
    loop's polls."""
    seen = BigPrompt(mib, "input" if speech else "prompt")
    route = SPEECH_ROUTE if speech else "/v1/completions"
    body = json.dumps({"model": model, seen.expect: "a" * int(mib * 2**20), "max_tokens": 4}).encode()

    def send() -> None:
        request = urllib.request.Request(url + route, data=body,
                                         headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                seen.status, text = r.status, r.read()
        except urllib.error.HTTPError as e:
            seen.status, text = e.code, e.read()
        seen.answer_s = time.monotonic() - t0
        try:
            seen.param = json.loads(text)["error"]["param"]
        except (ValueError, KeyError, TypeError):
            seen.param = None

    task = asyncio.ensure_future(asyncio.to_thread(send))
    async with aiohttp.ClientSession() as session:
        while not task.done():
            t0 = time.monotonic()
            async with session.get(url + "/health") as r:
                await r.read()
            seen.health_s.append(time.monotonic() - t0)
            await asyncio.sleep(HEALTH_POLL_S)
    await task
    return seen
