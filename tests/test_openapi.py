"""`GET /openapi.json`: a valid OpenAPI 3.1 document, describing exactly the
routes the app serves, whose request schemas agree with the parsers: a
minimal example built from each schema is accepted, and breaking any one
documented constraint is refused with a 400 naming that field."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonschema
import orjson
import pytest
from openapi_spec_validator import validate

from mstar.errors import RequestError
from mstar.http.access import is_open
from mstar.http.openapi.document import document
from mstar.http.responses import error_body
from mstar.http.server import build_app
from mstar.http.speech.protocol import parse_speech
from mstar.http.speech.routes import speech_sampling
from mstar.types import SamplingParams

Schema = dict[str, Any]
BAD = "not-a-documented-value"


def resolve(schema: Schema) -> Schema:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return document()["components"]["schemas"][ref.rsplit("/", 1)[1]]


def body_schema(path: str) -> Schema:
    return resolve(document()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def minimal(schema: Schema, needing: str | None = None) -> dict[str, Any]:
    """The schema's required fields, each its example; of its `oneOf` branches
    the one that requires `needing`, else the first (a body may take one only)."""
    branches = schema.get("oneOf", [{}])
    branch = next((b for b in branches if needing in b.get("required", [])), branches[0])
    required = list(schema.get("required", [])) + list(branch.get("required", []))
    return {key: schema["properties"][key]["examples"][0] for key in required}


def violation(schema: Schema) -> Any:
    """A value breaking one documented constraint of a field, or None if there is none to break."""
    if "enum" in schema:
        return BAD
    kind = schema.get("type")
    if "maximum" in schema:
        return schema["maximum"] + 1
    if "exclusiveMinimum" in schema:
        return schema["exclusiveMinimum"]
    if "minimum" in schema:
        return schema["minimum"] - 1
    if "maxLength" in schema:
        return "x" * (schema["maxLength"] + 1)
    if kind in ("string", "object", "array"):
        return 12345
    if kind in ("integer", "number", "boolean"):
        return BAD
    return None


def violations(schema: Schema, prefix: str = "") -> Iterator[tuple[str, list[str], Any]]:
    """(field path as errors name it, keys to reach it, the bad value) for every property."""
    for key, prop in schema.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop and "additionalProperties" in prop:
            for name, keys, bad in violations(prop, f"{prefix}{key}."):
                yield name, [key, *keys], bad
        bad = violation(prop)
        if bad is not None:
            yield f"{prefix}{key}", [key], bad


def with_value(body: dict[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return out


def with_dependents(schema: Schema, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with what its fields' `dependentSchemas` fix (`stream_options` needs `stream: true`)."""
    out = dict(body)
    for key in body:
        for name, prop in schema.get("dependentSchemas", {}).get(key, {}).get("properties", {}).items():
            if "const" in prop:
                out[name] = prop["const"]
    return out


POST_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]
# Requests that would generate long on CPU get a short limit; it is not what the test is about.
SHORT = {"/v1/chat/completions": {"max_tokens": 2}, "/v1/completions": {}, "/generate": {}}


def test_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)  # raises on any departure from the OpenAPI 3.1 schema


def test_every_served_route_is_documented_and_vice_versa() -> None:
    app = build_app(None, manage_engine=False)  # type: ignore[arg-type]  # routes only, no engine runs
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = {(method, path) for path, item in document()["paths"].items() for method in item}
    assert served == documented


def test_the_bearer_key_is_documented_and_the_open_routes_say_so() -> None:
    doc = document()
    assert doc["components"]["securitySchemes"]["bearer"] == {**doc["components"]["securitySchemes"]["bearer"],
                                                              "type": "http", "scheme": "bearer"}
    for path, item in doc["paths"].items():
        for op in item.values():
            # the operations --api-key leaves open are exactly those that waive the document's security
            assert (op.get("security") == []) == is_open(path.replace("{name}", "demo.js")), path


def test_every_operation_documents_its_errors() -> None:
    for path, item in document()["paths"].items():
        for method, op in item.items():
            assert "500" in op["responses"], (method, path)
            if method == "post":
                assert {"400", "404"} <= set(op["responses"]), path
                assert resolve(op["responses"]["400"]["content"]["application/json"]["schema"]) is \
                    document()["components"]["schemas"]["Error"]


def test_the_chat_schema_refuses_audio_alone_as_the_parser_does() -> None:
    modalities = body_schema("/v1/chat/completions")["properties"]["modalities"]
    for value in (["text"], ["text", "audio"], ["audio", "text"]):
        jsonschema.validate(value, modalities)
    for value in (["audio"], []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, modalities)


def test_the_error_schema_takes_the_body_of_every_documented_status() -> None:
    statuses = {int(s) for item in document()["paths"].values() for op in item.values()
                for s in op["responses"] if s.startswith(("4", "5"))}
    assert {400, 429, 503} <= statuses
    for status in statuses:
        body = error_body("why", status=status, param="field", code="some_code")
        jsonschema.validate(body, document()["components"]["schemas"]["Error"])


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("path", POST_ROUTES)
async def test_minimal_examples_are_accepted(http: aiohttp.ClientSession, path: str) -> None:
    schema = body_schema(path)
    for needing in [None, *(k for b in schema.get("oneOf", []) for k in b.get("required", []))]:
        async with http.post(path, json={**minimal(schema, needing), **SHORT[path]}) as r:
            assert r.status == 200, (needing, await r.text())


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("path", POST_ROUTES)
async def test_each_broken_constraint_is_a_400_naming_its_field(http: aiohttp.ClientSession, path: str) -> None:
    schema = body_schema(path)
    cases = list(violations(schema))
    assert len(cases) >= 8
    for field, keys, bad in cases:
        async with http.post(path, json=with_dependents(schema, with_value(minimal(schema, keys[0]), keys, bad))) as r:
            answer = await r.json()
            assert r.status == 400, (field, bad, answer)
            assert answer["error"]["param"] == field, (field, bad, answer)


def test_speech_schema_agrees_with_its_parser() -> None:
    schema = body_schema("/v1/audio/speech")
    base = minimal(schema)
    speech_sampling(SamplingParams(), parse_speech(orjson.dumps(base)))
    cases = list(violations(schema))
    assert len(cases) >= 8
    for field, keys, bad in cases:
        with pytest.raises(RequestError) as caught:
            # Ranges are checked by the engine's one rule, once the model's defaults are merged as the route does.
            speech_sampling(SamplingParams(), parse_speech(orjson.dumps(with_value(base, keys, bad)))).validate()
        assert caught.value.field == field, (field, bad, caught.value)


def test_the_speech_event_stream_is_described_as_it_ends() -> None:
    """The speech stream ends with `speech.audio.done`, as OpenAI's, with no
    `data: [DONE]` after it; the text routes' streams do end with one."""
    answers = document()["paths"]["/v1/audio/speech"]["post"]["responses"]["200"]["content"]
    description = answers["text/event-stream"]["schema"]["description"]
    assert "speech.audio.done" in description and "no `data: [DONE]`" in description
    chat = document()["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "ending with `data: [DONE]`" in chat["text/event-stream"]["schema"]["description"]


def test_sampling_fields_that_the_model_may_set_claim_no_default() -> None:
    """Left out, a speech request's sampling is the model's (Orpheus: temperature
    0.6, top_p 0.8), not the text routes' defaults the schema would otherwise state."""
    fields = body_schema("/v1/audio/speech")["properties"]
    for key in ("temperature", "top_p", "repetition_penalty", "top_k", "min_p", "ignore_eos", "min_tokens"):
        assert "default" not in fields[key], key
    assert fields["temperature"]["maximum"] > 0  # the constraints stay
    assert "generation config" not in fields["temperature"].get("description", "")
    text = body_schema("/v1/completions")["properties"]
    # neither do the text routes' five a served folder's generation config may set: the description says
    for key in ("temperature", "top_p", "repetition_penalty", "top_k", "min_p"):
        assert "default" not in text[key] and "generation config" in text[key]["description"], key
    assert text["presence_penalty"]["default"] == 0.0
