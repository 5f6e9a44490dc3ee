"""One intake: a request in, `Model.prepare`'s `Prepared` out, with sampling
per key. Over the tiny Llama with a second walk whose fan-out branch `echo`
samples under its own key: each key's params resolved (the model's default
for the key, the request's `sampling` for the root, `sampling_by[key]` on
top), a seed and stop ids per key, an override that reaches only its
partition, an invalid override named `sampling_by.<key>.<field>`, and
`SamplingParams.validate` run once per key on the way in, HTTP included."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch
from http_support import serving
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.errors import RequestError
from mstar.graph import (Component, Emit, EosToken, FanOut, HostStop, Loop, MaxTokens, Step, Walk, compile_walk,
                         samples)
from mstar.models.base import Model
from mstar.models.llama import LlamaModel
from mstar.models.prepared import GREEDY_SEED, PreparedPiece, key_seed
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams

PROMPT = [256, 104, 105, 33]
ECHO_DEFAULT = SamplingParams(max_tokens=4, temperature=0.0)


class PairModel(LlamaModel):
    """The tiny Llama, plus a walk `pair`: the root (`llm`) decodes as the
    `generate` walk does while a fan-out branch `echo` decodes the same prompt
    under its own sampling key (the same step and value names, so that the
    two prefills can share a batch)."""

    walks = {
        **LlamaModel.walks,
        "pair": Walk(
            FanOut(((Step("llm", "prefill", "prompt_ids", "token"),
                     Loop(Step("llm", "decode", "token", "token"), until=EosToken() | MaxTokens())),),
                   names=("echo",)),
            Step("llm", "prefill", "prompt_ids", "token"),
            Loop(Step("llm", "decode", "token", "token"), until=EosToken() | MaxTokens() | HostStop()),
            Emit("token", modality="text"),
            inputs=("prompt_ids",)),
    }

    def __init__(self) -> None:
        super().__init__("tiny-pair", None)

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        return ECHO_DEFAULT if key == "echo" else super().default_sampling(key)


def _request(walk: str = "pair", sampling: SamplingParams | None = None, rid: str = "r",
             **sampling_by: dict[str, Any]) -> GenerateRequest:
    return GenerateRequest(rid, "tiny-pair", {"prompt_ids": PROMPT}, sampling or SamplingParams(seed=7),
                           walk=walk, sampling_by=sampling_by)


# ----------------------------------------------------------------- prepare


def test_each_key_resolves_from_its_default_the_request_and_its_override() -> None:
    model = PairModel()
    root = SamplingParams(max_tokens=5, temperature=0.7, seed=7, stop_token_ids=(9,))
    prepared = model.prepare(_request(sampling=root, echo={"max_tokens": 3, "ignore_eos": True, "stop": ["x"]},
                                      llm={"top_k": 5}))
    assert list(prepared.sampling) == ["llm", "echo"]  # the root's key first
    assert prepared.sampling["llm"] == SamplingParams(max_tokens=5, temperature=0.7, seed=7, stop_token_ids=(9,),
                                                      top_k=5)
    echo = prepared.sampling["echo"]
    assert (echo.max_tokens, echo.temperature, echo.ignore_eos, echo.stop) == (3, 0.0, True, ("x",))
    assert prepared.stop_ids == {"llm": (*model.eos_token_ids, 9), "echo": ()}
    assert prepared.values["prompt_ids"].tolist() == PROMPT and prepared.num_prompt_tokens == len(PROMPT)
    # a walk with one sampling partition has one key: the root's, as the request set it
    plain = model.prepare(_request("generate", sampling=root))
    assert plain.sampling == {"llm": root}


def test_the_root_keeps_the_requests_seed_and_another_key_derives_a_stable_one() -> None:
    model = PairModel()
    prepared = model.prepare(_request(sampling=SamplingParams(seed=7)))
    assert prepared.sampling["llm"].seed == 7
    # blake2 of (seed, key): the same in every process, unlike Python's salted str hash
    assert prepared.sampling["echo"].seed == key_seed(7, "echo") == 7728517716779657305
    assert model.prepare(_request(echo={"seed": 3})).sampling["echo"].seed == 3
    unseeded = model.prepare(_request(sampling=SamplingParams()))
    root_seed = unseeded.sampling["llm"].seed
    assert root_seed is not None and unseeded.sampling["echo"].seed == key_seed(root_seed, "echo")
    # without a seed, a greedy request's other draws (another key's, a codec's noise) follow a fixed one
    greedy = model.prepare(_request(sampling=SamplingParams(temperature=0.0), echo={"temperature": 0.5}))
    assert greedy.sampling["llm"].seed == GREEDY_SEED
    assert greedy.sampling["echo"].seed == key_seed(GREEDY_SEED, "echo")
    sampled = [model.prepare(_request(sampling=SamplingParams(temperature=0.5), echo={"temperature": 0.0}))
               .sampling["llm"].seed for _ in range(3)]
    assert len(set(sampled)) == 3   # a sampled root keeps a random seed: 2**-63 odds of a repeat


def test_a_resample_resolves_every_key_as_a_fresh_prepare_would() -> None:
    """A second sample of one prompt: its own seed, and the other keys'
    seeds derived from it, without preparing the inputs again."""
    model = PairModel()
    plan = compile_walk("pair", model.walks["pair"], model.components)
    first = model.prepare(_request(sampling=SamplingParams(seed=7), echo={"max_tokens": 3}))
    second = _request(sampling=SamplingParams(seed=8), rid="r-1", echo={"max_tokens": 3})
    resampled = model.resample(second, plan, first)
    fresh = model.prepare(second)
    assert resampled.sampling == fresh.sampling and resampled.stop_ids == fresh.stop_ids
    assert resampled.sampling["echo"].seed == key_seed(8, "echo") != first.sampling["echo"].seed
    assert resampled.values is first.values and resampled.num_prompt_tokens == first.num_prompt_tokens
    assert resampled.is_sampling_of(second) and not first.is_sampling_of(second)


@pytest.mark.parametrize("sampling, overrides, field", [
    (None, {"echo": {"top_p": 0}}, "sampling_by.echo.top_p"),
    (None, {"echo": {"max_tokens": 10**6}}, "sampling_by.echo.max_tokens"),
    (None, {"echo": {"temperature": "hot"}}, "sampling_by.echo.temperature"),
    (None, {"echo": {"stop": "x"}}, "sampling_by.echo.stop"),
    (None, {"echo": {"bogus": 1}}, "sampling_by.echo.bogus"),
    (None, {"echo": 3}, "sampling_by.echo"),
    (None, {"codec": {"top_k": 1}}, "sampling_by.codec"),
    (None, {"llm": {"top_k": -5}}, "sampling_by.llm.top_k"),
    (SamplingParams(max_tokens=10**6), {}, "max_tokens"),  # the request's own field keeps its name
])
def test_an_invalid_override_names_its_key_and_field(sampling: SamplingParams | None,
                                                     overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as e:
        PairModel().prepare(_request(sampling=sampling, **overrides))
    assert e.value.field == field and e.value.status == 400, e.value


def test_a_max_tokens_past_the_context_says_the_limit_is_the_context_less_the_prompt() -> None:
    with pytest.raises(RequestError) as e:
        PairModel().prepare(_request(sampling=SamplingParams(max_tokens=10**6)))
    assert e.value.field == "max_tokens" and "context length" in e.value.message and "prompt" in e.value.message


def test_more_input_is_a_piece_of_values_and_its_token_count() -> None:
    model = load_model("orpheus-tiny")
    first = GenerateRequest("p", "orpheus-tiny", {"text": "hi", "voice": "tara"})
    piece = model.prepare_more(first, {"text": "and more."})
    assert isinstance(piece, PreparedPiece)
    assert piece.num_tokens == len(piece.values["prompt_ids"]) > len("and more.")


def test_params_replace_is_dataclasses_replace() -> None:
    base = SamplingParams(max_tokens=5, stop=("x",), seed=3)
    every = {"max_tokens": 9, "temperature": 0.5, "top_k": 4, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.2,
             "presence_penalty": 0.3, "frequency_penalty": -0.3, "seed": 11, "stop_token_ids": (1,), "stop": ("y",),
             "ignore_eos": True, "min_tokens": 2, "logprobs": 3, "skip_special_tokens": False,
             "include_stop_str_in_output": True}
    assert every.keys() == {f.name for f in dataclasses.fields(SamplingParams)}
    for changes in [{}, every, *({name: value} for name, value in every.items())]:
        got, want = base.replace(**changes), dataclasses.replace(base, **changes)
        assert got == want and vars(got) == vars(want) and hash(got) == hash(want) and type(got) is SamplingParams
        assert got is not base
    with pytest.raises(TypeError, match="bogus"):
        base.replace(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.replace(seed=1).seed = 2  # type: ignore[misc]
    # the shortcut holds while the generated __init__ only sets the fields
    assert not hasattr(SamplingParams, "__post_init__")


def test_a_plans_host_predicates_are_its_loops_host_stops() -> None:
    # read by every request's intake, gathered once per plan: the same mapping each time, read-only
    model = PairModel()
    plan = compile_walk("pair", model.walks["pair"], model.components)
    assert dict(plan.host_predicates) == {}  # `HostStop()` without a predicate: stop strings, judged apart
    limit = lambda v: v > 3  # noqa: E731
    walk = Walk(Step("llm", "prefill", "prompt_ids", "token"),
                Loop(Step("llm", "decode", "token", "token"), until=MaxTokens() | HostStop(predicate=limit)),
                Emit("token", modality="text"), inputs=("prompt_ids",))
    judged = compile_walk("judged", walk, model.components)
    assert dict(judged.host_predicates) == {(judged.root, "token"): limit}
    assert judged.host_predicates is judged.host_predicates
    with pytest.raises(TypeError):
        judged.host_predicates[("other", "token")] = limit  # type: ignore[index]


def test_a_walks_sampling_keys_come_compiled_in_its_plan() -> None:
    # worked out once, when the walk compiles: every request's intake reads them off the plan
    model = PairModel()
    plan = compile_walk("pair", model.walks["pair"], model.components)
    assert plan.sampling_keys == ("llm", "echo") and plan.draw_keys == ()
    assert samples(model.components["llm"], "prefill")


# ------------------------------------------------------------------ engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair() -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model="tiny-pair"), model=PairModel())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def _run(engine: Engine, request: GenerateRequest) -> dict[str, list[int]]:
    """The request's tokens by the partition that sampled them (read off the
    workers' reports: chunks do not say)."""
    tokens: dict[str, list[int]] = {}

    def record(report: StepReport) -> None:
        for batch in report.emits:
            for rid, part, token in zip(batch.request_ids, batch.partitions, batch.data.tolist()):
                if rid == request.request_id:
                    tokens.setdefault(part, []).append(token)

    hook = engine.add_report_hook(record, before=True)
    try:
        async for chunk in engine.submit(request):
            assert chunk.error is None, chunk.error
    finally:
        engine.remove_report_hook(hook)
    return tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_a_key_override_reaches_its_partition_only(pair: Engine) -> None:
    root = SamplingParams(max_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    both = await _run(pair, _request(sampling=root, rid="pair", echo={"max_tokens": 3, "ignore_eos": True}))
    assert [len(both["llm"]), len(both["echo"])] == [5, 3]
    # the root draws as it would alone: its key keeps the request's seed
    alone = await _run(pair, _request("generate", sampling=root, rid="alone"))
    assert both["llm"] == alone["llm"]
    # the echo samples greedily (its key's default), whatever the root's temperature
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert both["echo"] == (await _run(pair, _request("generate", sampling=greedy, rid="greedy")))["llm"]
    assert await _idle(pair)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_invalid_override_is_refused_at_submit(pair: Engine) -> None:
    with pytest.raises(RequestError) as e:
        pair.submit(_request(rid="bad", echo={"top_p": 2.0}))
    assert e.value.field == "sampling_by.echo.top_p"
    assert pair.num_running() == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_submit_validates_once_per_key(pair: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_validate(monkeypatch)
    await _run(pair, _request("generate", rid="one", sampling=SamplingParams(max_tokens=2, seed=1)))
    assert len(calls) == 1
    await _run(pair, _request(rid="two", sampling=SamplingParams(max_tokens=2, seed=1), echo={"max_tokens": 2}))
    assert len(calls) == 3  # one per key of the pair walk


def _count_validate(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    calls: list[SamplingParams] = []
    original = SamplingParams.validate

    def counted(self: SamplingParams, max_model_tokens: int | None = None) -> None:
        calls.append(self)
        original(self, max_model_tokens)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    return calls


async def _idle(engine: Engine) -> bool:
    return engine.num_running() == 0 and engine.pages_in_use() == 0


# -------------------------------------------------------------------- HTTP


class Speaker(Model):
    """Speaks `int(text)` + 1, + 2, ... as a tone: enough of a speech walk to
    go through `/v1/audio/speech` with no tokenizer."""

    components = {"counter": Component(modes=("tick",)), "tone": Component(modes=("synth",))}
    walks = {"speak": Walk(
        Loop(Step("counter", "tick", "x", "x"), until=MaxTokens()),
        Step("tone", "synth", "x", "pcm"),
        Emit("pcm", modality="audio", sample_rate=24_000),
        inputs=("x",))}
    default_walk = "speak"
    tts_walk = "speak"

    def __init__(self) -> None:
        super().__init__("speaker")

    @property
    def max_model_len(self) -> int:
        return 64

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=3)

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return Ticks() if component == "counter" else Tone()

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        return PreparedPiece({"x": torch.tensor(int(request.inputs["text"]))}, 1)


class Ticks(nn.Module):
    def tick(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Tone(nn.Module):
    def synth(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 10.0).reshape(-1, 1).repeat(1, 4)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speaker() -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model="speaker"), model=Speaker())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


@pytest.mark.asyncio(loop_scope="module")
async def test_speech_over_http_validates_once_in_the_engine(speaker: Engine,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_validate(monkeypatch)
    async with serving(speaker) as base, aiohttp.ClientSession(base_url=base) as http:
        async with http.post("/v1/audio/speech", json={"input": "0", "response_format": "pcm"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        assert len(calls) == 1
        # the engine's refusal keeps the body's field names
        for body, field in (({"top_p": 0}, "top_p"), ({"max_tokens": 65}, "max_tokens")):
            async with http.post("/v1/audio/speech", json={"input": "0", "response_format": "pcm", **body}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == field
