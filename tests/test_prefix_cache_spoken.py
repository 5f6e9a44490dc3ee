"""The prefix cache under Qwen3-Omni's spoken answers (the tiny random model,
float32, on the CPU and on CUDA): the thinker's pages keep each prompt token's `hidden` row (what
the talker reads), so a spoken answer whose prompt starts from cached pages
hands the talker every row and speaks exactly as without the cache; pages a
text answer wrote (no rows kept) serve text answers only; without the cache
the pages keep no rows. The KV cache's rows go wherever its pages go."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.memory.kv_cache import KVCache
from mstar.models.base import KVSpec
from mstar.types import GenerateRequest, SamplingParams
from toys.serving import DEVICES

PAGE = 4
MODEL = "qwen3-omni-tiny"
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers in full sentences, always."}


def _clip(seconds: float, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * gen.standard_normal(t.size)).astype(np.float32)


def _conversation(*turns: str) -> list[dict]:
    """The system prompt, then turns: the first user turn with a clip (the
    talker reads the thinker's rows at its placeholders)."""
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        content: str | list[dict] = text
        if i == 0:
            content = [{"type": "audio", "audio": _clip(0.6, 1)}, {"type": "text", "text": text}]
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return messages


CASES = [  # (name, walk, messages), served one after the other
    ("first", "speak", _conversation("tell me about the sea")),
    ("again", "speak", _conversation("tell me about the sea")),
    ("next turn", "speak", _conversation("tell me about the sea", "it is big and blue", "and the sky?")),
    ("as text", "chat", _conversation("tell me about the sea")),
    ("text again", "chat", _conversation("tell me about the sea")),
]


async def _serve(caching: bool, device: str) -> tuple[dict[str, tuple[list[int], bytes]], dict[str, int], set[str]]:
    """Each case's text tokens and PCM, the thinker's prompt tokens each
    found in the cache, and the rows the thinker's pages keep."""
    eng = Engine(EngineConfig(model=MODEL, devices=(device,), max_model_len=256, dtype="float32",
                              scheduler=SchedulerConfig(page_size=PAGE, prefix_caching=caching)))
    await eng.start()
    out, hits = {}, {}
    try:
        for name, walk, messages in CASES:
            before = eng.workers[0].prefix_caches().get("thinker", {}).get("hits", 0)
            request = GenerateRequest(name, MODEL, {"messages": messages},
                                      SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), walk=walk,
                                      sampling_by={"talker": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True,
                                                              "stop_token_ids": []},
                                                   "cp": {"temperature": 0.0}} if walk == "speak" else {})
            text, audio = [], bytearray()
            async for chunk in eng.submit(request):
                assert chunk.error is None, chunk.error
                text += chunk.token_ids
                audio += chunk.audio or b""
            out[name] = (text, bytes(audio))
            hits[name] = eng.workers[0].prefix_caches().get("thinker", {}).get("hits", 0) - before
        assert all(n == 0 for n in eng.workers[0].pages_in_use().values())
        return out, hits, set(eng.workers[0].runners["thinker"].kv.rows)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("device", DEVICES)
async def test_spoken_answers_start_from_cached_pages_and_speak_as_without_them(device: str) -> None:
    cached, hits, rows = await _serve(True, device)
    plain, none, no_rows = await _serve(False, device)
    assert rows == {"hidden"} and not no_rows and not any(none.values())
    for name, walk, _ in CASES:
        assert cached[name][0] == plain[name][0], name
        if walk == "speak":
            mine = np.frombuffer(cached[name][1], dtype="<i2").astype(np.int32)
            theirs = np.frombuffer(plain[name][1], dtype="<i2").astype(np.int32)
            assert mine.size == theirs.size > 0, name
            assert np.abs(mine - theirs).max() <= 1, name  # float32 sums in another order: one PCM16 step
    assert hits["first"] == 0
    assert hits["again"] > 4 * PAGE  # every full page but the one holding the last token
    assert hits["next turn"] >= hits["again"] - PAGE  # the conversation so far
    # a text answer's pages keep no rows for a talker, so a spoken answer cannot use them, nor the reverse
    assert hits["as text"] == 0 and hits["text again"] == hits["again"]


def test_the_rows_follow_the_pages_through_copies_and_swaps() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, token_rows=(("hidden", 6),))
    bare = dataclasses.replace(spec, token_rows=())
    assert KVCache.bytes_per_page(spec, PAGE, torch.float32) == KVCache.bytes_per_page(bare, PAGE, torch.float32) \
        + 6 * PAGE * 4
    cache = KVCache(spec, num_pages=6, page_size=PAGE, device="cpu", dtype=torch.float32)
    rows = torch.randn(2 * PAGE, 6)
    slots = torch.cat([torch.arange(PAGE) + 1 * PAGE, torch.arange(PAGE) + 3 * PAGE])  # pages 1 and 3
    cache.write_rows("hidden", slots, rows)
    assert torch.equal(cache.read_rows("hidden", slots), rows)
    cache.copy_pages([1, 3], [4, 5])
    assert torch.equal(cache.read_rows("hidden", torch.arange(4 * PAGE, 6 * PAGE)), rows)
    swapped = cache.swap_out([1, 3])
    cache.rows["hidden"].zero_()
    cache.swap_in(swapped, [0, 2])
    assert torch.equal(cache.read_rows("hidden", torch.cat([torch.arange(PAGE), torch.arange(PAGE) + 2 * PAGE])),
                       rows)
