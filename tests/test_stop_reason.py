"""vLLM's `stop_reason` for an answer that ended on a token: the
`stop_token_ids` id it ended on, but None for the model's EOS, also when the
request's `stop_token_ids` names that id too (vLLM checks EOS first), unless
the request ignores EOS."""

from __future__ import annotations

from http_support import MODEL, running_engine

from mstar.engine.eventloop.requests import RequestState
from mstar.types import GenerateRequest, OutputChunk, SamplingParams


def _ended_on(token: int, sampling: SamplingParams, eos: frozenset[int]) -> OutputChunk:
    st = RequestState("r", walk=None, sampling=sampling, num_prompt_tokens=3, worker=0,  # type: ignore[arg-type]
                      detok=None, stop_token_ids=eos | frozenset(sampling.stop_token_ids), eos_ids=eos)
    st.feed_token("llm", token, "")
    st.finish("stop")
    chunks = []
    while st.queue._items:
        chunks.append(st.queue.get_nowait())
    return chunks[-1]


def test_an_eos_named_in_stop_token_ids_ends_as_eos() -> None:
    sampling = SamplingParams(stop_token_ids=(7, 9))
    assert _ended_on(9, sampling, frozenset({7})).stop_reason == 9
    assert _ended_on(7, sampling, frozenset({7})).stop_reason is None
    # with ignore_eos the engine gives no EOS ids: 7 then ends the answer as a stop id
    assert _ended_on(7, sampling, frozenset()).stop_reason == 7


async def test_the_engine_tells_a_request_its_models_eos() -> None:
    async with running_engine() as engine:
        prompt = {"prompt_ids": [5, 6, 7]}
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        written = [t async for c in engine.submit(GenerateRequest("free", MODEL, prompt, greedy)) for t in c.token_ids]
        stop_at = written[2]
        engine._model(MODEL)._generation_eos = (stop_at,)  # as a checkpoint whose generation_config names it EOS
        for ignore_eos, expected in ((False, None), (True, stop_at)):
            sp = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=ignore_eos)
            chunks = [c async for c in engine.submit(GenerateRequest(f"stop-{ignore_eos}", MODEL, prompt, sp))]
            assert chunks[-1].finish_reason == "stop" and chunks[-1].num_output_tokens == written.index(stop_at) + 1
            assert chunks[-1].stop_reason == expected
