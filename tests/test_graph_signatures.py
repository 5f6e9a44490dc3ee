"""Mode signatures and walks that bind by them: a component's declared modes,
the signatures name-only modes imply, and every binding `compile_walk` refuses
at model load (naming the walk and the node), next to walks of the seed
models' shapes that compile."""

from __future__ import annotations

import pytest
from toys.audio_decoder import DECODE, ENCODE, PREFILL  # the toy audio decoder's signatures, which run

from mstar.errors import WalkError
from mstar.graph import (Collect, Component, Emit, EosToken, In, Kind, Loop, MaxSteps, MaxTokens, Mode, Out,
                         SlidingWindow, Step, Stream, Walk, compile_walk)

TALK = Mode("talk", (In("ids", Kind.IDS), In("h", Kind.EMBEDS), In("j", Kind.INDEX, optional=True)),
            (Out("code", Kind.TOKEN),), kv="append", query="ids")
FUSED = Mode("fused", (In("ids", Kind.IDS),), (Out("code", Kind.TOKEN), Out("frame", Kind.TENSOR)), kv="append",
              query="ids", draws=3)
WRITE_ONLY = Mode("context", (In("ids", Kind.IDS),), (), kv="append", query="ids")
CHUNK = Mode("chunk", (In("codes", Kind.TENSOR), In("index", Kind.INDEX)), (Out("pcm", Kind.TENSOR),))

COMPONENTS = {
    "enc": Component(modes=(ENCODE,)),
    "thinker": Component(modes=(PREFILL, DECODE, WRITE_ONLY), kv_cache=True),
    "talker": Component(modes=(TALK, FUSED), kv_cache=True),
    "codec": Component(modes=(CHUNK,)),
    "llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True),
    "plain": Component(modes=("tick",)),
}


def _compile(*nodes, inputs=("mel", "prompt_ids", "mrope")):
    return compile_walk("w", Walk(*nodes, inputs=inputs), COMPONENTS)


def test_a_component_keeps_mode_names_and_their_signatures() -> None:
    thinker = COMPONENTS["thinker"]
    assert thinker.modes == ("prefill", "decode", "context")
    assert thinker.signature("decode") is DECODE
    implied = COMPONENTS["llm"].signature("decode")
    assert implied.inputs == (In("ids", Kind.IDS),) and implied.outputs == (Out("token", Kind.TOKEN),)
    assert implied.kv == "append" and implied.graph and not COMPONENTS["llm"].signature("prefill").graph
    assert COMPONENTS["plain"].signature("tick") is None  # bound by position, as before


@pytest.mark.parametrize("build, says", [
    (lambda: Mode("m", (In("x", Kind.IDS),), (), kv="append"), "query"),
    (lambda: Mode("m", (In("x", Kind.TENSOR),), (), kv="append", query="x"), "query"),
    (lambda: Mode("m", (In("x", Kind.IDS, optional=True),), (), kv="read", query="x"), "query"),
    (lambda: Mode("m", (In("x", Kind.IDS), In("x", Kind.TENSOR)), ()), "twice"),
    (lambda: Mode("m", (In("x", Kind.TOKEN),), ()), "kinds"),
    (lambda: Mode("m", (In("x", Kind.IDS),), (), query="x"), "KV modes"),
    (lambda: Mode("m", (In("x", Kind.TENSOR),), (Out("y", Kind.TENSOR),), draws=2), "KV modes"),
    (lambda: Mode("m", (In("x", Kind.IDS),), (), kv="append", query="x", draws=-1), "0 or more"),
    (lambda: Component(modes=(DECODE,)), "KV cache"),
    (lambda: Component(modes=("a", Mode("a", (), ()))), "twice"),
])
def test_a_malformed_signature_is_refused(build, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        build()


def test_a_walk_of_the_omni_shape_compiles_and_its_kinds_flow() -> None:
    plan = _compile(
        Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
        Step("thinker", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"},
             {"token": "text", "hidden": "prompt_hidden"}),
        Loop(Step("thinker", "decode", {"ids": "text"}, {"token": "text", "hidden": "h"}),
             until=EosToken() | MaxTokens()),
        Step("talker", "talk", {"ids": "text", "h": "h"}, {"code": "code"}),
        Loop(Step("talker", "talk", {"ids": "code", "h": "h", "j": "@i"}, {"code": "code"}), until=MaxSteps(4)),
        Stream("code", Step("codec", "chunk", {"codes": "code", "index": "@chunk"}, {"pcm": "pcm"}),
               SlidingWindow(4, 2)),
        Emit("text"), Emit("pcm", modality="audio"))
    assert set(plan.partitions) == {"enc", "codec"} and plan.emits.keys() == {"text", "pcm"}
    steps = plan.partitions["enc"].nodes
    assert steps[1].inputs == ("prompt_ids", "audio_emb", "mrope")  # values in binding order
    assert steps[1].input_names == ("ids", "audio", "pos") and steps[0].input_names == ("mel",)


def test_optional_inputs_may_be_left_out_and_a_kv_append_may_write_nothing() -> None:
    _compile(Step("thinker", "prefill", {"ids": "prompt_ids", "pos": "mrope"}, {"token": "t"}),
             Step("thinker", "context", "t", ()), Emit("t"))


@pytest.mark.parametrize("nodes, where, says", [
    ((Step("thinker", "prefill", {"ids": "prompt_ids", "pos": "mrope", "wav": "mel"}, {"token": "t"}),),
     "thinker.prefill", "does not have"),
    ((Step("thinker", "prefill", {"ids": "prompt_ids"}, {"token": "t"}),), "thinker.prefill", "['pos']"),
    ((Step("thinker", "prefill", ("prompt_ids", "mel", "mrope", "mrope"), "t"),), "thinker.prefill", "position"),
    ((Step("thinker", "prefill", {"ids": "prompt_ids", "pos": "mrope"}, {"tok": "t"}),), "thinker.prefill",
     "does not have"),
    # a sampled token where embeddings are wanted
    ((Step("thinker", "prefill", {"ids": "prompt_ids", "pos": "mrope"}, {"token": "t"}),
      Step("talker", "talk", {"ids": "t", "h": "t"}, {"code": "c"})), "talker.talk", "takes embeds"),
    # hidden states where token ids are wanted
    ((Step("thinker", "prefill", {"ids": "prompt_ids", "pos": "mrope"}, {"hidden": "h"}),
      Step("thinker", "context", {"ids": "h"}, ())), "thinker.context", "takes ids"),
    ((Step("talker", "talk", {"ids": "prompt_ids", "h": "mel", "j": "@i"}, {"code": "c"}),), "talker.talk",
     "outside a loop"),
    ((Step("codec", "chunk", {"codes": "mel", "index": "@chunk"}, {"pcm": "p"}),), "codec.chunk",
     "in a step that reads no stream"),
    ((Step("codec", "chunk", {"codes": "mel", "index": "@step"}, {"pcm": "p"}),), "codec.chunk", "no built-in"),
    ((Step("plain", "tick", {"x": "mel"}, "y"),), "plain.tick", "declares no signature"),
    # a mode that draws tokens itself, with no key for them; a key for a mode that draws none
    ((Step("talker", "fused", {"ids": "prompt_ids"}, {"code": "c", "frame": "f"}),), "talker.fused",
     "name their key (draws=)"),
    ((Step("talker", "talk", {"ids": "prompt_ids", "h": "mel"}, {"code": "c"}, draws="cp"),), "talker.talk",
     "declares none"),
    ((Step("enc", "encode", {"mel": "mel"}, ()),), "enc.encode", "writes nothing"),
    ((Step("enc", "encode", {"mel": "audio"}, {"emb": "e"}),), "enc.encode", "nothing writes before it"),
])
def test_a_malformed_binding_fails_at_load_naming_walk_and_node(nodes, where: str, says: str) -> None:
    with pytest.raises(WalkError) as caught:
        _compile(*nodes)
    message = str(caught.value)
    assert caught.value.walk == "w" and caught.value.step.endswith(where), message
    assert says in message, message


def test_name_only_models_compile_as_before() -> None:
    plan = compile_walk("speak", Walk(
        Step("llm", "prefill", "prompt_ids", "token"),
        Loop(Step("llm", "decode", "token", "token"), until=EosToken() | MaxTokens()),
        Emit("token"), inputs=("prompt_ids",)), COMPONENTS)
    loop = plan.partitions["llm"].nodes[1]
    assert loop.step.inputs == ("token",) and loop.step.input_names is None and loop.value == "token"


def test_what_a_component_on_its_own_stream_writes_reaches_only_the_client() -> None:
    """Nothing orders another component's reads after an `own_stream`
    component's steps: a walk that feeds its output on is refused, one that
    emits it compiles."""
    side = {**COMPONENTS, "codec": Component(modes=(CHUNK,), own_stream=True),
            "post": Component(modes=(Mode("polish", (In("pcm", Kind.TENSOR),), (Out("wav", Kind.TENSOR),)),))}
    emits = Walk(Step("codec", "chunk", ("codes", "index"), "pcm"), Emit("pcm", modality="audio"),
                 inputs=("codes", "index"))
    assert compile_walk("w", emits, side).emits.keys() == {"pcm"}
    feeds = Walk(Step("codec", "chunk", ("codes", "index"), "pcm"), Step("post", "polish", "pcm", "wav"),
                 Emit("wav", modality="audio"), inputs=("codes", "index"))
    with pytest.raises(WalkError, match="own_stream"):
        compile_walk("w", feeds, side)
    # the same walk with the codec on the worker's stream is fine
    assert compile_walk("w", feeds, {**side, "codec": COMPONENTS["codec"]}).emits.keys() == {"wav"}


GEN = Mode("gen", (In("x", Kind.TENSOR),), (Out("codes", Kind.TENSOR),))
TO_X = Mode("back", (In("codes", Kind.TENSOR),), (Out("x", Kind.TENSOR),))
WAVE = Mode("wave", (In("codes", Kind.TENSOR),), (Out("pcm", Kind.TENSOR),))
OWN = {"codec": Component(modes=(WAVE, TO_X), own_stream=True), "gen": Component(modes=(GEN,)),
       "post": Component(modes=(Mode("polish", (In("pcm", Kind.TENSOR),), (Out("wav", Kind.TENSOR),)),))}


@pytest.mark.parametrize("nodes", [
    # a loop's collection of its writes, read by another component
    (Step("gen", "gen", "x", "codes"),
     Loop(Step("codec", "wave", "codes", "pcm"), until=MaxSteps(3), collect=Collect("all", "pcm")),
     Step("post", "polish", "all", "wav"), Emit("wav")),
    # what its step wrote in a loop's last round, read by another component's step in the next
    (Step("gen", "gen", "x", "codes"),
     Loop((Step("gen", "gen", "x", "codes"), Step("codec", "back", "codes", "x")), until=MaxSteps(3)),
     Emit("codes")),
    # a loop counting its rounds by its output
    (Step("gen", "gen", "x", "codes"), Step("codec", "back", "codes", "x"),
     Loop(Step("gen", "gen", "x", "codes"), until=MaxSteps(value="x")), Emit("codes")),
], ids=["collected", "next-round", "loop-cap"])
def test_no_path_lets_another_component_read_an_own_stream_value(nodes) -> None:
    with pytest.raises(WalkError, match="own_stream"):
        compile_walk("w", Walk(*nodes, inputs=("x",)), OWN)


def test_own_stream_is_for_components_without_a_kv_cache() -> None:
    with pytest.raises(ValueError, match="own_stream"):
        Component(modes=("decode",), kv_cache=True, own_stream=True)
