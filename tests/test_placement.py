"""Placement specs: parsing, resolution against a model's components and
walks (with the errors that name what is wrong), and routing a request's
partitions onto devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar.config import parse_args
from mstar.errors import ConfigError
from mstar.graph import Component, FanOut, Loop, MaxSteps, Step, Stream, FixedChunks, Walk, compile_walks
from mstar.placement import PlacementSpec, describe, parse_spec, resolve

COMPONENTS = {
    "llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True),
    "codec": Component(modes=("window",)),
}
WALKS = compile_walks({
    "speak": Walk(Step("llm", "prefill", "p", "t"), Loop(Step("llm", "decode", "t", "t"), until=MaxSteps(4)),
                  Stream("t", Step("codec", "window", "t", "pcm"), FixedChunks(2)), inputs=("p",)),
    "generate": Walk(Step("llm", "prefill", "p", "t"), Loop(Step("llm", "decode", "t", "t"), until=MaxSteps(4)),
                     inputs=("p",)),
}, COMPONENTS)
DEVICES = ("cuda:0", "cuda:1")


def test_parse_spec_forms(tmp_path: Path) -> None:
    assert parse_spec(None) == PlacementSpec("replicas")
    assert parse_spec("split") == PlacementSpec("split")
    assert parse_spec("llm=0+1, codec=cuda:1") == PlacementSpec(
        "explicit", (("llm", ("0", "1")), ("codec", ("cuda:1",))))
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"llm": [0, 1], "codec.window": "cuda:1"}))
    assert parse_spec(None, str(f)) == PlacementSpec("explicit", (("llm", ("0", "1")), ("codec.window", ("cuda:1",))))
    y = tmp_path / "p.yaml"
    y.write_text("llm: 0\ncodec: [1]\n")
    assert parse_spec(None, str(y)) == PlacementSpec("explicit", (("llm", ("0",)), ("codec", ("1",))))
    for bad in ("llm", "llm=", "=0", ","):
        with pytest.raises(ConfigError):
            parse_spec(bad)
    with pytest.raises(ConfigError):
        parse_spec("llm=0", str(f))


def test_cli_reads_placement() -> None:
    cfg = parse_args(["--gpus", "cpu:0,cpu:1", "--placement", "llm=0,codec=1"])
    assert cfg.engine.placement == PlacementSpec("explicit", (("llm", ("0",)), ("codec", ("1",))))
    assert parse_args([]).engine.placement == PlacementSpec("replicas")


def test_replicas_split_and_explicit_resolve() -> None:
    rep = resolve(parse_spec("replicas"), DEVICES, COMPONENTS, WALKS)
    assert rep.on("cuda:0") == rep.on("cuda:1") == {"llm": ("prefill", "decode"), "codec": ("window",)}
    split = resolve(parse_spec("split"), DEVICES, COMPONENTS, WALKS, split={"llm": [0], "codec": [1]})
    assert split.on("cuda:0") == {"llm": ("prefill", "decode")} and split.on("cuda:1") == {"codec": ("window",)}
    assert describe(split) == {"llm": ["cuda:0"], "codec": ["cuda:1"]}
    mixed = resolve(parse_spec("llm=0+1,codec=1"), DEVICES, COMPONENTS, WALKS)
    assert mixed.components() == {"llm": ("cuda:0", "cuda:1"), "codec": ("cuda:1",)}
    # a component the spec leaves out runs everywhere
    assert resolve(parse_spec("llm=1"), DEVICES, COMPONENTS, WALKS).components()["codec"] == DEVICES


@pytest.mark.parametrize("spec, words", [
    ("talker=0", "unknown component 'talker'"),
    ("llm.sample=0", "has no mode 'sample'"),
    ("llm=2", "index 2 is beyond --gpus"),
    ("llm=cuda:7", "'cuda:7' is not in --gpus"),
    ("llm.prefill=0,llm.decode=1", "share its KV cache"),
])
def test_bad_specs_name_the_problem(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        resolve(parse_spec(spec), DEVICES, COMPONENTS, WALKS)


def test_split_needs_two_devices_and_a_model_split() -> None:
    with pytest.raises(ConfigError, match="two devices"):
        resolve(parse_spec("split"), ("cuda:0",), COMPONENTS, WALKS, split={"llm": [0]})
    with pytest.raises(ConfigError, match="no split placement") as refused:
        resolve(parse_spec("split"), DEVICES, COMPONENTS, WALKS, split=None)
    # the example it gives names this model's components, and is a placement that resolves
    example = str(refused.value).split("--placement ")[1].split(" ")[0]
    assert example.split("=")[0] in COMPONENTS
    assert resolve(parse_spec(example), DEVICES, COMPONENTS, WALKS).components()


def test_a_partition_needs_one_device_for_all_its_steps() -> None:
    comps = {"a": Component(modes=("f",)), "b": Component(modes=("g",))}
    walks = compile_walks({"w": Walk(Step("a", "f", "x", "y"), Step("b", "g", "y", "z"), inputs=("x",))}, comps)
    with pytest.raises(ConfigError, match="one device must run all of them"):
        resolve(parse_spec("a=0,b=1"), DEVICES, comps, walks)
    fork = compile_walks({"w": Walk(Step("a", "f", "x", "y"), FanOut(((Step("b", "g", "y", "z"),),), names=("br",)),
                                    inputs=("x",))}, comps)
    with pytest.raises(ConfigError, match="forks 'br'"):
        resolve(parse_spec("a=0+1,b=1"), DEVICES, comps, fork)
    assert resolve(parse_spec("a=1,b=0+1"), DEVICES, comps, fork).route(fork["w"], {})["br"] == "cuda:1"


def test_route_keeps_a_request_together_and_balances_load() -> None:
    rep = resolve(parse_spec("replicas"), DEVICES, COMPONENTS, WALKS)
    speak = WALKS["speak"]
    assert set(rep.route(speak, {"cuda:0": 3, "cuda:1": 1}).values()) == {"cuda:1"}
    assert set(rep.route(speak, {"cuda:0": 0, "cuda:1": 1}).values()) == {"cuda:0"}
    mixed = resolve(parse_spec("llm=0+1,codec=1"), DEVICES, COMPONENTS, WALKS)
    root = speak.root
    codec = next(p for p in speak.partitions if p != root)
    placed = mixed.route(speak, {"cuda:0": 0, "cuda:1": 5})
    assert placed == {root: "cuda:0", codec: "cuda:1"}
    assert mixed.route(speak, {"cuda:0": 9, "cuda:1": 0}) == {root: "cuda:1", codec: "cuda:1"}


def test_a_root_goes_by_the_roots_each_device_runs_the_other_parts_by_all_they_run() -> None:
    three = ("cuda:0", "cuda:1", "cuda:2")
    # llm on 0 and 1, codec on 1: every request's codec is on cuda:1, which must not keep roots off it
    shared = resolve(parse_spec("llm=0+1,codec=1"), three[:2], COMPONENTS, WALKS)
    parts = {"cuda:0": 1, "cuda:1": 2}   # one request rooted on each; the cuda:0 one's codec on cuda:1 too
    assert shared.route(WALKS["speak"], parts, {"cuda:0": 1, "cuda:1": 1})["llm"] == "cuda:0"   # a tie: the first
    assert shared.route(WALKS["speak"], parts, {"cuda:0": 2, "cuda:1": 1}) == {"llm": "cuda:1", "codec": "cuda:1"}
    assert shared.route(WALKS["speak"], parts)["llm"] == "cuda:0"   # without roots' counts: every part's
    # codec on 1 or 2, llm on 0: the codec goes where the fewest parts run
    spread = resolve(parse_spec("llm=0,codec=1+2"), three, COMPONENTS, WALKS)
    route = spread.route(WALKS["speak"], {"cuda:0": 4, "cuda:1": 3, "cuda:2": 1}, {"cuda:0": 4})
    assert route == {"llm": "cuda:0", "codec": "cuda:2"}


def test_a_partitions_hosts_are_worked_out_once_per_walk_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import mstar.placement as placement

    looked: list[str] = []
    real = placement._partition_units

    def counted(walk: object, partition: str) -> list:
        looked.append(partition)
        return real(walk, partition)

    monkeypatch.setattr(placement, "_partition_units", counted)
    mixed = resolve(parse_spec("llm=0+1,codec=1"), DEVICES, COMPONENTS, WALKS)
    speak = WALKS["speak"]
    assert mixed.route(speak, {"cuda:0": 0, "cuda:1": 5}) == {"llm": "cuda:0", "codec": "cuda:1"}
    assert {"llm", "codec"} <= set(looked)
    looked.clear()
    for _ in range(3):
        assert mixed.route(speak, {"cuda:0": 0, "cuda:1": 5}) == {"llm": "cuda:0", "codec": "cuda:1"}
        assert mixed.route(speak, {"cuda:0": 9, "cuda:1": 0}) == {"llm": "cuda:1", "codec": "cuda:1"}
    assert looked == []
    # a plan of the same name compiled again (an engine that started again) is looked at afresh
    again = compile_walks({"speak": Walk(Step("codec", "window", "p", "t"), inputs=("p",))}, COMPONENTS)["speak"]
    assert mixed.hosts(again, again.root) == ("cuda:1",) and looked == [again.root]
    assert mixed.hosts(speak, again.root) == ("cuda:1",) and looked == [again.root] * 2
