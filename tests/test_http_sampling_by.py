"""mstar's `sampling_by` over HTTP: a body's sampling per sampling key reaches
the model on every generation route (an override of the root key's
`temperature` samples as the body's own `temperature` would), and what the
model refuses in it is a 400 naming `sampling_by.<key>` or
`sampling_by.<key>.<field>`; a value that is not an object of objects is
refused by the route, naming it the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from http_support import running_engine, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = "llm"  # the root partition of both tiny models' walks: the key of the request's own sampling
HOT = {"temperature": 1.0, "seed": 3, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi"}]

# path -> (a body that samples hot, what its answer drew)
ROUTES: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]] = {
    "/v1/completions": ({"prompt": "Once upon", "max_tokens": 6, **HOT}, lambda a: a["choices"][0]["text"]),
    "/v1/chat/completions": ({"messages": CHAT, "max_tokens": 6, **HOT},
                             lambda a: a["choices"][0]["message"]["content"]),
    "/generate": ({"text": "Once upon", "sampling_params": {"max_tokens": 6, **HOT}}, lambda a: a["token_ids"]),
}


def _greedy(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == "/generate":
        return {**body, "sampling_params": {**body["sampling_params"], "temperature": 0}}
    return {**body, "temperature": 0}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llama() -> AsyncIterator[str]:
    async with running_engine() as engine, serving(engine) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orpheus() -> AsyncIterator[str]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield url


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.read())


@pytest.mark.parametrize("path", list(ROUTES))
async def test_the_root_keys_override_samples_as_the_bodys_own_field(llama: str, path: str) -> None:
    body, drawn = ROUTES[path]
    answers = {}
    for name, sent in (("hot", body), ("greedy", _greedy(path, body)),
                       ("override", {**body, "sampling_by": {ROOT: {"temperature": 0}}})):
        status, answers[name] = await _post(llama + path, sent)
        assert status == 200, answers[name]
    assert drawn(answers["override"]) == drawn(answers["greedy"]) != drawn(answers["hot"])


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("sampling_by, param", [
    ({"talker": {"temperature": 0}}, "sampling_by.talker"),  # the walk has no such key
    ({ROOT: {"top_p": 0}}, f"sampling_by.{ROOT}.top_p"),
    ({ROOT: {"temperature": "hot"}}, f"sampling_by.{ROOT}.temperature"),
    ({ROOT: {"stop": "x"}}, f"sampling_by.{ROOT}.stop"),
    ({ROOT: {"bogus": 1}}, f"sampling_by.{ROOT}.bogus"),
    ({ROOT: 5}, f"sampling_by.{ROOT}"),
    (5, "sampling_by"),
    ([{}], "sampling_by"),
])
async def test_a_bad_override_is_a_400_naming_it(llama: str, path: str, sampling_by: Any, param: str) -> None:
    status, answer = await _post(llama + path, {**ROUTES[path][0], "sampling_by": sampling_by})
    assert status == 400 and answer["error"]["param"] == param, answer


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_samples_seeded_by_an_override_differ_as_the_bodys_seed_makes_them(llama: str, path: str) -> None:
    # the body's seed gives sample j seed + j; a seed set through sampling_by must not give every sample one draw
    body, _ = ROUTES[path]
    body = {k: v for k, v in body.items() if k != "seed"}
    texts = {}
    for name, sent in (("seed", {**body, "seed": 3}), ("override", {**body, "sampling_by": {ROOT: {"seed": 3}}})):
        status, answer = await _post(llama + path, {**sent, "n": 3})
        assert status == 200, answer
        texts[name] = [c.get("text", (c.get("message") or {}).get("content")) for c in answer["choices"]]
    assert texts["override"] == texts["seed"] and len(set(texts["seed"])) == 3, texts


@pytest.mark.parametrize("path", list(ROUTES))
async def test_logprobs_in_an_override_are_refused_not_dropped(llama: str, path: str) -> None:
    # the answer shapes logprobs from the route's own field only: an override's would be computed, then lost
    status, answer = await _post(llama + path, {**ROUTES[path][0], "sampling_by": {ROOT: {"logprobs": 2}}})
    assert status == 400 and answer["error"]["param"] == f"sampling_by.{ROOT}.logprobs", answer


async def test_speech_takes_an_override_of_its_root_key(orpheus: str) -> None:
    body = {"input": "hi", "response_format": "pcm", "max_tokens": 28, "seed": 1, "temperature": 0.9}
    hot = await _post(orpheus + "/v1/audio/speech", body)
    greedy = await _post(orpheus + "/v1/audio/speech", {**body, "temperature": 0})
    override = await _post(orpheus + "/v1/audio/speech", {**body, "sampling_by": {ROOT: {"temperature": 0}}})
    assert hot[0] == greedy[0] == override[0] == 200
    assert override[1] == greedy[1] != hot[1] and len(greedy[1]) > 0
    for sampling_by, param in (({"codec": {"top_k": 1}}, "sampling_by.codec"),  # the codec does not sample
                               ({ROOT: {"repetition_penalty": 0}}, f"sampling_by.{ROOT}.repetition_penalty"),
                               ({ROOT: []}, f"sampling_by.{ROOT}")):
        status, answer = await _post(orpheus + "/v1/audio/speech", {**body, "sampling_by": sampling_by})
        assert status == 400 and answer["error"]["param"] == param, answer
