"""`mstar_generation_tokens_total` counts tokens as they are drawn (as
vLLM's generation_tokens_total does): text tokens as the event loop takes
them in, a speech walk's audio codes (which a codec takes on the worker) as
the worker reports drawing them. A scrape during a long answer sees it grow,
and once every request has ended the counter holds what each one's usage
says it cost: answers that ran to their end, stopped early, were aborted,
or were preempted on the way."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.eventloop.metrics import EngineMetrics
from mstar.engine.eventloop.requests import RequestStream
from mstar.placement import parse_spec
from mstar.types import GenerateRequest, OutputChunk, SamplingParams

LONG = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
# the first audio of a speech walk comes with a full window of codes: 4 frames of 7
FIRST_WINDOW = 28


def generation_tokens(eng: Engine) -> int:
    m = re.search(r"^mstar_generation_tokens_total (\S+)$", eng.metrics_text(), re.M)
    assert m is not None
    return int(float(m.group(1)))


@asynccontextmanager
async def engine(cfg: EngineConfig) -> AsyncIterator[tuple[Engine, list[tuple[str, int, int]]]]:
    """A started engine, and each request's end as its metrics saw it:
    (id, output tokens, of which counted as they came), checked never to
    have counted more than the end says."""
    eng = Engine(cfg)
    await eng.start()
    ends: list[tuple[str, int, int]] = []
    finished = eng._metrics.finished

    def watch(request_id: str, status: str, prompt_tokens: int = 0, output_tokens: int = 0, counted: int = 0) -> None:
        ends.append((request_id, output_tokens, counted))
        finished(request_id, status, prompt_tokens, output_tokens, counted)

    eng._metrics.finished = watch  # type: ignore[method-assign]
    try:
        yield eng, ends
    finally:
        await eng.shutdown()
    assert all(counted <= out for _, out, counted in ends), ends


def counted_whole(ends: list[tuple[str, int, int]], *aborted: str) -> bool:
    """Every request but the `aborted` was counted whole as it came: its end
    had nothing left to add (an aborted one's end adds the tokens of the
    steps it had in flight)."""
    return all(counted == out for rid, out, counted in ends if rid not in aborted)


async def read_until(stream: RequestStream, enough: Callable[[list[OutputChunk]], bool]) -> list[OutputChunk]:
    """The stream's chunks up to the first after which `enough` holds."""
    chunks: list[OutputChunk] = []
    it = aiter(stream)
    while not chunks or not enough(chunks):
        chunks.append(await anext(it))
        assert not chunks[-1].finished, chunks[-1]
    return chunks


async def run(stream: RequestStream) -> int:
    """Read the stream to its end: the completion tokens of its usage."""
    last = None
    async for chunk in stream:
        last = chunk
    assert last is not None and last.finished and last.error is None, last
    return last.num_output_tokens


async def aborted(eng: Engine, stream: RequestStream) -> int:
    """Abort a running request: what it cost, once its worker let it go
    (the usage of an answer cut short)."""
    eng.abort(stream.request_id)
    async for _ in stream:
        pass
    n = await stream.settled(30)
    assert n is not None
    return n


def audio_chunks(chunks: list[OutputChunk]) -> int:
    return sum(c.audio is not None for c in chunks)


async def test_text_tokens_count_as_they_come_and_add_up_to_usage() -> None:
    async with engine(EngineConfig(model="tiny-llama")) as (eng, ends):
        long = eng.submit(GenerateRequest("long", "tiny-llama", {"prompt_ids": [1, 2, 3]}, LONG))
        got = await read_until(long, lambda cs: sum(len(c.token_ids) for c in cs) >= 40)
        # mid-answer: the client has read 40 tokens, and the counter holds them
        assert eng.num_running() == 1 and not ends
        assert generation_tokens(eng) >= sum(len(c.token_ids) for c in got) >= 40
        usage = [await aborted(eng, long)]

        # a stop string: its worker may draw past it; the answer counts the tokens up to it
        probe = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
        chunks = [c async for c in eng.submit(GenerateRequest("probe", "tiny-llama", {"prompt_ids": [4, 5]}, probe))]
        usage.append(chunks[-1].num_output_tokens)
        text = "".join(c.text for c in chunks)
        at = next(k for k in range(len(text) // 3, len(text) - 3)
                  if text.find(text[k:k + 3]) == k and "\ufffd" not in text[k:k + 3])
        stop = dataclasses.replace(probe, stop=(text[at:at + 3],))
        stopped = eng.submit(GenerateRequest("stopped", "tiny-llama", {"prompt_ids": [4, 5]}, stop))
        usage.append(await run(stopped))
        assert usage[-1] < 30 and await stopped.settled(30) == usage[-1]
        # and one that runs to its end
        usage.append(await run(eng.submit(GenerateRequest("plain", "tiny-llama", {"prompt_ids": [6]},
                                                          dataclasses.replace(LONG, max_tokens=12)))))
        assert usage[-1] == 12
        assert await wait_for(lambda: len(ends) == 4)
        assert generation_tokens(eng) == sum(usage) and counted_whole(ends, "long"), ends


async def test_audio_codes_count_as_the_worker_draws_them_and_add_up_to_usage() -> None:
    """Orpheus `speak`: no token reaches the event loop; its audio codes
    count as the worker reports drawing them."""
    async with engine(EngineConfig(model="orpheus-tiny")) as (eng, ends):
        long = eng.submit(GenerateRequest("long", "orpheus-tiny", {"text": "a long story"}, LONG))
        got = await read_until(long, lambda cs: audio_chunks(cs) >= 2)
        assert not any(c.token_ids for c in got)
        # mid-answer: the codes of the audio heard so far are counted
        assert eng.num_running() == 1 and not ends
        assert generation_tokens(eng) >= FIRST_WINDOW
        usage = [await aborted(eng, long)]
        short = dataclasses.replace(LONG, max_tokens=50)
        usage.append(await run(eng.submit(GenerateRequest("short", "orpheus-tiny", {"text": "hi"}, short))))
        assert usage[-1] == 50
        assert await wait_for(lambda: len(ends) == 2)
        assert generation_tokens(eng) == sum(usage) and counted_whole(ends, "long"), ends


@pytest.mark.parametrize("model", ["tiny-llama", "orpheus-tiny"])
async def test_preempted_and_aborted_requests_add_up_to_usage(model: str) -> None:
    """Pages taken as rows go (`--kv-reservation lazy`) in a pool too small
    for all: rows are swapped out and back in, two requests are aborted on
    the way, and the counter still ends at what their usage says."""
    cfg = EngineConfig(model=model, max_model_len=128, scheduler=SchedulerConfig(
        page_size=4, num_pages=40, kv_reservation="lazy"))
    async with engine(cfg) as (eng, ends):
        sp = SamplingParams(max_tokens=70, temperature=0.8, repetition_penalty=1.3, ignore_eos=True)

        async def one(i: int) -> int:
            inputs = {"text": f"request {i}"} if model == "orpheus-tiny" else {"prompt_ids": list(range(5 + i, 25 + i))}
            stream = eng.submit(GenerateRequest(f"r{i}", model, inputs, dataclasses.replace(sp, seed=i)))
            if i % 3:
                return await run(stream)
            await read_until(stream, lambda cs: len(cs) >= 3 + i)
            return await aborted(eng, stream)

        usage = await asyncio.gather(*(one(i) for i in range(5)))
        assert eng.workers[0].preemption.preempted > 0
        assert await wait_for(lambda: len(ends) == 5)
        assert generation_tokens(eng) == sum(usage) and counted_whole(ends, "r0", "r3"), ends


@pytest.mark.parametrize("placement", [None, "thinker=0,audio=0,vision=0,talker=1,code2wav=1"])
async def test_a_spoken_chat_counts_its_text_and_its_talker_codes(placement: str | None) -> None:
    """Qwen3-Omni `speak`: the thinker's text tokens reach the event loop,
    the talker's codes do not; the text ends at a stop id. On one worker,
    or the talker on a second one (each worker's count adds up)."""
    hello = {"messages": [{"role": "user", "content": "Say hello."}]}
    cfg = EngineConfig(model="qwen3-omni-tiny", max_model_len=512,
                       **({"devices": ("cpu:0", "cpu:1"), "placement": parse_spec(placement)} if placement
                          else {"devices": ("cpu",)}))
    async with engine(cfg) as (eng, ends):
        text = SamplingParams(max_tokens=60, temperature=0, seed=7, ignore_eos=True)
        chat = GenerateRequest("ids", "qwen3-omni-tiny", hello, text, walk="chat")
        ids = [t for c in [c async for c in eng.submit(chat)] for t in c.token_ids]
        usage = [len(ids)]
        spoken = GenerateRequest("spoken", "qwen3-omni-tiny", {**hello, "voice": "ethan"},
                                 dataclasses.replace(text, stop_token_ids=(ids[3],)), walk="speak",
                                 sampling_by={"talker": {"max_tokens": 12, "ignore_eos": True}})
        usage.append(await run(eng.submit(spoken)))
        assert usage[-1] > ids.index(ids[3]) + 1  # its text, and its talker's codes
        assert await wait_for(lambda: len(ends) == 2)
        assert generation_tokens(eng) == sum(usage) and counted_whole(ends), ends


def test_an_end_adds_what_was_not_counted_and_never_takes_back() -> None:
    m = EngineMetrics()
    m.submitted("a")
    m.generated(5)
    m.finished("a", "stop", 3, output_tokens=8, counted=5)
    assert m.generation_tokens == 8
    m.submitted("b")
    m.generated(4)  # drawn on a worker that then failed: its end's count leaves them out
    m.finished("b", "error", 3, output_tokens=2, counted=4)
    assert m.generation_tokens == 12


async def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()
