"""A served folder's generation_config.json as its text requests' default
sampling (vLLM's `--generation-config auto`): temperature, top_p, top_k,
min_p and repetition_penalty fill the fields a request leaves out, and
max_new_tokens is the budget of a request that sets none; a request's own
values win, `--generation-config none` (or `vllm`) keeps the API's
defaults, and another folder's file may be named instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from http_support import serving
from tiny_qwen35 import save_byte_tokenizer

from mstar.config import EngineConfig, parse_args
from mstar.engine.engine import Engine
from mstar.errors import ConfigError
from mstar.models.checkpoint import generation_defaults
from mstar.models.registry import load_model, sampling_defaults
from mstar.types import GenerateRequest

SHIPPED = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.2, "max_new_tokens": 5,
           "do_sample": True, "eos_token_id": 300}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level tokenizer, a chat template and a
    generation config that ships sampling defaults."""
    import transformers

    path = tmp_path_factory.mktemp("shipped")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=384, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps(SHIPPED))
    return path


def test_the_fields_it_reads_and_the_ones_it_refuses(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(SHIPPED))
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "top_p": 0.8, "top_k": 7,
                                             "repetition_penalty": 1.2, "max_tokens": 5}
    for bad, named in (({"top_p": 0}, "'top_p' must be in"), ({"max_new_tokens": 0}, "'max_new_tokens' must be"),
                       ([0.7], "not a JSON object"),
                       ({"top_k": 2.5}, "'top_k' must be an integer"), ({"temperature": "hot"}, "must be a number")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=named):
            generation_defaults(tmp_path)


def test_where_the_defaults_come_from(folder: Path, tmp_path: Path) -> None:
    assert sampling_defaults("auto", str(folder))["max_tokens"] == 5
    assert sampling_defaults("auto", "tiny-llama") == {}  # a built-in model ships none
    assert sampling_defaults("none", str(folder)) == sampling_defaults("vllm", str(folder)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert sampling_defaults(str(tmp_path), str(folder)) == {"temperature": 0.3}
    with pytest.raises(ConfigError, match="--generation-config"):
        sampling_defaults(str(tmp_path / "nowhere"), str(folder))
    assert parse_args(["--generation-config", "none"]).engine.generation_config == "none"
    assert parse_args([]).engine.generation_config == "auto"


def _recording(engine: Engine) -> list[GenerateRequest]:
    """What the routes submit to `engine`, in order."""
    seen: list[GenerateRequest] = []
    submit = engine.submit

    def record(request: GenerateRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return submit(request, *args, **kwargs)

    engine.submit = record  # type: ignore[method-assign]
    return seen


async def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.mark.asyncio
async def test_a_request_gets_the_folders_defaults_under_its_own(folder: Path) -> None:
    engine = Engine(EngineConfig(model=str(folder)))
    await engine.start()
    try:
        seen = _recording(engine)
        async with serving(engine) as url:
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            answer = await _post(url, "/v1/chat/completions", chat)
            assert answer["usage"]["completion_tokens"] == 5  # max_new_tokens: the budget of one that sets none
            own = await _post(url, "/v1/chat/completions", {**chat, "temperature": 0.7, "top_k": None,
                                                            "max_tokens": 9})
            assert own["usage"]["completion_tokens"] == 9
            text = await _post(url, "/v1/completions", {"prompt": "hi", "top_p": 0.5, "ignore_eos": True})
            assert text["usage"]["completion_tokens"] == 16  # OpenAI's 16 when left out: a default is set
            async with aiohttp.ClientSession() as session, session.post(
                    url + "/v1/chat/completions", json={**chat, "min_tokens": 8}) as r:
                refused = await r.json()
                assert r.status == 400 and refused["error"]["param"] == "min_tokens", refused
                assert "default budget, which a max_tokens raises" in refused["error"]["message"]
            ids = await _post(url, "/generate", {"input_ids": [1, 2, 3],
                                                 "sampling_params": {"max_tokens": 2, "ignore_eos": True}})
            assert len(ids["token_ids"]) == 2
        shipped = dict(temperature=0.0, top_p=0.8, top_k=7, repetition_penalty=1.2, min_p=0.0)
        got = [{k: getattr(r.sampling, k) for k in shipped} for r in seen]
        assert got[0] == shipped
        assert got[1] == {**shipped, "temperature": 0.7}  # a null is left out: the folder's top_k stays
        assert got[2] == {**shipped, "top_p": 0.5}
        assert got[3] == shipped
        assert [r.sampling.max_tokens for r in seen] == [None, 9, 16, 2]
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_none_keeps_the_apis_defaults(folder: Path) -> None:
    engine = Engine(EngineConfig(model=str(folder), generation_config="none"))
    await engine.start()
    try:
        seen = _recording(engine)
        async with serving(engine) as url:
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 7}
            assert (await _post(url, "/v1/chat/completions", chat))["usage"]["completion_tokens"] == 7
        sampling = seen[0].sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (1.0, 1.0, 0,
                                                                                                        1.0)
    finally:
        await engine.shutdown()


def test_models_that_publish_their_own_sampling(folder: Path) -> None:
    """Qwen3-Omni's text answers take the file's sampling and budget (its
    talker and code predictor keep their released draws); Orpheus keeps its
    published speech sampling and takes none."""
    omni = load_model("qwen3-omni-tiny", generation_config=str(folder))
    root = omni.default_sampling()
    assert (root.temperature, root.top_k, root.max_tokens) == (0.0, 7, 5)
    assert omni.text_defaults == {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.2}
    assert omni.default_sampling("talker").temperature == 0.9
    orpheus = load_model("orpheus-tiny", generation_config=str(folder))
    assert orpheus.generation_defaults == {} and orpheus.text_defaults == {}
    assert orpheus.default_sampling() == load_model("orpheus-tiny").default_sampling()


@pytest.mark.asyncio
async def test_a_budget_past_the_room_a_prompt_leaves_shortens_the_answer(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100000}))
    engine = Engine(EngineConfig(model=str(folder), generation_config=str(tmp_path), max_model_len=64))
    await engine.start()
    try:
        async with serving(engine) as url:
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            usage = (await _post(url, "/v1/chat/completions", chat))["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    finally:
        await engine.shutdown()
