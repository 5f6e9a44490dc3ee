"""Loop bodies of several steps and nested loops, run by the engine: a fake
component's arithmetic over an outer loop (capped by a walk value) holding
an inner loop that reads its iteration (`@i`) and collects its writes into a
frame, served concurrently on one and two CPU workers and compared with the
same arithmetic in plain Python loops. Also: a loop that no step enters, a
body cut short by its stop rule, aborts that leave nothing held, the
programs the graph lays out, and the walks it refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import WalkError
from mstar.graph import (Back, Collect, Component, Emit, Enter, EosToken, FanOut, HostStop, In, Kind, Loop, MaxSteps,
                         Mode, Out, Run, Step, Walk, compile_walk)
from mstar.models.base import Model
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams
from toys.serving import drained

MOD = 10_007
INNER = 3  # writes of the inner loop's value per frame: the seed's and two more


def _mode(name: str, *inputs: In) -> Mode:
    return Mode(name, inputs, (Out("y", Kind.TENSOR),))


A, I = In("a", Kind.TENSOR), In("i", Kind.INDEX)
MIX = Component(modes=(_mode("start", In("x", Kind.TENSOR)), _mode("seed", A, I), _mode("next", A, I),
                       _mode("fold", In("f", Kind.TENSOR), A), _mode("bump", A), _mode("side", A),
                       _mode("total", In("f", Kind.TENSOR))))
BAD = 13  # `bump` refuses this value: the step fails for its row


class Mix(nn.Module):
    """Integer arithmetic whose result depends on every step's order and index."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}  # rows run, by mode

    def _count(self, name: str, rows: torch.Tensor) -> None:
        self.calls[name] = self.calls.get(name, 0) + rows.shape[0]

    def start(self, x: torch.Tensor) -> torch.Tensor:
        self._count("start", x)
        return x + 1

    def seed(self, a: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        self._count("seed", a)
        return (2 * a + i) % MOD

    def next(self, a: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        self._count("next", a)
        return (3 * a + i + 1) % MOD

    def fold(self, f: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        self._count("fold", f)
        return (a + 7 * f[:, 1:].sum(-1) + f[:, 0]) % MOD

    def bump(self, a: torch.Tensor) -> torch.Tensor:
        self._count("bump", a)
        if bool((a == BAD).any()):
            raise ValueError("a value bump refuses")
        return a * 2 + 1

    def total(self, f: torch.Tensor) -> torch.Tensor:
        return f.reshape(f.shape[0], -1).sum(-1) + 1

    def side(self, a: torch.Tensor) -> torch.Tensor:
        self._count("side", a)
        return a * 100


class ProgramModel(Model):
    components = {"mix": MIX}
    walks = {
        "nested": Walk(
            Step("mix", "start", {"x": "x"}, {"y": "acc"}),
            Loop((Step("mix", "seed", {"a": "acc", "i": "@i"}, {"y": "code"}),
                  Loop(Step("mix", "next", {"a": "code", "i": "@i"}, {"y": "code"}), until=MaxSteps(INNER),
                       collect=Collect("frame", each="code", first=("acc",))),
                  Step("mix", "fold", {"f": "frame", "a": "acc"}, {"y": "acc"})),
                 until=MaxSteps(value="n"), value="acc"),
            Emit("acc", modality="data"),
            inputs=("x", "n")),
        # no step enters this loop (its value is an input); a round that stops skips the rest of its body
        "early": Walk(
            Loop((Step("mix", "bump", {"a": "x"}, {"y": "x"}), Step("mix", "side", {"a": "x"}, {"y": "w"})),
                 until=MaxSteps(value="n")),
            Emit("x", modality="data"), Emit("w", modality="data"),
            inputs=("x", "n")),
        # a round cut short before `w` is written: with n=1 the loop collects nothing
        "collect": Walk(
            Loop((Step("mix", "bump", {"a": "x"}, {"y": "x"}), Step("mix", "side", {"a": "x"}, {"y": "w"})),
                 until=MaxSteps(value="n"), collect=Collect("ws", each="w")),
            Step("mix", "total", {"f": "ws"}, {"y": "s"}),
            Emit("s", modality="data"),
            inputs=("x", "n")),
        # two branches of one request step `bump` in one batch, binding other values
        "branches": Walk(
            Step("mix", "start", {"x": "x"}, {"y": "acc"}),
            FanOut(((Loop(Step("mix", "bump", {"a": "acc"}, {"y": "acc"}), until=MaxSteps(3)),),
                    (Loop(Step("mix", "bump", {"a": "n"}, {"y": "n"}), until=MaxSteps(3)),)), names=("a", "b")),
            Emit("acc", modality="data"), Emit("n", modality="data"),
            inputs=("x", "n")),
    }
    default_walk = "nested"

    def __init__(self) -> None:
        super().__init__("programs")
        self.mix = Mix()

    @property
    def max_model_len(self) -> int:
        return 4096

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return self.mix

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        return PreparedPiece({k: torch.tensor(int(request.inputs[k])) for k in ("x", "n")}, 1)


def nested_reference(x: int, n: int) -> list[int]:
    """The "nested" walk as plain loops: the accs it emits."""
    accs = [x + 1]
    acc, writes, outer = x + 1, 1, 0
    while writes < n:  # a rule is checked at every write of its value, the write entering the loop included
        code = (2 * acc + outer) % MOD
        frame, count, inner = [acc, code], 1, 0
        while count < INNER:
            code = (3 * code + inner + 1) % MOD
            frame.append(code)
            count, inner = count + 1, inner + 1
        acc = (acc + 7 * sum(frame[1:]) + frame[0]) % MOD
        accs.append(acc)
        writes, outer = writes + 1, outer + 1
    return accs


def early_reference(x: int, n: int) -> tuple[list[int], list[int]]:
    xs, ws = [], []
    for k in range(n):
        x = x * 2 + 1
        xs.append(x)
        if k + 1 < n:
            ws.append(x * 100)
    return xs, ws


async def _run(eng: Engine, rid: str, walk: str, x: int, n: int) -> tuple[list[int], str | None]:
    values, reason = [], None
    async for chunk in eng.submit(GenerateRequest(rid, "programs", {"x": x, "n": n}, SamplingParams(), walk=walk)):
        if chunk.data is not None:
            values.append(int(chunk.data))
        if chunk.finished:
            reason = chunk.finish_reason
    return values, reason


@pytest.mark.parametrize("devices", [("cpu",), ("cpu:0", "cpu:1")])
async def test_nested_loops_match_plain_python_loops_served_concurrently(devices: tuple[str, ...]) -> None:
    model = ProgramModel()
    eng = Engine(EngineConfig(model="programs", devices=devices), model=model)
    await eng.start()
    try:
        cases = [(x, n) for x, n in zip((0, 5, 11, 3, 40, 8), (1, 2, 5, 3, 7, 4))]
        results = await asyncio.gather(*(_run(eng, f"r{k}", "nested", x, n) for k, (x, n) in enumerate(cases)))
        for (x, n), (accs, reason) in zip(cases, results):
            assert accs == nested_reference(x, n), (x, n)  # each acc folds the frame the inner loop collected
            assert reason == "length"
        rounds = sum(n - 1 for _, n in cases)
        assert model.mix.calls["seed"] == rounds and model.mix.calls["next"] == rounds * (INNER - 1)
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_a_loop_no_step_enters_and_a_round_cut_short() -> None:
    model = ProgramModel()
    eng = Engine(EngineConfig(model="programs", devices=("cpu",)), model=model)
    await eng.start()
    try:
        for x, n in ((1, 1), (2, 3), (0, 5)):
            chunks = [c async for c in eng.submit(
                GenerateRequest(f"e{x}", "programs", {"x": x, "n": n}, SamplingParams(), walk="early"))]
            got = [int(c.data) for c in chunks if c.data is not None]  # both values, in the order written
            want_xs, want_ws = early_reference(x, n)
            assert sorted(got) == sorted(want_xs + want_ws), (x, n)
        assert model.mix.calls["bump"] == 1 + 3 + 5 and model.mix.calls["side"] == 0 + 2 + 4
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_an_abort_inside_a_nested_loop_leaves_nothing_held() -> None:
    eng = Engine(EngineConfig(model="programs", devices=("cpu",)), model=ProgramModel())
    await eng.start()
    try:
        seen = 0
        async for chunk in eng.submit(GenerateRequest("long", "programs", {"x": 1, "n": 10**6}, SamplingParams())):
            seen += 1
            if seen == 5:  # mid-loop: a frame's collection holds references
                eng.abort("long")
            if chunk.finished:
                assert chunk.finish_reason == "abort"
        await drained(eng)
    finally:
        await eng.shutdown()


def test_the_program_of_nested_loops() -> None:
    plan = compile_walk("nested", ProgramModel.walks["nested"], {"mix": MIX}).partitions["mix"]
    assert [type(i).__name__ for i in plan.program] == ["Run", "Run", "Run", "Back", "Run", "Back"]
    start, seed, nxt, inner_back, fold, outer_back = plan.program
    assert start == Run(start.step, checks=0, enters=True, depth=0)  # its write enters the outer loop
    assert seed == Run(seed.step, checks=1, enters=True, depth=1) and nxt.checks == 1 and nxt.depth == 2
    assert fold.checks == 0 and fold.depth == 1
    assert inner_back == Back(1) and outer_back == Back(0)
    assert (plan.loops[0].body, plan.loops[0].exit, plan.loops[1].body, plan.loops[1].exit) == (1, 6, 2, 4)
    early = compile_walk("early", ProgramModel.walks["early"], {"mix": MIX}).partitions["mix"]
    assert early.program[0] == Enter(0) and early.program[-1] == Back(0) and early.loops[0].exit == 4


def _refused(*nodes, inputs=("x", "n")) -> WalkError:
    with pytest.raises(WalkError) as caught:
        compile_walk("w", Walk(*nodes, inputs=inputs), {"mix": MIX})
    return caught.value


SEED = Step("mix", "seed", {"a": "x", "i": "@i"}, {"y": "c"})


@pytest.mark.parametrize("nodes, where, says", [
    ((Loop((SEED, Loop(Step("mix", "next", {"a": "c", "i": "@i"}, {"y": "c"}), until=HostStop())),
           until=MaxSteps(3), value="c"),), "loop mix.seed/loop mix.next", "nested loop cannot"),
    ((Loop((SEED, Step("mix", "bump", {"a": "c"}, {"y": "d"})), until=MaxSteps(2), value="e"),), "loop mix.seed",
     "'e' is not written by a step of its body"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=MaxSteps(value="steps")),), "loop mix.bump",
     "'steps', which nothing writes"),
    ((Loop((Step("mix", "bump", {"a": "x"}, {"y": "x"}),
            Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=MaxSteps(2))), until=MaxSteps(3)),),
     "loop mix.bump/loop mix.bump", "writes the values of two loops"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=MaxSteps(2), collect=Collect("f", each="z")),),
     "loop mix.bump", "collects 'z', which nothing in the loop writes"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=MaxSteps(2), collect=Collect("f", "x", ("q",))),),
     "loop mix.bump", "collects 'q' first"),
    ((Loop((Step("mix", "side", {"a": "w"}, {"y": "v"}), Step("mix", "bump", {"a": "x"}, {"y": "w"})),
           until=MaxSteps(2)),), "loop mix.side/mix.side", "reads 'w', which nothing writes before it"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=None),), "loop mix.bump", "no stop rule"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=MaxSteps(2), collect=Collect("f", "x")), Emit("f")),
     "emit f", "which a loop collects"),
    ((Loop(Step("mix", "bump", {"a": "x"}, {"y": "x"}), until=EosToken()), Step("mix", "seed", {"a": "x", "i": "@i"},
                                                                              {"y": "y"})),
     "mix.seed", "outside a loop"),
])
def test_malformed_loops_are_refused_naming_walk_and_node(nodes, where: str, says: str) -> None:
    error = _refused(*nodes)
    assert error.walk == "w" and error.step == where, str(error)
    assert says in str(error)


async def test_a_loop_that_collects_nothing_and_a_loop_of_no_rounds() -> None:
    """A round cut short before the collected value is written (n=1) writes
    an empty collection; a cap of 0 runs no round at all."""
    eng = Engine(EngineConfig(model="programs", devices=("cpu",)), model=ProgramModel())
    await eng.start()
    try:
        assert await _run(eng, "c3", "collect", 1, 3) == ([(3 * 100 + 7 * 100) + 1], "length")
        assert await _run(eng, "c1", "collect", 1, 1) == ([1], "length")  # the total of nothing, plus one
        assert await _run(eng, "e0", "early", 5, 0) == ([], "stop")
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_a_row_failing_alone_leaves_its_requests_other_rows_and_the_worker_alone() -> None:
    """A step whose rows bind other values runs them one by one; when one
    fails, its request ends with an error, its other rows in the same step are
    dropped, and the worker serves the next request."""
    eng = Engine(EngineConfig(model="programs", devices=("cpu",)), model=ProgramModel())
    await eng.start()
    try:
        _, reason = await _run(eng, "bad", "branches", BAD - 1, 100)  # start makes acc = BAD: branch "a" fails
        assert reason == "error"
        assert eng.workers[0].alive
        values, reason = await _run(eng, "good", "branches", 1, 2)
        assert reason == "stop" and sorted(values) == sorted([2, 5, 11, 23, 5, 11, 23])  # acc's first write too
        await drained(eng)
    finally:
        await eng.shutdown()
