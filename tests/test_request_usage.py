"""What a request's usage counts (`RequestState`, on the event loop): a
partition a stop string stopped counts the text tokens the event loop took
in up to the stop, whatever its worker last counted for the row; every
other partition counts what its worker sampled (a speech walk's tokens are
audio the event loop never sees); parts on several workers add up."""

from __future__ import annotations

from typing import Any

from mstar.engine.eventloop.requests import RequestState
from mstar.types import SamplingParams


def _state(**fields: Any) -> RequestState:
    return RequestState("r", walk=None, sampling=SamplingParams(stop=("xx",)),  # type: ignore[arg-type]
                        num_prompt_tokens=3, worker=0, detok=None, **fields)


def test_a_stopped_text_partition_counts_what_was_taken_in_and_the_rest_what_was_sampled() -> None:
    st = _state()
    for _ in range(4):
        assert not st.feed_token("thinker", 5, "a")
    assert st.feed_token("thinker", 6, "xx")  # the stop string: the event loop stops the partition
    assert st.stopped == {"thinker"}
    # the worker's count of the stopped row is the one it last had (2); the talker's frames ran to their end (9)
    assert st.shard_done("stop", None, {"thinker": 2, "talker": 9}, 0) == "stop"
    assert st.num_generated == 5 + 9 and st.num_output_tokens == 14


def test_a_stopped_partition_does_not_count_what_its_worker_drew_after_the_stop() -> None:
    st = _state()
    st.feed_token("llm", 5, "a")
    st.feed_token("llm", 6, "xx")
    st.shard_done("stop", None, {"llm": 4}, 0)  # two more drawn before the stop reached the worker
    assert st.num_generated == 2 and st.num_output_tokens == 2


def test_a_partition_that_ran_its_course_counts_what_its_worker_sampled() -> None:
    spoken = _state()  # a speech walk: no text reaches the event loop
    assert spoken.shard_done("length", None, {"llm": 40, "codec": 0}, 0) == "length"
    assert spoken.num_output_tokens == 40
    text = _state()
    for _ in range(3):
        text.feed_token("llm", 5, "a")
    text.shard_done("length", None, {"llm": 3}, 0)
    assert text.num_output_tokens == 3


def test_parts_on_two_workers_add_up_once_both_are_done() -> None:
    st = _state(places={"thinker": 0, "talker": 1})
    st.feed_token("thinker", 5, "a")
    assert st.shard_done("stop", None, {"thinker": 1}, 0) is None and st.num_output_tokens == 1
    assert st.shard_done("stop", None, {"talker": 6}, 1) == "stop"
    assert st.num_generated == 7 and st.num_output_tokens == 7
