"""The talker's `speak` loop as a decode group (`GroupShape`: its last hidden
state carried from step to step, the thinker's text fed one token a step,
the code predictor's draws counted per row): the text and audio item-by-item
steps give, sampled, for a row that waits for its text in between, and for
rows preempted for lack of pages."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np
import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.group_steps import GroupSteps
from mstar.engine.worker import walker as walker_module
from mstar.engine.worker.groups import joining as joining_module
from mstar.engine.worker.executor import Executor
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.rows import Frame, PartitionRun, RequestRun
from mstar.engine.worker.streaming.edges import Streams
from mstar.graph import Partition, Step, Walk, compile_walk
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams
from toys.serving import DEVICES

MODEL = "qwen3-omni-tiny"
FRAMES = 14


def _sampled(i: int) -> GenerateRequest:
    return GenerateRequest(
        f"r{i}", MODEL, {"messages": [{"role": "user", "content": f"Tell me story {i}."}]},
        SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True, seed=100 + i), walk="speak",
        sampling_by={"talker": {"max_tokens": FRAMES, "temperature": 0.9, "top_p": 0.9, "repetition_penalty": 1.1,
                                "ignore_eos": True, "stop_token_ids": []},
                     "cp": {"temperature": 0.9, "top_k": 20}})


async def _speak(requests: list[GenerateRequest], max_model_len: int = 256, device: str = "cpu",
                 **scheduler) -> tuple[list[tuple[list[int], bytes]], Engine]:
    """Each request's (text ids, PCM bytes), and the stopped engine. On CUDA
    the talker's frames replay its captured graphs, item step or group step."""
    if device.startswith("cuda"):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    eng = Engine(EngineConfig(model=MODEL, devices=(device,), dtype="float32", max_model_len=max_model_len,
                              scheduler=SchedulerConfig(**scheduler)))
    await eng.start()

    async def one(req: GenerateRequest) -> tuple[list[int], bytes]:
        ids, audio = [], b""
        async for c in eng.submit(req):
            assert not c.error, c.error
            ids += c.token_ids
            audio += c.audio or b""
        return ids, audio

    try:
        out = list(await asyncio.gather(*(one(r) for r in requests)))
        assert len(eng.store) == 0 and all(n == 0 for n in eng.workers[0].pages_in_use().values())
        return out, eng
    finally:
        await eng.shutdown()


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Talker steps by how they ran: group steps and item steps."""
    seen: collections.Counter = collections.Counter()
    group_step, item_step = GroupSteps._mode_step, Executor._run

    def grouped(self, group, sl, fed):
        seen["group", group.mode] += 1
        return group_step(self, group, sl, fed)

    def item(self, batch, runner, t0):
        seen["item", batch.mode] += 1
        return item_step(self, batch, runner, t0)
    monkeypatch.setattr(GroupSteps, "_mode_step", grouped)
    monkeypatch.setattr(Executor, "_run", item)
    return seen


@pytest.fixture
def item_by_item(monkeypatch: pytest.MonkeyPatch):
    """Turns the talker's group off: its loop runs item by item, as before groups took it."""
    shape = joining_module.group_shape

    def off() -> None:
        monkeypatch.setattr(joining_module, "group_shape",
                            lambda spec, step, value, stream=None:
                            None if step.component == "talker" else shape(spec, step, value, stream))
    return off


def _close(a: bytes, b: bytes) -> bool:
    x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
    return x.size > 0 and x.size == y.size and int(np.abs(x - y).max()) <= 1


@pytest.mark.parametrize("device", DEVICES)
async def test_a_sampled_speak_loop_in_a_group_draws_what_item_steps_draw(counts, item_by_item, device) -> None:
    grouped, _ = await _speak([_sampled(0)], device=device)
    assert counts["group", "speak"] >= FRAMES - 2 and counts["item", "speak"] == 0
    counts.clear()
    item_by_item()
    stepped, _ = await _speak([_sampled(0)], device=device)
    assert counts["item", "speak"] >= FRAMES - 1 and counts["group", "speak"] == 0
    # one row each way: the same batches, so the same floats: every code and every sample equal
    assert grouped == stepped


async def test_rows_of_one_group_step_together(counts, item_by_item) -> None:
    requests = [_sampled(i) for i in range(3)]
    grouped, _ = await _speak(requests)
    assert counts["group", "speak"] and counts["item", "speak"] == 0
    item_by_item()
    stepped, _ = await _speak(requests)
    for (text, pcm), (again_text, again_pcm) in zip(grouped, stepped):
        assert text == again_text and _close(pcm, again_pcm)  # batched GEMMs may round differently


@pytest.mark.parametrize("device", DEVICES)
async def test_a_row_whose_text_is_late_leaves_its_group_and_comes_back(counts, monkeypatch, device) -> None:
    """Its stream says "nothing yet" for a few reads: the row leaves the group
    with its state exact (after the launched steps are read), takes a step
    item by item when the item is there, and joins again; what it says and
    plays is what it would have."""
    want, _ = await _speak([_sampled(0)], device=device)
    ready, evict = Streams.ready, LoopGroup.evict
    asked = collections.Counter()

    def late(self, cons) -> bool:
        asked[cons.request_id] += 1
        return False if 6 <= asked[cons.request_id] < 9 else ready(self, cons)

    def evicted(self, i, reason="preempt"):
        counts["evict", reason] += 1
        return evict(self, i, reason)
    monkeypatch.setattr(Streams, "ready", late)
    monkeypatch.setattr(LoopGroup, "evict", evicted)
    got, _ = await _speak([_sampled(0)], device=device)
    assert counts["evict", "await"] == 1 and counts["item", "speak"] >= 1 and counts["group", "speak"]
    assert got == want


async def test_preempted_talker_rows_speak_the_same(counts) -> None:
    greedy = [GenerateRequest(f"g{i}", MODEL, {"messages": [{"role": "user", "content": f"Say {i}."}]},
                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), walk="speak",
                              sampling_by={"talker": {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                                                      "stop_token_ids": []}, "cp": {"temperature": 0.0}})
              for i in range(4)]
    reserved, _ = await _speak(greedy, 128, page_size=4, num_pages=512)
    # 40 pages of 4 tokens: four talker rows of about 60 tokens each must take turns
    lazy, eng = await _speak(greedy, 128, page_size=4, num_pages=40, kv_reservation="lazy")
    assert eng.workers[0].preemption.preempted_by["talker"] > 0
    assert counts["group", "speak"]
    for (text, pcm), (again_text, again_pcm) in zip(reserved, lazy):
        assert text == again_text and _close(pcm, again_pcm)


async def test_a_waiting_row_swapped_out_comes_back_with_its_kv(counts, monkeypatch) -> None:
    """A row waiting for its text outside the group still holds its pages;
    when the pool runs dry it may be swapped out like any idle row
    (`Preemption.unstick`). Its text then comes: it takes an item step that
    swaps its KV back in before it joins again, and says what it would have."""
    want, _ = await _speak([_sampled(0)], kv_reservation="lazy")
    ready, awaits, start = Streams.ready, walker_module.Walker.awaits_stream, Engine.start
    asked, engines, swapped = collections.Counter(), [], []

    def late(self, cons) -> bool:
        asked[cons.request_id] += 1
        return False if not swapped and 6 <= asked[cons.request_id] < 9 else ready(self, cons)

    def swapped_while_waiting(self, leave) -> None:
        worker = engines[-1].workers[0]
        row = leave.part.row("talker")
        worker.preemption._swap_waiting(worker.scheduler, "talker", row, None)  # as `unstick` does
        swapped.append(row)
        awaits(self, leave)

    async def started(self):
        engines.append(self)
        return await start(self)
    monkeypatch.setattr(Engine, "start", started)
    monkeypatch.setattr(Streams, "ready", late)
    monkeypatch.setattr(walker_module.Walker, "awaits_stream", swapped_while_waiting)
    got, eng = await _speak([_sampled(0)], kv_reservation="lazy")
    assert swapped and swapped[0].swapped is None and counts["item", "speak"] >= 1
    assert eng.workers[0].scheduler.running["talker"] == 0
    assert got == want


def test_a_group_takes_its_stream_only_when_no_later_step_reads_it() -> None:
    """A group's step past a row's stop takes a stream item; a step after the
    loop that reads the same stream would miss it, so such a loop runs item
    by item."""
    model = load_model(MODEL, load_format="dummy")
    talker = model.walks["speak"].nodes[-1]  # the thinker's text stream: its consumer, the talker's partition
    plans = {"speak": model.walks["speak"]}
    again = Step("talker", "speak", {"ids": "code0", "last": "last", "text": "next_text"},
                 {"code": "code0", "last": "last", "frame": "frame"}, draws="cp")
    reading = dataclasses.replace(talker, into=Partition(talker.into.name, *talker.into.nodes[:2], again,
                                                         *talker.into.nodes[2:]))
    plans["reading"] = Walk(*model.walks["speak"].nodes[:-1], reading, inputs=model.walks["speak"].inputs)
    later = {}
    for name, walk in plans.items():
        plan = compile_walk(name, walk, model.components)
        part = PartitionRun(RequestRun("r", plan, {}, {}), plan.partitions["talker"], pc=1, loops=[Frame(0, 10)])
        later[name] = joining_module._reads_stream_later(part, part.instr())
    assert later == {"speak": False, "reading": True}
