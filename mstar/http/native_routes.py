"""The native route, `POST /generate`: text or token ids plus `SamplingParams`
by name come in; one JSON answer (`text`, `token_ids`, `finish_reason`,
`usage`) or an NDJSON stream (one object per chunk, the last one `finished`)
goes out.
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any

import structlog
from aiohttp import web

from mstar.http.keys import ENGINE
from mstar.http.protocol import parse_generate
from mstar.http.responses import EventStream, client_gone, error_body, json_response
from mstar.http.submission import Submission, encode_prompt, failure_of, fit_max_tokens, resolve_model, submit

log = structlog.get_logger("mstar.http")


async def generate(request: web.Request) -> web.StreamResponse:
    body = parse_generate(await request.read())
    engine = request.app[ENGINE]
    target = resolve_model(engine, body.model)
    field = "text" if isinstance(body.prompt, str) else "input_ids"
    ids = encode_prompt(target, body.prompt, field)
    limit = fit_max_tokens(body.sampling.max_tokens, len(ids), target.max_model_len, field,
                           "sampling_params.max_tokens")
    request_id = f"gen-{uuid.uuid4().hex}"
    sub = submit(engine, request_id, target, [ids], body.sampling, [limit])
    try:
        if body.stream:
            return await _stream_ndjson(request, sub, request_id)
        [choice] = await sub.run_to_end(client_gone(request))
        return json_response({"request_id": request_id, "text": choice.text, "token_ids": choice.token_ids,
                              "finish_reason": choice.finish_reason, "usage": sub.usage()})
    finally:
        await sub.aclose()


async def _stream_ndjson(request: web.Request, sub: Submission, request_id: str) -> web.StreamResponse:
    """One line per engine chunk; a failure after the headers is a final line
    with `error`; a client that left ends the loop and the caller aborts."""
    events = await EventStream.open(request, "ndjson")
    try:
        async with aclosing(sub.chunks()) as chunks:
            async for choice, chunk in chunks:
                line: dict[str, Any] = {"request_id": request_id, "token_ids": list(chunk.token_ids),
                                        "text": chunk.text, "finished": chunk.finished}
                if chunk.finished:
                    failure = failure_of(choice)
                    if failure is not None:
                        log.warning("generation failed mid-stream", error=failure.message)
                        await events.fail({**line, **error_body(failure.message, status=failure.status,
                                                                code=failure.code)})
                        return events.response
                    line["finish_reason"] = choice.finish_reason
                    line["usage"] = sub.usage()
                await events.send(line)
        await events.close()
    except ConnectionError:
        log.info("client went away mid-stream; aborting its request")
    except Exception:
        log.exception("stream failed")
        await events.fail({"request_id": request_id, "finished": True,
                           **error_body("internal server error", status=500, code="internal_error")})
    return events.response
