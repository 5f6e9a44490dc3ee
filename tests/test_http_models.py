"""`GET /v1/models/{model}`: the official `openai` client's
`models.retrieve` gets the model's card (a speech model's with its voices),
an id with a slash included, and an unknown id a 404 `model_not_found`; the
SDK's model card carries the voices too."""

from __future__ import annotations

import openai
import pytest
from http_support import running_engine, serving

from mstar.client import AsyncClient, MstarError
from mstar.config import EngineConfig
from mstar.engine.engine import Engine

pytestmark = pytest.mark.asyncio

ORPHEUS_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]


async def test_retrieve_with_the_openai_client_and_the_sdk() -> None:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        model = await client.models.retrieve("orpheus-tiny")
        assert (model.id, model.object, model.owned_by) == ("orpheus-tiny", "model", "mstar")
        assert model.model_extra is not None and model.model_extra["voices"] == ORPHEUS_VOICES
        listed = (await client.models.list()).data
        assert [m.model_dump() for m in listed] == [model.model_dump()]
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("no-such-model")
        assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert caught.value.body["param"] == "model"  # type: ignore[index]

        async with AsyncClient(url) as sdk:
            card = await sdk.model("orpheus-tiny")
            assert card.id == "orpheus-tiny" and card.voices == tuple(ORPHEUS_VOICES)
            assert card.max_model_len == 2048
            assert [c.voices for c in await sdk.models()] == [tuple(ORPHEUS_VOICES)]
            with pytest.raises(MstarError) as refused:
                await sdk.model("no-such-model")
            assert refused.value.status == 404 and refused.value.code == "model_not_found"


async def test_an_id_with_a_slash() -> None:
    engine = Engine(EngineConfig(model="tiny-llama", served_model_name="org/tiny-llama"))
    await engine.start()
    try:
        async with serving(engine) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            model = await client.models.retrieve("org/tiny-llama")  # sent as org%2Ftiny-llama
            assert model.id == "org/tiny-llama" and model.model_extra["voices"] == []  # type: ignore[index]
            async with AsyncClient(url) as sdk:
                assert (await sdk.model("org/tiny-llama")).voices == ()
    finally:
        await engine.shutdown()


def test_served_model_name_help_says_what_answers_name() -> None:
    """The help said answers name the model by the first name; they echo the request's (the test below)."""
    from mstar.config import build_parser

    flag = next(a for a in build_parser()._actions if "--served-model-name" in a.option_strings)
    assert "echoes the name its request used" in flag.help and "by the first" not in flag.help


async def test_several_served_names_answer_to_each_naming_the_first() -> None:
    """vLLM's `--served-model-name a b`: the server answers to every name,
    `/v1/models` lists each (its root the model it was loaded from), answers
    echo the name the request used, and a realtime session takes either."""
    from mstar.config import parse_args

    config = parse_args(["--model", "tiny-llama", "--served-model-name", "tiny", "org/alias", "tiny"]).engine
    assert (config.served_model_name, config.served_model_aliases) == ("tiny", ("org/alias",))  # each once
    engine = Engine(config)
    await engine.start()
    try:
        async with serving(engine) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            listed = (await client.models.list()).data
            assert [m.id for m in listed] == ["tiny", "org/alias"]
            assert all(m.model_extra["root"] == "tiny-llama" for m in listed)  # type: ignore[index]  # vLLM's
            assert (await client.models.retrieve("org/alias")).id == "org/alias"
            for name in ("tiny", "org/alias"):
                done = await client.completions.create(model=name, prompt="Hi", max_tokens=2)
                assert done.model == name  # the name the request used, as vLLM echoes it
            async with client.realtime.connect(model="org/alias") as conn:
                created = await conn.recv()
                assert created.type == "session.created"
                for name in ("org/alias", "tiny"):  # either of its names, repeated in an update
                    await conn.session.update(session={"type": "realtime", "model": name})
                    assert (await conn.recv()).type == "session.updated"
            for name in ("alias", "tiny-llama"):  # served under its names only, as vLLM serves it
                with pytest.raises(openai.NotFoundError):
                    await client.completions.create(model=name, prompt="Hi", max_tokens=2)
    finally:
        await engine.shutdown()
