"""`--audio-logits-only`: a speech model's head computes the logits of its
own ids only, the rest -inf; the sampler reads only that window and draws
what the whole row with those -inf entries would draw; the engine serves
only the speech walks, and text routes answer 400 (without the flag they
run Orpheus's text walk). Each piece against the unrestricted one on the CPU."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest
import torch
from http_support import serving

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.sampler import SamplingTensors, sample
from mstar.errors import ConfigError, RequestError
from mstar.models.layers import VocabHead
from mstar.models.orpheus.tokens import END_OF_SPEECH, LLAMA3_VOCAB_SIZE, ORPHEUS_VOCAB_SIZE
from mstar.types import GenerateRequest, SamplingParams


def test_a_restricted_head_computes_its_window_and_leaves_the_rest_at_minus_inf() -> None:
    torch.manual_seed(0)
    head = VocabHead(16, 1000, dtype=torch.float32)
    head.weight.copy_(torch.randn(1000, 16))
    x = torch.randn(5, 16)
    whole = head(x)
    head.restrict(128, 704)
    assert head.window == (128, 704)
    part = head(x)
    assert part.shape == whole.shape == (5, 1000)
    torch.testing.assert_close(part[:, 128:704], whole[:, 128:704], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(part[:, :128]).all() and torch.isneginf(part[:, 704:]).all()
    head.restrict(960, 1000)            # to the vocabulary's end (not aligned): the padded rows stay out
    last = head(x)
    assert head.window == (960, 1000) and torch.isneginf(last[:, :960]).all()
    torch.testing.assert_close(last[:, 960:], whole[:, 960:], rtol=1e-5, atol=1e-5)
    for first, end in ((100, 704), (128, 700)):
        with pytest.raises(ValueError, match="multiple of 64"):
            head.restrict(first, end)
    with pytest.raises(ValueError, match="inside the vocabulary"):
        head.restrict(0, 1001)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=4),
    SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=5),
])
def test_a_windowed_draw_is_the_whole_rows_draw(params: SamplingParams) -> None:
    """Penalties, bans inside and outside the window, greedy and filtered
    rows: the window's draw equals the draw over the whole -inf-padded rows."""
    rows, vocab, first, end = 6, 3000, 1024, 2900
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, :first] = float("-inf")
    logits[:, end:] = float("-inf")
    st = SamplingTensors.build([params] * rows, [params.seed or 0] * rows, list(range(rows)), "cpu")
    seen = torch.rand(rows, vocab, generator=gen) < 0.05
    # row 0 bans an id inside the window (its argmax), row 1 one outside; the others none
    banned = torch.full((rows, 1), -1, dtype=torch.long)
    banned[0, 0] = int(logits[0].argmax())
    banned[1, 0] = 5
    for ban in (None, banned):
        for offset in (0, 9):
            want = sample(logits, st, seen, ban, offset)
            got = sample(logits, st, seen, ban, offset, window=(first, end))
            assert got.tolist() == want.tolist()
            assert ((got >= first) & (got < end)).all()


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json={"model": "orpheus-tiny", **body}) as r:
        return r.status, await r.json()


async def _speech_samples(eng: Engine, seeds: range, max_tokens: int) -> list[int]:
    """Each seed's speech request's PCM samples (`max_tokens` ids drawn at temperature 2: text ids too)."""
    base = SamplingParams(temperature=2.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for seed in seeds:
        req = GenerateRequest(f"r{seed}", eng.model_name, {"text": "hello there", "voice": "tara"},
                              dataclasses.replace(base, seed=seed))
        chunks = [c async for c in eng.submit(req)]
        assert chunks[-1].error is None and chunks[-1].num_output_tokens == max_tokens
        out.append(sum(len(c.audio) // 2 for c in chunks if c.audio))
    return out


async def test_orpheus_serves_only_its_speech_walks_with_audio_ids() -> None:
    """orpheus-tiny's unrestricted speech draws a text id now and then, which
    makes no audio; restricted, all 42 ids of a request are audio codes
    (6 frames: 5 played, the first heard as the second's left context)."""
    seeds, tokens, samples_all_audio = range(6), 42, 5 * 2048
    plain = Engine(EngineConfig(model="orpheus-tiny"))
    await plain.start()
    try:
        unrestricted = await _speech_samples(plain, seeds, tokens)
        assert "generate" in plain.health()["walks"] and plain.health()["audio_logits_only"] is False
        async with serving(plain) as url:
            # a text route on a model that speaks runs its text walk: the Llama's ids (with logprobs) as text
            status, body = await _post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 1})
            assert status == 200 and len(body["choices"][0]["logprobs"]["token_logprobs"]) == 3
    finally:
        await plain.shutdown()
    assert min(unrestricted) < samples_all_audio
    eng = Engine(EngineConfig(model="orpheus-tiny", audio_logits_only=True))
    await eng.start()
    try:
        assert set(eng.plans) == {"speak", "speak_early"}
        assert eng.health()["walks"] == ["speak", "speak_early"] and eng.health()["audio_logits_only"] is True
        assert eng.workers[0].runners["llm"].vocab_window == (LLAMA3_VOCAB_SIZE, ORPHEUS_VOCAB_SIZE)
        assert await _speech_samples(eng, seeds, tokens) == [samples_all_audio] * len(seeds)
        text = GenerateRequest("t", eng.model_name, {"prompt_ids": [5, 6, 7]},
                               SamplingParams(max_tokens=2), walk="generate")
        with pytest.raises(RequestError, match="'generate' of model 'orpheus-tiny' is not served: "
                                               "--audio-logits-only serves speak, speak_early"):
            async for _ in eng.submit(text):
                pass
        async with serving(eng) as url:  # text routes have no text walk here: a 400, not an empty answer
            for route, body in (("/v1/completions", {"prompt": "Hello"}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                status, answer = await _post(url + route, {**body, "max_tokens": 3})
                assert status == 400 and answer["error"]["param"] == "model", route
                assert "answers in speech only" in answer["error"]["message"]
    finally:
        await eng.shutdown()


async def test_a_model_without_an_audio_window_refuses_the_flag() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", audio_logits_only=True))
    with pytest.raises(ConfigError, match="--audio-logits-only"):
        await eng.start()
    await eng.shutdown()


def test_the_window_holds_the_end_of_speech() -> None:
    assert LLAMA3_VOCAB_SIZE <= END_OF_SPEECH < ORPHEUS_VOCAB_SIZE
