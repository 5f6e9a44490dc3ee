"""The graph layer: chunk policies, walk compilation, and the validation
errors that name the walk and the step."""

from __future__ import annotations

import pytest

from mstar.errors import WalkError
from mstar.graph import (Component, Emit, EosToken, FanOut, FixedChunks, Loop, MaxTokens, SlidingWindow, Step,
                         Stream, Walk, compile_walk)

COMPONENTS = {
    "llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True),
    "codec": Component(modes=("window",)),
}


def _speak(**overrides) -> Walk:
    parts = dict(
        prefill=Step("llm", "prefill", "prompt_ids", "token"),
        loop=Loop(Step("llm", "decode", "token", "token"), until=EosToken() | MaxTokens()),
        stream=Stream("token", Step("codec", "window", "token", "pcm"), SlidingWindow(28, 7)),
    )
    parts.update(overrides)
    return Walk(parts["prefill"], parts["loop"], parts["stream"], Emit("pcm", "audio"), inputs=("prompt_ids",))


def test_sliding_window_cuts_every_stride_and_flushes_the_tail() -> None:
    w = SlidingWindow(size=28, stride=7)
    assert w.ready(27, 0) == []
    assert w.ready(35, 0) == [(0, 28), (7, 35)]
    assert w.ready(36, 2) == []
    assert w.flush(36, 2) == [(14, 36)]  # the next window, cut short at the end
    assert w.flush(35, 2) == []          # every item already covered
    assert w.flush(10, 0) == [(0, 10)]   # a stream shorter than one window
    assert w.keep_from(36, 2) == 14


def test_fixed_chunks() -> None:
    c = FixedChunks(3)
    assert c.ready(7, 0) == [(0, 3), (3, 6)]
    assert c.flush(7, 2) == [(6, 7)]
    assert c.flush(6, 2) == []


def test_a_speak_walk_compiles_into_two_partitions() -> None:
    plan = compile_walk("speak", _speak(), COMPONENTS)
    assert set(plan.partitions) == {"llm", "codec"}
    assert plan.root == "llm"
    assert plan.streams["token"][0].consumer == "codec"
    assert plan.emits["pcm"].modality == "audio"


def test_reading_a_value_nothing_writes_is_refused() -> None:
    bad = _speak(prefill=Step("llm", "prefill", "text_ids", "token"))
    with pytest.raises(WalkError) as e:
        compile_walk("speak", bad, COMPONENTS)
    assert e.value.walk == "speak" and e.value.step == "llm.prefill" and "text_ids" in str(e.value)


def test_a_stream_with_no_consumer_is_refused() -> None:
    with pytest.raises(WalkError) as e:
        compile_walk("speak", _speak(stream=Stream("token", None, SlidingWindow(28, 7))), COMPONENTS)
    assert e.value.step == "stream token" and "no consumer" in str(e.value)


def test_a_loop_with_no_stop_rule_is_refused() -> None:
    with pytest.raises(WalkError) as e:
        compile_walk("speak", _speak(loop=Loop(Step("llm", "decode", "token", "token"), until=None)), COMPONENTS)
    assert e.value.step == "loop llm.decode" and "stop rule" in str(e.value)


def test_unknown_components_modes_and_emits_are_refused() -> None:
    with pytest.raises(WalkError, match="unknown component 'vit'"):
        compile_walk("w", Walk(Step("vit", "encode", "x", "y"), inputs=("x",)), COMPONENTS)
    with pytest.raises(WalkError, match="no mode 'encode'"):
        compile_walk("w", Walk(Step("llm", "encode", "x", "y"), inputs=("x",)), COMPONENTS)
    with pytest.raises(WalkError, match="emits 'audio'"):
        compile_walk("w", Walk(Step("llm", "prefill", "x", "y"), Emit("audio"), inputs=("x",)), COMPONENTS)


def test_a_stream_must_come_after_a_step_writing_its_source() -> None:
    walk = Walk(Stream("token", Step("codec", "window", "token", "pcm"), FixedChunks(4)),
                Step("llm", "prefill", "x", "token"), inputs=("x",))
    with pytest.raises(WalkError, match="not written by a step of"):
        compile_walk("w", walk, COMPONENTS)


def test_fanout_branches_become_partitions_started_after_their_parent_step() -> None:
    walk = Walk(Step("llm", "prefill", "x", "token"),
                FanOut(((Step("codec", "window", "token", "a"),), (Step("codec", "window", "token", "b"),)),
                       names=("left", "right")),
                Emit("a"), Emit("b"), inputs=("x",))
    plan = compile_walk("w", walk, COMPONENTS)
    assert plan.forks[("llm", 1)] == ("left", "right")  # they start when the cursor reaches 1
    assert plan.partitions["left"].parent == "llm"


def test_graph_imports_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import mstar.graph\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_more_input_names_inputs_the_first_step_reads() -> None:
    steps = (Step("llm", "prefill", "x", "token"), Loop(Step("llm", "decode", "token", "token"), until=MaxTokens()))
    plan = compile_walk("w", Walk(*steps, inputs=("x", "y"), more_input=("x", "y")), COMPONENTS)
    assert plan.more_input == ("x", "y")
    assert compile_walk("w", Walk(*steps, inputs=("x",), more_input="x"), COMPONENTS).more_input == ("x",)
    with pytest.raises(WalkError, match=r"\['z'\] are not inputs of the walk"):
        compile_walk("w", Walk(*steps, inputs=("x",), more_input=("x", "z")), COMPONENTS)
    with pytest.raises(WalkError, match="first node must be a step reading one of them"):
        compile_walk("w", Walk(*steps, inputs=("x", "y"), more_input=("y",)), COMPONENTS)
