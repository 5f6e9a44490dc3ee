"""Streams into whole partitions: a producer loop's writes flow item by item
(`Items`) into a consumer partition with a step of its own, a loop that
ends with its stream (`StreamDone`) and a stream on into a codec-like step
fed with left context (`LeftContext`, `@chunk`). The consumer starts at the
first item with the producer's value it reads. Served concurrently on one
CPU worker and split over two, and compared with the same arithmetic in
plain Python; an `Items` fill after the stream closed; aborts that leave
nothing held; the walks the graph refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import WalkError
from mstar.graph import (Component, Emit, FixedChunks, In, Items, Kind, Last, LeftContext, Loop, MaxSteps, Mode, Out,
                         Partition, Step, Stream, StreamDone, Walk, compile_walk)
from mstar.models.base import Model
from mstar.models.prepared import PreparedPiece
from mstar.placement import parse_spec
from mstar.types import GenerateRequest, SamplingParams
from toys.serving import drained

MOD = 10_007
CHUNK, LEFT = 2, 1


def _mode(name: str, *inputs: In) -> Mode:
    return Mode(name, inputs, (Out("y", Kind.TENSOR),))


T = Kind.TENSOR
COMPONENTS = {
    "prod": Component(modes=(_mode("start", In("x", T)), _mode("bump", In("a", T)))),
    "talk": Component(modes=(_mode("first", In("a", T), In("k", T)), _mode("mix", In("c", T), In("a", T), In("k", T)))),
    "codec": Component(modes=(_mode("window", In("c", T), In("i", Kind.INDEX)),)),
}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)[:, 0]  # one value per row: a one-item chunk, or a scalar


class Prod(nn.Module):
    def start(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def bump(self, a: torch.Tensor) -> torch.Tensor:
        return (2 * a + 1) % MOD


class Talk(nn.Module):
    def first(self, a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (_flat(a) * 100 + k) % MOD

    def mix(self, c: torch.Tensor, a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (3 * c + _flat(a) + k) % MOD


class Codec(nn.Module):
    def window(self, c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.stack([c.sum(-1), torch.full_like(c[:, 0], c.shape[-1]), i], dim=-1)


def _talker(loop_until, fill: int | None = None) -> Stream:
    return Stream("h", chunks=Items(fill), as_="item", into=Partition(
        "talk",
        Step("talk", "first", {"a": "item", "k": "x"}, {"y": "c"}),
        Loop(Step("talk", "mix", {"c": "c", "a": "item", "k": "x"}, {"y": "c"}), until=loop_until),
        Stream("c", Step("codec", "window", {"c": "c", "i": "@chunk"}, {"y": "s"}), LeftContext(CHUNK, LEFT)),
        Emit("c", modality="data")))


def _producer(*rest, inputs=("x", "n", "m")) -> Walk:
    return Walk(Step("prod", "start", {"x": "x"}, {"y": "h"}),
                Loop(Step("prod", "bump", {"a": "h"}, {"y": "h"}), until=MaxSteps(value="n")),
                *rest, Emit("s", modality="data"), inputs=inputs)


class ChainModel(Model):
    components = COMPONENTS
    walks = {"chain": _producer(_talker(StreamDone())),
             # the talker steps m times; past the producer's n items it reads the fill
             "filled": _producer(_talker(MaxSteps(value="m"), fill=-1))}
    default_walk = "chain"

    def __init__(self) -> None:
        super().__init__("chain")

    @property
    def max_model_len(self) -> int:
        return 4096

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return {"prod": Prod, "talk": Talk, "codec": Codec}[component]()

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        return PreparedPiece({k: torch.tensor(int(request.inputs.get(k, 0))) for k in ("x", "n", "m")}, 1)


def reference(x: int, n: int, m: int | None = None) -> tuple[list[int], list[list[int]]]:
    """What "chain" (m None) or "filled" emits: the talker's c, the codec's s."""
    h = [x + 1]
    while len(h) < n:
        h.append((2 * h[-1] + 1) % MOD)
    items = h if m is None else (h + [-1] * m)[:m]
    c = [(items[0] * 100 + x) % MOD]
    for item in items[1:]:
        c.append((3 * c[-1] + item + x) % MOD)
    chunks = []
    for i in range((len(c) + CHUNK - 1) // CHUNK):
        span = c[max(0, i * CHUNK - LEFT):(i + 1) * CHUNK]
        chunks.append([sum(span), len(span), i])
    return c, chunks


async def _run(eng: Engine, rid: str, walk: str, **inputs: int) -> tuple[list[int], list[list[int]], str | None]:
    cs, ss, reason = [], [], None
    async for chunk in eng.submit(GenerateRequest(rid, "chain", inputs, SamplingParams(), walk=walk)):
        if chunk.data is not None:
            data = chunk.data.tolist() if hasattr(chunk.data, "tolist") else chunk.data
            (ss if isinstance(data, list) else cs).append(data)
        if chunk.finished:
            reason = chunk.finish_reason
    return cs, ss, reason


SETUPS = [(("cpu",), "replicas"), (("cpu:0", "cpu:1"), "prod=0,talk=1,codec=0")]


async def _engine(devices: tuple[str, ...], placement: str) -> Engine:
    eng = Engine(EngineConfig(model="chain", devices=devices, placement=parse_spec(placement)), model=ChainModel())
    await eng.start()
    return eng


@pytest.mark.parametrize("devices, placement", SETUPS)
async def test_a_consumer_partition_matches_plain_python(devices: tuple[str, ...], placement: str) -> None:
    eng = await _engine(devices, placement)
    try:
        cases = [(0, 1), (5, 2), (11, 7), (3, 4), (40, 9), (8, 5)]
        results = await asyncio.gather(*(_run(eng, f"r{k}", "chain", x=x, n=n) for k, (x, n) in enumerate(cases)))
        for (x, n), (cs, ss, reason) in zip(cases, results):
            want_c, want_s = reference(x, n)
            assert cs == want_c, (x, n)
            assert ss == want_s, (x, n)
            assert reason == "length"
        await drained(eng)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("devices, placement", SETUPS)
async def test_items_give_their_fill_once_the_stream_is_over(devices: tuple[str, ...], placement: str) -> None:
    eng = await _engine(devices, placement)
    try:
        cases = [(2, 3, 6), (7, 5, 5), (1, 1, 4)]
        results = await asyncio.gather(*(_run(eng, f"f{k}", "filled", x=x, n=n, m=m)
                                         for k, (x, n, m) in enumerate(cases)))
        for (x, n, m), (cs, ss, _) in zip(cases, results):
            assert (cs, ss) == reference(x, n, m), (x, n, m)
        await drained(eng)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("devices, placement", SETUPS)
async def test_aborts_mid_stream_leave_nothing_held(devices: tuple[str, ...], placement: str) -> None:
    eng = await _engine(devices, placement)
    try:
        async def one(rid: str) -> str | None:
            seen, reason = 0, None
            async for chunk in eng.submit(GenerateRequest(rid, "chain", {"x": 1, "n": 10**6}, SamplingParams())):
                seen += 1
                if seen == 6:
                    eng.abort(rid)
                if chunk.finished:
                    reason = chunk.finish_reason
            return reason

        assert await asyncio.gather(*(one(f"a{i}") for i in range(3))) == ["abort"] * 3
        await drained(eng)
    finally:
        await eng.shutdown()


def test_the_consumer_carries_what_it_reads_of_its_producer() -> None:
    plan = compile_walk("chain", ChainModel.walks["chain"], COMPONENTS)
    (talk,) = plan.streams["h"]
    assert (talk.producer, talk.consumer, talk.as_, talk.carries) == ("prod", "talk", "item", ("x",))
    (codec,) = plan.streams["c"]
    assert (codec.producer, codec.consumer, codec.as_, codec.carries) == ("talk", "codec", "c", ())
    assert plan.partitions["talk"].stream is talk and plan.partitions["codec"].stream is codec


def _refused(*nodes) -> WalkError:
    with pytest.raises(WalkError) as caught:
        compile_walk("w", Walk(*nodes, inputs=("x", "n")), COMPONENTS)
    return caught.value


START = Step("prod", "start", {"x": "x"}, {"y": "h"})


@pytest.mark.parametrize("nodes, where, says", [
    # the consumer never reads the stream: a stream into a missing input
    ((START, Stream("h", chunks=Items(), as_="item", into=Partition(
        "talk", Step("talk", "first", {"a": "h", "k": "x"}, {"y": "c"})))), "stream h", "none of its steps reads"),
    ((Loop(Step("prod", "bump", {"a": "x"}, {"y": "x"}), until=StreamDone()),), "loop prod.bump",
     "reads no stream"),
    ((START, Stream("h", chunks=FixedChunks(2), into=Partition(
        "prod", Loop(Step("prod", "bump", {"a": "h"}, {"y": "g"}), until=StreamDone())))), "stream h",
     "declared twice"),
    ((START, Stream("h", chunks=Items(), into=Partition(
        "talk", Step("talk", "first", {"a": "h", "k": "n2"}, {"y": "c"})))), "talk.first", "nothing writes"),
])
def test_malformed_streams_are_refused_naming_walk_and_node(nodes, where: str, says: str) -> None:
    error = _refused(*nodes)
    assert error.walk == "w" and error.step == where, str(error)
    assert says in str(error)


def test_chunk_policies_cut_what_they_say() -> None:
    items, left, last = Items(), LeftContext(4, 2), Last()
    assert items.ready(3, 1) == [(1, 2), (2, 3)] and items.flush(3, 3) == [] and items.keep_from(3, 2) == 2
    assert left.ready(9, 0) == [(0, 4), (2, 8)] and left.flush(9, 2) == [(6, 9)] and left.keep_from(9, 2) == 6
    assert last.ready(5, 0) == [] and last.flush(5, 0) == [(4, 5)] and last.flush(0, 0) == []
    assert last.keep_from(5, 0) == 4  # only the newest item is held while the stream runs
