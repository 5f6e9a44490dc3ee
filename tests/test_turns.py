"""Text streamed into a running speech request: each piece is one more turn
on the same KV cache. Checked on orpheus-tiny (CPU, greedy): the second turn
prefills only its own tokens, and its audio is exactly what one request with
the whole history as its prompt gives; input can close, a waiting request can
be aborted, and a full context ends the request."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.engine.worker import walker as walker_module
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.worker.turns import TURN_MARGIN
from mstar.errors import RequestError
from mstar.models.orpheus.tokens import turn_after
from mstar.types import GenerateRequest, OutputChunk, SamplingParams

TOKENS = 35  # five frames a turn
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, seed=5, ignore_eos=True)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def eng() -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model="orpheus-tiny", max_model_len=256))
    await engine.start()
    yield engine
    await engine.shutdown()


def _prompt(eng: Engine, text: str) -> list[int]:
    request = GenerateRequest("p", "orpheus-tiny", {"text": text, "voice": "tara"})
    return eng.model.prepare(request).values["prompt_ids"].tolist()


async def _collect(stream) -> tuple[bytes, list[OutputChunk]]:
    audio, chunks = b"", []
    async for chunk in stream:
        audio += chunk.audio or b""
        chunks.append(chunk)
    return audio, chunks


async def _until_awaiting(chunks: AsyncIterator[OutputChunk]) -> tuple[bytes, list[OutputChunk]]:
    """Read one iterator (leaving an `async for` would close the stream) up to
    the request's wait for input."""
    audio, seen = b"", []
    async for chunk in chunks:
        seen.append(chunk)
        if chunk.awaiting_input:
            break
        audio += chunk.audio or b""
    return audio, seen


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


@pytest.mark.asyncio(loop_scope="module")
async def test_second_turn_reuses_the_cache_and_speaks_like_one_long_prompt(eng: Engine) -> None:
    prefills: list[int] = []
    module = eng.workers[0].runners["llm"].module
    real = module.prefill

    def counting(batch):
        prefills.append(int(batch.input_ids.numel()))
        return real(batch)

    module.prefill = counting
    try:
        stream = eng.submit(GenerateRequest("turns", "orpheus-tiny", {"text": "hello there", "voice": "tara"},
                                            GREEDY, more_input=True))
        chunks = aiter(stream)
        first, seen = await _until_awaiting(chunks)
        assert seen[-1].awaiting_input and not seen[-1].finished
        eng.append("turns", {"text": "and a second thing"})
        eng.close_input("turns")
        rest, tail = await _collect(chunks)
    finally:
        module.prefill = real
    assert tail[-1].finished and tail[-1].finish_reason == "length"
    p1, p2 = _prompt(eng, "hello there"), _prompt(eng, "and a second thing")
    assert prefills == [len(p1), len(turn_after(0)) + len(p2)]  # the second turn reads only its own tokens

    # the first turn's tokens, greedy, from the LLM alone
    gen = GenerateRequest("t1", "orpheus-tiny", {"prompt_ids": p1}, GREEDY, walk="generate")
    _, gen_chunks = await _collect(eng.submit(gen))
    t1 = [t for c in gen_chunks for t in c.token_ids]
    assert len(t1) == TOKENS
    history = p1 + t1[:-1] + turn_after(t1[-1]) + p2

    alone, _ = await _collect(eng.submit(GenerateRequest("a1", "orpheus-tiny", {"text": "hello there",
                                                                                "voice": "tara"}, GREEDY)))
    whole, _ = await _collect(eng.submit(GenerateRequest("a2", "orpheus-tiny", {"prompt_ids": history}, GREEDY)))
    # turn one speaks as a request of its own, turn two as one whose prompt is the whole history
    got, want = _pcm(first + rest), _pcm(alone + whole)
    assert len(alone) == len(whole) == 4 * 2048 * 2
    assert got.size == want.size and np.abs(got - want).max() <= 2
    assert 0 < len(first) <= len(alone)  # the wait for input is known before the turn's last audio
    assert eng.pages_in_use() == 0 and len(eng.store) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_pieces_sent_early_queue_in_order_and_close_ends_the_request(eng: Engine) -> None:
    stream = eng.submit(GenerateRequest("queued", "orpheus-tiny", {"text": "one"}, GREEDY, more_input=True))
    n2 = eng.append("queued", {"text": "two"})
    n3 = eng.append("queued", {"text": "three", "voice": "leo"})
    assert n2 == len(_prompt(eng, "two")) and n3 > 0
    eng.close_input("queued")
    audio, chunks = await _collect(stream)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    # three turns of five frames; each turn plays every frame but its first
    assert len(audio) == 3 * 4 * 2048 * 2
    assert chunks[-1].num_prompt_tokens == len(_prompt(eng, "one")) + n2 + n3
    assert chunks[-1].num_output_tokens == 3 * TOKENS
    assert eng.pages_in_use() == 0 and len(eng.store) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_while_waiting_for_input_frees_everything(eng: Engine) -> None:
    stream = eng.submit(GenerateRequest("idle", "orpheus-tiny", {"text": "wait"}, GREEDY, more_input=True))
    chunks = aiter(stream)
    _, seen = await _until_awaiting(chunks)
    assert seen[-1].awaiting_input and eng.pages_in_use() > 0  # the cache is kept for the next turn
    eng.abort("idle")
    for _ in range(1500):
        if eng.pages_in_use() == 0 and eng.num_running() == 0:
            break
        await asyncio.sleep(0.02)
    assert eng.pages_in_use() == 0 and eng.num_running() == 0 and len(eng.store) == 0
    with pytest.raises(RequestError):
        eng.append("idle", {"text": "too late"})
    _, rest = await _collect(chunks)
    assert rest[-1].finish_reason == "abort"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_full_context_ends_the_request(eng: Engine) -> None:
    """More pieces queued than the context holds: the turns that fit speak,
    then the request ends with an error saying the rest was not spoken."""
    stream = eng.submit(GenerateRequest("full", "orpheus-tiny", {"text": "a"}, GREEDY, more_input=True))
    taken = 0
    try:  # the engine counts the prompts (nothing spoken yet): it takes more than the context will hold
        for i in range(10):
            eng.append("full", {"text": f"piece {i}"})
            taken += 1
    except RequestError as e:
        assert e.field == "input"
    assert taken >= 6
    audio, chunks = await _collect(stream)  # 256 positions hold about four turns of this size
    assert chunks[-1].finished and chunks[-1].finish_reason == "error"
    assert "not spoken" in (chunks[-1].error or "")
    assert 4 * 2048 * 2 < len(audio) < 10 * 4 * 2048 * 2
    assert eng.pages_in_use() == 0 and len(eng.store) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_input_is_refused_where_a_request_takes_none(eng: Engine) -> None:
    with pytest.raises(RequestError) as e:
        eng.submit(GenerateRequest("g", "orpheus-tiny", {"prompt_ids": [1, 2]}, GREEDY, walk="generate",
                                   more_input=True))
    assert e.value.field == "input"
    await _collect(eng.submit(GenerateRequest("plain", "orpheus-tiny", {"text": "x"}, GREEDY)))
    with pytest.raises(RequestError):
        eng.append("plain", {"text": "more"})
    stream = eng.submit(GenerateRequest("empty", "orpheus-tiny", {"text": "x"}, GREEDY, more_input=True))
    with pytest.raises(RequestError) as e:
        eng.append("empty", {"text": "  "})
    assert e.value.field == "input"
    eng.close_input("empty")
    await _collect(stream)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_piece_is_refused_when_what_the_request_spoke_leaves_no_room(eng: Engine) -> None:
    """The event loop never counts a speech walk's audio tokens; the worker's
    count at each catch-up does, so a piece that fits beside the prompts alone
    but not beside what was spoken is refused while the client can be told."""
    stream = eng.submit(GenerateRequest("room", "orpheus-tiny", {"text": "hello there", "voice": "tara"}, GREEDY,
                                        more_input=True))
    chunks = aiter(stream)
    _, seen = await _until_awaiting(chunks)
    prompt = seen[-1].num_prompt_tokens
    like = GenerateRequest("like", "orpheus-tiny", {"text": "hello there", "voice": "tara"}, GREEDY, more_input=True)
    overhead = eng.model.prepare_more(like, {"text": "x"}).num_tokens - 1  # the turn's markers
    # past the context beside the prompt and the 35 spoken tokens, within it beside the prompt alone
    text = "y" * (256 - prompt - TOKENS // 2 - overhead)
    with pytest.raises(RequestError) as e:
        eng.append("room", {"text": text})
    assert e.value.field == "input" and "context" in e.value.message
    eng.append("room", {"text": "short"})  # a piece that fits still goes
    eng.close_input("room")
    _, tail = await _collect(chunks)
    assert tail[-1].finished


@pytest.mark.asyncio(loop_scope="module")
async def test_between_turns_a_piece_keeps_room_for_its_own_answer_alone(eng: Engine) -> None:
    """While a turn runs, a piece must leave it and its own turn room to
    answer; once the request waits for input, only its own: the largest piece
    then is one first window (`min_turn_tokens`) short of the context."""
    chunks = aiter(eng.submit(GenerateRequest("between", "orpheus-tiny", {"text": "hello there", "voice": "tara"},
                                              GREEDY, more_input=True)))
    await _until_awaiting(chunks)
    state = eng._states["between"]
    held = max(state.num_prompt_tokens + state.num_output_tokens, state.context_floor)
    base = eng.model.prepare_more(GenerateRequest("b", "orpheus-tiny", {}), {"text": "a"}).num_tokens - 1
    room = 256 - TURN_MARGIN - eng.model.min_turn_tokens
    with pytest.raises(RequestError) as e:
        eng.append("between", {"text": "a" * (room + 1 - held - base)})
    assert "too little room" in e.value.message
    assert held + eng.append("between", {"text": "a" * (room - held - base)}) == room
    eng.close_input("between")
    _, tail = await _collect(chunks)
    assert tail[-1].finished and tail[-1].error is None, tail[-1]   # its turn ran: nothing was dropped
    assert eng.pages_in_use() == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_ends_as_its_last_turn_did(eng: Engine) -> None:
    """The first turn runs out at max_tokens ("length"), the second stops on a
    stop id: the request ends "stop", as its last turn did, the first turn's
    cut forgotten."""
    p1, p2 = _prompt(eng, "hello there"), _prompt(eng, "and a second thing")
    _, c1 = await _collect(eng.submit(GenerateRequest("g1", "orpheus-tiny", {"prompt_ids": p1}, GREEDY,
                                                      walk="generate")))
    t1 = [t for c in c1 for t in c.token_ids]
    _, c2 = await _collect(eng.submit(GenerateRequest("g2", "orpheus-tiny", {"prompt_ids": p1 + t1[:-1] +
                                                                             turn_after(t1[-1]) + p2}, GREEDY,
                                                      walk="generate")))
    stop = next(t for t in [t for c in c2 for t in c.token_ids][:TOKENS - 5] if t not in t1)
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, seed=5, ignore_eos=True, stop_token_ids=(stop,))
    chunks = aiter(eng.submit(GenerateRequest("last", "orpheus-tiny", {"text": "hello there", "voice": "tara"}, sp,
                                              more_input=True)))
    await _until_awaiting(chunks)
    eng.append("last", {"text": "and a second thing"})
    eng.close_input("last")
    _, tail = await _collect(chunks)
    assert tail[-1].finish_reason == "stop" and tail[-1].num_output_tokens < 2 * TOKENS


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("when", ["queued", "while-speaking", "item-steps"])
async def test_a_turn_leaves_room_for_the_input_queued_behind_it(eng: Engine, when: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No max_tokens: a turn could fill the context (256). Input the engine
    took, sent before the turn began or while it speaks, is still spoken:
    the turn takes half of what the context has left besides the queued
    piece (counted from its whole prompt, even when the piece came before
    the prompt was read), the piece's turn the rest, and the request then
    waits for more. With `item-steps` the loop runs outside a decode group."""
    if when == "item-steps":
        monkeypatch.setattr(walker_module, "join_group", lambda *args: False)
    starts: list[tuple[int, int]] = []  # each prefill's first position and length
    module = eng.workers[0].runners["llm"].module
    real = module.prefill

    def counting(batch):
        starts.append((int(batch.positions.reshape(-1)[0]), int(batch.input_ids.numel())))
        return real(batch)

    sampling = SamplingParams(max_tokens=None, temperature=0.0, seed=5, ignore_eos=True)
    rid, text = f"room-{when}", f"{when}: " + "hello there, " * 6
    module.prefill = counting
    try:
        stream = eng.submit(GenerateRequest(rid, "orpheus-tiny", {"text": text}, sampling, more_input=True))
        chunks = aiter(stream)
        first = b""
        if when == "while-speaking":
            async for chunk in chunks:
                first += chunk.audio or b""
                if first:
                    break
        n2 = eng.append(rid, {"text": "and a second thing"})
        audio, seen = await _until_awaiting(chunks)
    finally:
        module.prefill = real
    p1, p2 = _prompt(eng, text), _prompt(eng, "and a second thing")
    assert seen[-1].awaiting_input and not seen[-1].finished, seen[-1]  # it had room for the second turn
    assert len(starts) == 2 and starts[1][1] == len(turn_after(0)) + len(p2)  # then it read only its own tokens
    room = 256 - n2 - TURN_MARGIN  # the most the first turn may hold and leave the piece its room
    if when == "while-speaking":  # from where it stood when the piece came: past its first window of 28 tokens
        assert len(p1) + 28 - 2 <= starts[1][0] <= room
    else:  # its half of what the context had left besides the piece, counted from its whole prompt
        half = len(p1) + (room - len(p1)) // 2
        assert half - 2 <= starts[1][0] <= half + 1
    assert len(first + audio) >= 2 * 4 * 2048 * 2  # each turn spoke
    eng.close_input(rid)
    _, tail = await _collect(chunks)
    assert tail[-1].finished and tail[-1].num_prompt_tokens == len(p1) + n2
    # the two turns and the markers between them (the first turn's last token is one of its outputs) fill no more
    # than the context
    assert tail[-1].num_prompt_tokens + tail[-1].num_output_tokens + len(turn_after(0)) - 1 <= 256
    assert eng.pages_in_use() == 0 and len(eng.store) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_a_piece_that_came_too_late_for_the_context_ends_the_request_with_an_error(eng: Engine) -> None:
    """The engine takes a piece by its own count of the context, which lags
    the worker's: a piece that still finds no room when its turn would start
    is not spoken, and the request ends with an error that says so (it was
    dropped without a word, and counted in usage)."""
    sampling = SamplingParams(max_tokens=None, temperature=0.0, seed=5, ignore_eos=True)
    stream = eng.submit(GenerateRequest("late", "orpheus-tiny", {"text": "hello"}, sampling, more_input=True))
    chunks = aiter(stream)
    frames = 0
    async for chunk in chunks:
        frames += len(chunk.audio or b"") // (2048 * 2)
        if frames >= 6:  # 28 + 3 x 7 tokens written, which the engine has not counted yet
            break
    state = eng._states["late"]
    held = max(state.num_prompt_tokens + state.num_output_tokens, state.context_floor)
    # the largest piece the engine takes now: by its count the two turns keep a first window each
    base = eng.model.prepare_more(GenerateRequest("late", "orpheus-tiny", {}), {"text": "a"}).num_tokens - 1
    room = 256 - TURN_MARGIN - 2 * eng.model.min_turn_tokens
    with pytest.raises(RequestError) as e:
        eng.append("late", {"text": "a" * (room + 1 - held - base)})
    assert e.value.field == "input" and "too little room" in e.value.message
    n = eng.append("late", {"text": "a" * (room - held - base)})
    assert held + n == room
    eng.close_input("late")
    _, rest = await _collect(chunks)
    assert rest[-1].finished and rest[-1].finish_reason == "error"
    assert "not spoken" in (rest[-1].error or "") and "fewer than a turn needs (14)" in rest[-1].error
    for _ in range(500):
        if eng.pages_in_use() == 0 and len(eng.store) == 0:
            break
        await asyncio.sleep(0.01)
    assert eng.pages_in_use() == 0 and len(eng.store) == 0


def test_a_turn_cut_for_the_piece_behind_it_leaves_that_piece_room_to_answer() -> None:
    """Half of what is left besides the piece, unless the piece's turn would
    then keep fewer than `answer_room` tokens: the turn under way (which has
    spoken already) gives up the difference."""
    def ceiling(kv: int, room_for: int, answer_room: int) -> int | None:
        part = PartitionRun(request=None, plan=None, room_for=room_for, answer_room=answer_room)  # type: ignore
        return part.turn_ceiling(256, kv)
    assert ceiling(100, 56, 14) == 100 + 50   # 100 left: half each, 50 >= 14
    assert ceiling(180, 56, 14) == 180 + 6    # 20 left: the piece's turn keeps its 14, the turn under way 6
    assert ceiling(190, 56, 14) == 190        # 10 left: all of it to the piece's turn
    assert ceiling(180, 56, 1) == 180 + 10    # a model that answers in a token: half each
