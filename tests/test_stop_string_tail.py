"""A request's text held back to its end (the detokenizer's partial
character, released by `finish`) still meets its stop strings: where that
tail completes one, the answer is cut there and ends "stop", as vLLM's
(which checks stop strings before the length), never "length" with the text
cut anyway."""

from __future__ import annotations

from mstar.engine.eventloop.requests import RequestState
from mstar.models.tokenizer import IncrementalDetokenizer, builtin_byte_tokenizer
from mstar.types import OutputChunk, SamplingParams


def _state(stop: tuple[str, ...]) -> RequestState:
    detok = IncrementalDetokenizer(builtin_byte_tokenizer())
    return RequestState("r", walk=None, sampling=SamplingParams(stop=stop),  # type: ignore[arg-type]
                        num_prompt_tokens=3, worker=0, detok=detok)


def _last_token_holds_back(st: RequestState) -> None:
    """One step whose token (a BPE token's worth: "ab" and the first byte of
    a three-byte character) renders as text ending in U+FFFD: all of it is held."""
    assert st.detok is not None
    assert st.detok.push([ord("a"), ord("b"), 0xE2]) == ""
    assert not st.feed_token("llm", 0xE2, "")


def _chunks(st: RequestState) -> list[OutputChunk]:
    out = []
    while not st.queue.empty():
        out.append(st.queue.get_nowait())
    return out


def test_a_stop_string_in_the_held_back_tail_ends_the_answer_as_stop() -> None:
    st = _state(("ab",))
    _last_token_holds_back(st)
    assert st.shard_done("length", None, {"llm": 1}, 0) == "length"  # the worker ran out of max_tokens
    assert st.finish("length") == "stop"
    last = _chunks(st)[-1]
    assert last.finished and last.finish_reason == "stop" and last.text == ""


def test_a_held_back_tail_that_completes_no_stop_string_is_released_as_it_ended() -> None:
    st = _state(("zz",))
    _last_token_holds_back(st)
    st.shard_done("length", None, {"llm": 1}, 0)
    assert st.finish("length") == "length"
    last = _chunks(st)[-1]
    assert last.finish_reason == "length" and last.text == "ab\ufffd"
