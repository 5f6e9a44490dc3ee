"""A language model's prompt, prepared by the model: a text and chat messages
become the ids the tokenizer gives (special tokens, chat template), every
refusal names the field the client gave, the prompt and `max_tokens` are
fitted to the context (None: all the room left), a long prompt is prepared
on a thread by `Engine.prepare` while the event loop goes on, and a second
sample of one prompt starts from the first's preparation."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import mstar.http

from mstar.config import EngineConfig
from mstar.engine import engine as engine_module
from mstar.engine.engine import Engine
from mstar.errors import CONTEXT_EXCEEDED, RequestError
from mstar.models.llama import LlamaModel
from mstar.models.prepared import PreparedPiece, fit_context
from mstar.models.registry import load_model
from mstar.models.tokenizer import Tokenizer
from mstar.types import GenerateRequest, SamplingParams
from toys.image_gen import ToyImageModel

CONTEXT = 32
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _request(inputs: dict[str, Any], max_tokens: int | None = 4, rid: str = "r", seed: int | None = 1,
             walk: str | None = None) -> GenerateRequest:
    return GenerateRequest(rid, "tiny-llama", inputs, SamplingParams(max_tokens=max_tokens, seed=seed), walk=walk)


def _ids(model: LlamaModel, inputs: dict[str, Any], max_tokens: int | None = 4) -> list[int]:
    return model.prepare(_request(inputs, max_tokens)).values["prompt_ids"].tolist()


def _refused(model: LlamaModel, inputs: dict[str, Any], max_tokens: int | None = 4) -> RequestError:
    with pytest.raises(RequestError) as e:
        model.prepare(_request(inputs, max_tokens))
    assert e.value.status == 400
    return e.value


def _counting_encode(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts `tokenizer.encode` is called with, from now on."""
    calls: list[str] = []
    real = tokenizer.encode

    def counted(text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    return calls


class Tokenless(LlamaModel):
    """The tiny Llama as a folder without tokenizer.json serves it: ids only."""

    def __init__(self) -> None:
        super().__init__("tiny-llama", None, max_model_len=CONTEXT)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return None


# ------------------------------------------------------------------ model


def test_a_text_is_tokenised_with_its_special_tokens() -> None:
    model = load_model("tiny-llama")
    prepared = model.prepare(_request({"prompt": "Once upon"}))
    ids = model.tokenizer.encode("Once upon", add_special_tokens=True)
    assert prepared.values["prompt_ids"].tolist() == ids and ids[0] == model.tokenizer.bos_token_id
    assert prepared.num_prompt_tokens == len(ids) and prepared.prompt_field == "prompt"


def test_messages_go_through_the_chat_template_then_the_tokenizer() -> None:
    model = load_model("tiny-llama")
    tok = model.tokenizer
    for opening in (True, False):
        text = tok.apply_chat_template(CHAT, add_generation_prompt=opening)
        assert (text.endswith("assistant<|end_header_id|>\n\n")) == opening
        # the template placed the BOS: encoding adds none
        expected = tok.encode(text, add_special_tokens=False)
        inputs = {"messages": CHAT} if opening else {"messages": CHAT, "add_generation_prompt": False}
        prepared = model.prepare(_request(inputs))
        assert prepared.values["prompt_ids"].tolist() == expected and prepared.prompt_field == "messages"
        assert expected.count(tok.bos_token_id) == 1


def test_token_ids_pass_as_given() -> None:
    assert _ids(load_model("tiny-llama"), {"prompt_ids": [256, 104, 105]}) == [256, 104, 105]


@pytest.mark.parametrize("inputs, field", [
    ({"prompt_ids": [1, 261]}, "prompt"),  # the byte vocabulary is 261 ids
    ({"prompt_ids": [1, -1]}, "prompt"),
    ({"prompt_ids": [1, True]}, "prompt"),
    ({"prompt_ids": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "prompt_ids": [1]}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_a_bad_prompt_names_its_field(inputs: dict[str, Any], field: str) -> None:
    assert _refused(load_model("tiny-llama", max_model_len=CONTEXT), inputs).field == field


@pytest.mark.parametrize("inputs, field", [
    (lambda text: {"prompt": text}, "prompt"),
    (lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
])
def test_a_text_past_any_context_is_refused_before_it_is_tokenised(inputs: Callable[[str], dict[str, Any]],
                                                                   field: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model("tiny-llama", max_model_len=CONTEXT)
    calls = _counting_encode(model.tokenizer, monkeypatch)
    # one character more than the context's tokens could hold, were each the longest token
    error = _refused(model, inputs("a" * (CONTEXT * model.tokenizer.max_token_bytes + 1)))
    assert error.field == field and "characters" in error.message and error.code == "context_length_exceeded"
    assert calls == []


def test_a_template_that_refuses_the_messages_names_them() -> None:
    model = load_model("tiny-llama")
    model.tokenizer.chat_template = "{{ raise_exception('only users speak here') }}"
    error = _refused(model, {"messages": CHAT})
    assert error.field == "messages" and "only users speak here" in error.message


def test_chat_template_kwargs_reach_the_template() -> None:
    """vLLM's `chat_template_kwargs`: variables the template reads (Qwen's
    `enable_thinking`), never one the server sets; a model that lays out its
    chat itself, with no template, refuses them."""
    model = load_model("tiny-llama")
    model.tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}no thinking: "
                                     "{% endif %}{{ messages[-1]['content'] }}")
    tok = model.tokenizer
    assert _ids(model, {"messages": CHAT}) == tok.encode("hi", add_special_tokens=False)
    off = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert _ids(model, off) == tok.encode("no thinking: hi", add_special_tokens=False)
    for kwargs, field in ((5, "chat_template_kwargs"), ({"messages": []}, "chat_template_kwargs.messages"),
                          ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                          ({"not a name": 1}, "chat_template_kwargs"),
                          ({"namespace": 1}, "chat_template_kwargs.namespace"),  # the template's own names
                          ({"raise_exception": 1}, "chat_template_kwargs.raise_exception"),
                          ({"self": 1}, "chat_template_kwargs.self")):
        assert _refused(model, {"messages": CHAT, "chat_template_kwargs": kwargs}).field == field
    omni = load_model("qwen3-omni-tiny", "dummy")
    with pytest.raises(RequestError) as e:
        omni.prepare(GenerateRequest("o", "qwen3-omni-tiny", off, SamplingParams(max_tokens=4), walk="chat"))
    assert e.value.field == "chat_template_kwargs" and "lays out its chat itself" in e.value.message


def test_a_model_without_a_tokenizer_takes_ids_only() -> None:
    model = Tokenless()
    for inputs in ({"prompt": "hi"}, {"messages": CHAT}):
        error = _refused(model, inputs)
        assert error.field == "model" and "no tokenizer" in error.message
    assert _ids(model, {"prompt_ids": [1, 2]}) == [1, 2]


@pytest.mark.parametrize("inputs, max_tokens, field", [
    ({"prompt_ids": [1] * CONTEXT}, None, "prompt"),
    ({"prompt_ids": [1] * CONTEXT}, 1, "prompt"),
    ({"prompt": "a" * CONTEXT}, None, "prompt"),  # the BOS makes it one more than the context
    ({"messages": [{"role": "user", "content": "a" * CONTEXT}]}, None, "messages"),
    ({"prompt_ids": [1] * 20}, 13, "max_tokens"),
])
def test_a_prompt_that_does_not_fit_the_context_names_its_field(inputs: dict[str, Any], max_tokens: int | None,
                                                               field: str) -> None:
    error = _refused(load_model("tiny-llama", max_model_len=CONTEXT), inputs, max_tokens)
    assert error.field == field and str(CONTEXT) in error.message and error.code == "context_length_exceeded"


def test_max_tokens_left_out_is_all_the_room_the_prompt_leaves() -> None:
    model = load_model("tiny-llama", max_model_len=CONTEXT)
    assert model.prepare(_request({"prompt_ids": [1] * 20}, None)).sampling["llm"].max_tokens == 12
    assert model.prepare(_request({"prompt_ids": [1] * 20}, 12)).sampling["llm"].max_tokens == 12
    assert model.prepare(_request({"prompt_ids": [1] * 20}, 5)).sampling["llm"].max_tokens == 5


def test_fit_context() -> None:
    model = load_model("tiny-llama")
    plan = model._compile(model.default_walk)

    def fit(max_tokens: int | None, prompt: int, field: str = "prompt") -> int | None:
        sampling = {"llm": SamplingParams(max_tokens=max_tokens), "other": SamplingParams(max_tokens=None)}
        fitted = fit_context(sampling, plan, model.components, PreparedPiece({}, prompt, field), 64)
        assert fitted["other"].max_tokens == 64 - prompt  # any key's None is the room
        return fitted["llm"].max_tokens

    assert fit(None, 10) == 54
    assert fit(54, 10) == 54
    with pytest.raises(RequestError) as info:
        fit(55, 10)
    assert info.value.field == "max_tokens" and "64" in info.value.message
    with pytest.raises(RequestError) as info:
        fit(None, 64, "messages")
    assert info.value.field == "messages"


def test_a_models_default_budget_is_a_ceiling_within_the_room() -> None:
    """A `max_tokens` None takes the model's default budget for the key, or
    the room the prompt leaves where that is less; a `min_tokens` more than
    that is refused, named as the client sent it."""
    model = load_model("tiny-llama")
    plan = model._compile(model.default_walk)
    budgets = {"llm": SamplingParams(max_tokens=20), "other": SamplingParams(max_tokens=None)}

    def fit(prompt: int, min_tokens: int = 0) -> tuple[int | None, int | None]:
        sampling = {"llm": SamplingParams(max_tokens=None, min_tokens=min_tokens),
                    "other": SamplingParams(max_tokens=None)}
        fitted = fit_context(sampling, plan, model.components, PreparedPiece({}, prompt, "prompt"), 64,
                             budgets.__getitem__)
        return fitted["llm"].max_tokens, fitted["other"].max_tokens

    assert fit(10) == (20, 54)   # the budget, where the room holds it; a key without one gets the room
    assert fit(50) == (14, 14)   # the room, where it is less
    assert fit(50, min_tokens=14) == (14, 14)
    with pytest.raises(RequestError) as info:
        fit(50, min_tokens=15)
    assert info.value.field == "min_tokens"
    assert model.default_sampling().max_tokens is None  # a plain language model's budget is the room


def test_a_prompt_leaving_less_than_the_shortest_answer_is_refused() -> None:
    """`min_answer` (a speech model's first window of audio): a prompt that
    leaves less room is refused, naming the prompt, not answered with
    nothing; a root that samples no tokens is not held to it."""
    model = load_model("tiny-llama")
    plan = model._compile(model.default_walk)

    def fit(prompt: int, root: str = "llm", plan=plan, components=model.components) -> int | None:
        sampling = {root: SamplingParams(max_tokens=None)}
        return fit_context(sampling, plan, components, PreparedPiece({}, prompt, "input"), 64,
                           min_answer=14)[root].max_tokens

    assert fit(50) == 14
    with pytest.raises(RequestError) as info:
        fit(51)
    assert info.value.field == "input" and info.value.code == CONTEXT_EXCEEDED and "14" in info.value.message
    image = ToyImageModel()
    denoise = image._compile("generate_cfg")
    assert fit(60, denoise.root, denoise, image.components) == 4


def test_a_root_that_samples_no_tokens_is_not_held_to_max_tokens() -> None:
    """A denoising walk's root writes no tokens into the context: its
    `max_tokens` (a default it never uses) needs no room."""
    image = ToyImageModel()
    plan = image._compile("generate_cfg")
    fitted = fit_context({plan.root: SamplingParams(max_tokens=16)}, plan, image.components,
                         PreparedPiece({}, 60, "prompt"), 64)
    assert fitted[plan.root].max_tokens == 16


def test_no_http_module_tokenises() -> None:
    """One intake: a prompt becomes tokens in the model's prepare. The HTTP
    side only decodes (answers, logprob token strings); a string's own
    `encode("utf-8")` is no tokenising."""
    for path in sorted(Path(mstar.http.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, args = node.func.attr, node.args
                tokenises = name == "apply_chat_template" or (
                    name == "encode" and bool(args) and not isinstance(args[0], ast.Constant))
                assert not tokenises, f"{path}:{node.lineno} calls {name}"


# ----------------------------------------------------------------- engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llama() -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model="tiny-llama"))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def _finish(stream: Any) -> list[int]:
    tokens: list[int] = []
    async for chunk in stream:
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
    return tokens


def _recording_prepare(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of each call of the model's `prepare`, from now on."""
    assert engine.model is not None
    threads: list[int] = []
    real = engine.model.prepare

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "prepare", recorded)
    return threads


@pytest.mark.asyncio(loop_scope="module")
async def test_submit_takes_a_text_and_messages(llama: Engine) -> None:
    tok = llama.tokenizer("tiny-llama")
    stream = llama.submit(_request({"prompt": "Once upon"}, rid="text"))
    assert stream.num_prompt_tokens == len(tok.encode("Once upon"))
    as_ids = llama.submit(_request({"prompt_ids": tok.encode("Once upon")}, rid="ids"))
    assert await _finish(stream) == await _finish(as_ids)
    chat = llama.submit(_request({"messages": CHAT}, rid="chat"))
    assert chat.num_prompt_tokens == len(tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False))
    assert len(await _finish(chat)) == 4


@pytest.mark.asyncio(loop_scope="module")
async def test_a_long_prompt_is_prepared_off_the_event_loop(llama: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    threads = _recording_prepare(llama, monkeypatch)
    monkeypatch.setattr(engine_module, "OFF_LOOP_SIZE", 100)
    short = await llama.prepare(_request({"prompt": "a" * 99}, rid="short"))
    long = await llama.prepare(_request({"prompt": "a" * 100}, rid="long"))
    assert threads[0] == loop_thread and threads[1] != loop_thread
    assert (short.num_prompt_tokens, long.num_prompt_tokens) == (100, 101)
    assert len(await _finish(llama.submit(_request({"prompt": "a" * 100}, rid="long"), long))) == 4
    assert len(threads) == 2  # submit started from what prepare gave


@pytest.mark.asyncio(loop_scope="module")
async def test_the_event_loop_runs_while_a_long_prompt_is_prepared(llama: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """At the real threshold, with the model's prepare held until the loop
    has run a callback: were it on the event loop, it would wait in vain."""
    assert llama.model is not None
    ran = threading.Event()
    real = llama.model.prepare

    def held(*args: Any, **kwargs: Any) -> Any:
        assert ran.wait(timeout=20), "preparing blocked the event loop"
        return real(*args, **kwargs)

    monkeypatch.setattr(llama.model, "prepare", held)
    asyncio.get_running_loop().call_later(0.05, ran.set)
    ids = [1] * engine_module.OFF_LOOP_SIZE  # past the 2,048 context
    with pytest.raises(RequestError) as e:
        await asyncio.wait_for(llama.prepare(_request({"prompt_ids": ids}, rid="huge")), timeout=30)
    assert e.value.field == "prompt" and "no room" in e.value.message


@pytest.mark.asyncio(loop_scope="module")
async def test_another_sample_starts_from_the_first_ones_preparation(llama: Engine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tok = llama.tokenizer("tiny-llama")
    calls = _counting_encode(tok, monkeypatch)
    hot = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    first = GenerateRequest("s-0", "tiny-llama", {"prompt": "Once upon"}, hot)
    prepared = await llama.prepare(first)
    samples = [first, *(GenerateRequest(f"s-{j}", "tiny-llama", {"prompt": "Once upon"},
                                        SamplingParams(max_tokens=6, temperature=1.0, seed=3 + j, ignore_eos=True))
                        for j in (1, 2))]
    drawn = [await _finish(llama.submit(r, prepared)) for r in samples]
    assert calls == ["Once upon"]  # tokenised once for the three samples
    # each sample draws as a request of its own seed would
    alone = [await _finish(llama.submit(GenerateRequest(f"a-{j}", "tiny-llama", {"prompt_ids": prepared.values[
        "prompt_ids"].tolist()}, r.sampling))) for j, r in enumerate(samples)]
    assert drawn == alone and drawn[0] != drawn[1]
    unseeded = GenerateRequest("u", "tiny-llama", {"prompt": "Once upon"}, SamplingParams(max_tokens=2))
    twin = GenerateRequest("u-1", "tiny-llama", {"prompt": "Once upon"}, SamplingParams(max_tokens=2))
    ready = await llama.prepare(unseeded)
    assert llama.model is not None and llama.model.resample(twin, llama.plans["generate"], ready).sampling[
        "llm"].seed != ready.sampling["llm"].seed  # an unseeded sample draws its own seed


@pytest.mark.asyncio(loop_scope="module")
async def test_a_preparation_for_another_walk_is_not_started(llama: Engine) -> None:
    prepared = await llama.prepare(_request({"prompt_ids": [1, 2]}, rid="w"))
    wrong = dataclasses.replace(prepared, walk="speak")
    with pytest.raises(ValueError, match="walk"):
        llama.submit(_request({"prompt_ids": [1, 2]}, rid="w"), wrong)
    assert llama.num_running() == 0

