"""Per-row state on a plain component (a streaming decoder's caches: no KV
pages, only a slot): a producer's items stream into a consumer that keeps a
running sum and a count per row in its slot. Each request's sums are its
own with more requests than slots (rows wait for a slot; a slot starts zeroed
whatever its last row left), on one worker and on two, and every slot is free
again after the requests end, finished or aborted. An `Items` stream's fill
sequence gives its entries in order after the stream closes, the last one
repeating."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.graph import Component, Emit, In, Items, Kind, Loop, MaxSteps, Mode, Out, Partition, Step, Stream, Walk
from mstar.models.base import Model, StateSpec
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams, StateRows
from toys.serving import drained

MOD = 1009
FILL = (500, 7)  # after the producer's items: 500 once, then 7

COMPONENTS = {
    "prod": Component(modes=(Mode("start", (In("x", Kind.TENSOR),), (Out("y", Kind.TENSOR),)),
                             Mode("bump", (In("a", Kind.TENSOR),), (Out("y", Kind.TENSOR),)))),
    "acc": Component(modes=(Mode("add", (In("item", Kind.TENSOR),), (Out("total", Kind.TENSOR),)),), state=True),
}


class Prod(nn.Module):
    def start(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def bump(self, a: torch.Tensor) -> torch.Tensor:
        return (2 * a + 1) % MOD


class Acc(nn.Module):
    def add(self, item: torch.Tensor, state: StateRows) -> dict[str, torch.Tensor]:
        """item [B, 1] -> [B, 2]: each row's running sum and count, kept in its slot."""
        sums, counts = state.tensors["sum"], state.tensors["count"]
        sums[state.slots] += item.reshape(-1)
        counts[state.slots] += 1
        return {"total": torch.stack([sums[state.slots], counts[state.slots]], dim=-1)}


def _walk(fill: tuple[int, ...] | None, steps: str | None) -> Walk:
    consumer = (Stream("h", Step("acc", "add", {"item": "h"}, {"total": "total"}), Items())
                if fill is None else
                Stream("h", chunks=Items(fill), as_="item", into=Partition(
                    "acc", Loop(Step("acc", "add", {"item": "item"}, {"total": "total"}),
                                until=MaxSteps(value=steps)))))
    return Walk(Step("prod", "start", {"x": "x"}, {"y": "h"}),
                Loop(Step("prod", "bump", {"a": "h"}, {"y": "h"}), until=MaxSteps(value="n")),
                consumer, Emit("total", modality="data"), inputs=("x", "n", "m"))


class AccModel(Model):
    components = COMPONENTS
    walks = {"sums": _walk(None, None), "filled": _walk(FILL, "m")}
    default_walk = "sums"

    def __init__(self) -> None:
        super().__init__("acc")

    @property
    def max_model_len(self) -> int:
        return 4096

    def state_spec(self, component: str) -> StateSpec:
        return StateSpec((("sum", (), torch.int64), ("count", (), torch.int64)))

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return {"prod": Prod, "acc": Acc}[component]()

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        return PreparedPiece({k: torch.tensor(int(request.inputs.get(k, 0))) for k in ("x", "n", "m")}, 1)


def reference(x: int, n: int, m: int | None = None) -> list[list[int]]:
    items = [x + 1]
    while len(items) < n:
        items.append((2 * items[-1] + 1) % MOD)
    if m is not None:
        items = (items + list(FILL) + [FILL[-1]] * m)[:m]
    return [[sum(items[:k + 1]), k + 1] for k in range(len(items))]


async def _run(eng: Engine, rid: str, walk: str = "sums", **inputs: int) -> list[list[int]]:
    out = []
    async for chunk in eng.submit(GenerateRequest(rid, "acc", inputs, SamplingParams(), walk=walk)):
        if chunk.data is not None:
            out.append(list(chunk.data))
    return out


async def _slots_free(eng: Engine, slots: int) -> None:
    for _ in range(1500):
        if all(w.scheduler.slots["acc"].num_free == slots for w in eng.workers if "acc" in w.scheduler.slots):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("state slots still held")


@pytest.mark.parametrize("devices", [("cpu",), ("cpu:0", "cpu:1")])
async def test_rows_keep_their_own_state_with_fewer_slots_than_requests(devices: tuple[str, ...]) -> None:
    eng = Engine(EngineConfig(model="acc", devices=devices, scheduler=SchedulerConfig(state_slots=2)),
                 model=AccModel())
    await eng.start()
    try:
        jobs = [(3 * i + 1, 4 + i % 5) for i in range(7)]
        got = await asyncio.gather(*(_run(eng, f"r{i}", x=x, n=n) for i, (x, n) in enumerate(jobs)))
        assert got == [reference(x, n) for x, n in jobs]
        # slots were reused: a second round on the same slots starts from zero again
        again = await asyncio.gather(*(_run(eng, f"s{i}", x=x, n=n) for i, (x, n) in enumerate(jobs)))
        assert again == got
        await _slots_free(eng, 2)
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_an_aborted_request_gives_its_slot_back() -> None:
    eng = Engine(EngineConfig(model="acc", devices=("cpu",), scheduler=SchedulerConfig(state_slots=1)),
                 model=AccModel())
    await eng.start()
    try:
        stream = eng.submit(GenerateRequest("long", "acc", {"x": 1, "n": 100000}, SamplingParams()))
        async for chunk in stream:
            if chunk.data is not None and list(chunk.data)[1] == 3:
                eng.abort("long")
            if chunk.finished:
                assert chunk.finish_reason == "abort"
        await _slots_free(eng, 1)
        assert await _run(eng, "next", x=5, n=6) == reference(5, 6)
    finally:
        await eng.shutdown()


async def test_an_items_fill_sequence_is_read_in_order_then_repeats_its_last() -> None:
    eng = Engine(EngineConfig(model="acc", devices=("cpu",)), model=AccModel())
    await eng.start()
    try:
        assert await _run(eng, "f", walk="filled", x=2, n=3, m=8) == reference(2, 3, 8)
        await drained(eng)
    finally:
        await eng.shutdown()


def test_a_turn_that_fed_a_restarting_stream_nothing_leaves_no_turn_mark() -> None:
    """A producer's turn without items (a thinker whose answer was all special
    tokens) started no pass of a consumer that restarts each turn: the next
    turn's pass must read that turn's items, not end at a stale mark."""
    from mstar.engine.worker.streaming.buffer import TURN_OVER, StreamBuffer
    from mstar.graph.compile import StreamPlan

    buf = StreamBuffer(StreamPlan("h", "prod", "acc", Items(fill=FILL), on_turn="restart"))
    buf.take(1)
    buf.segment()  # a turn with an item: its end is marked
    assert buf.pending[-1] == TURN_OVER
    marks = len(buf.pending)
    buf.segment()  # a turn with none
    assert len(buf.pending) == marks
    buf.take(2)
    assert buf.pending[-1] != TURN_OVER
