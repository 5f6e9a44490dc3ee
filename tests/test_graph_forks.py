"""Forks and their branches in the graph: the program a fork, an `Each` and
a join lay out, and every malformed use `compile_walk` refuses at model
load, naming the walk and the node."""

from __future__ import annotations

import pytest
from toys.image_gen import ToyImageModel

from mstar.errors import WalkError
from mstar.graph import (Component, Each, Emit, Fork, ForkRows, In, Kind, Loop, MaxSteps, MaxTokens, Mode, Out, Run,
                         Step, Walk, compile_walk)

REDO = Mode("redo", (In("ids", Kind.IDS),), (), kv="append", query="ids", reset=True)
COMPONENTS = {**ToyImageModel.components,
              "llm": Component(modes=(*ToyImageModel.components["llm"].signatures.values(), REDO), kv_cache=True),
              "lm": Component(modes=(Mode("prefill", (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN),),
                                          kv="append", query="ids"),), kv_cache=True, samples=True),
              "rnn": Component(modes=(Mode("prefill", (In("ids", Kind.IDS),), (), kv="append", query="ids"),),
                               kv_cache=True, state=True)}
INPUTS = ("ids", "text", "latent", "n", "scale")
IMAGE = Step("llm", "prefill", {"ids": "ids"}, ())
VELOCITY = Step("llm", "velocity", {"x": "latent", "t": "@i"}, {"v": "v"})
PER_BRANCH = Step("sched", "step", {"x": "latent", "v": "latent", "n": "n"}, {"x": "v"})  # writes v in each
CFG = Step("sched", "cfg", {"x": "latent", "v": "v", "n": "n", "scale": "scale"}, {"x": "latent"})


def _compile(*nodes, more_input=None):
    return compile_walk("w", Walk(*nodes, inputs=INPUTS, more_input=more_input), COMPONENTS)


def test_a_fork_its_branches_and_a_join_lay_out_a_program() -> None:
    plan = compile_walk("cfg", ToyImageModel.walks["generate_cfg"], ToyImageModel.components).partitions["llm"]
    fork = plan.program[1]
    assert isinstance(fork, ForkRows) and fork.component == "llm" and fork.fork.names == ("main", "no_text", "no_image")
    text, velocity, cfg = plan.program[2], plan.program[4], plan.program[5]
    assert isinstance(text, Run) and text.branches == ("main", "no_image")
    assert velocity.branches == ("main", "no_text", "no_image") and velocity.own == ()
    assert cfg.joins == (("v", ("main", "no_text", "no_image")),) and cfg.checks == 0


@pytest.mark.parametrize("nodes, where, says", [
    ((IMAGE, Each(VELOCITY)), "each in llm", "no Fork comes before it"),
    ((IMAGE, Fork(("a", "share")), Each(VELOCITY, only=("b",))), "each in llm", "branches ['b']"),
    ((IMAGE, Fork(("a", "share")), Each(PER_BRANCH, only=("a",)), CFG), "sched.cfg", "joins 'v' over one branch"),
    ((IMAGE, Fork(("a", "share"), ("b", "fresh")), Each(PER_BRANCH, only=("a",)), Each(
        Step("sched", "cfg", {"x": "latent", "v": "v", "n": "n", "scale": "scale"}, {"x": "y"}))),
     "each in llm/sched.cfg", "branch 'main' reads 'v', which it does not write"),
    ((IMAGE, Fork(("main", "share"))), "fork in llm", "take 'main'"),
    ((IMAGE, Fork(("a", "copy"))), "fork in llm", "not 'copy'"),
    ((IMAGE, Fork(("a", "share")), Fork(("b", "share"))), "fork in llm", "forks its KV row once"),
    ((Fork(("a", "share")), IMAGE), "fork in llm", "stepped KV components []"),
    ((IMAGE, Step("lm", "prefill", {"ids": "ids"}, {"token": "t"}), Fork(("a", "share"))), "fork in llm",
     "name the one to fork"),
    ((IMAGE, Fork(("a", "share")), Each(PER_BRANCH), Emit("v")), "emit v", "per branch"),
    # a branch's full pages are main's: a cache starting over would write into them
    ((IMAGE, Fork(("a", "share")), Each(Step("llm", "redo", {"ids": "ids"}, ()))), "each in llm/llm.redo",
     "restarts the cache of 'llm'"),
    ((Step("rnn", "prefill", {"ids": "ids"}, ()), Fork(("a", "share"))), "fork in rnn", "per-row state"),
    ((IMAGE, Fork(("a", "share")), Loop((Each(Step("sched", "cfg", {"x": "latent", "v": "latent", "n": "n",
                                                                   "scale": "scale"}, {"x": "latent"})),),
                                        until=MaxSteps(2), value="latent")),
     "loop sched.cfg/each/sched.cfg", "a loop's value, per branch"),
])
def test_malformed_forks_are_refused_naming_walk_and_node(nodes, where: str, says: str) -> None:
    with pytest.raises(WalkError) as caught:
        _compile(*nodes)
    assert caught.value.walk == "w" and caught.value.step == where, str(caught.value)
    assert says in str(caught.value)


def test_a_partition_taking_turns_cannot_fork() -> None:
    nodes = (Step("lm", "prefill", {"ids": "ids"}, {"token": "t"}), Fork(("a", "share")),
             Loop(Step("lm", "prefill", {"ids": "t"}, {"token": "t"}), until=MaxTokens()))
    with pytest.raises(WalkError, match="taking turns of more input cannot fork"):
        _compile(*nodes, more_input="ids")
