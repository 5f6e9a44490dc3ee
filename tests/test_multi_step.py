"""Several decode steps a launch (`--num-scheduler-steps`): the outputs are
those of one step a launch (greedy, seeded, with a repetition penalty, stop
ids hit inside a launch, caps, min_tokens, logprobs), the prefix cache gets
the same ids, no page leaks, and the scheduler plans the steps (a launch's
pages for all of them, one step while new rows wait)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiny_llama import save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.worker.executor import Executor
from mstar.scheduler import LaunchSteps, ModeCaps, PagePool, Scheduler, WorkItem
from mstar.scheduler.plan import AUTO_STEPS
from mstar.types import GenerateRequest, SamplingParams
from launch_counts import launches, together
from standing_group import FakeGroup

pytest.importorskip("transformers")

VOCAB = 384
DECODE = ("llm", "decode")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_multi_step"), VOCAB)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(21)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 30)] + [[1, 7], [1, 8, 9]]


def _params(stop: int | None) -> list[SamplingParams]:
    """Rows of several kinds in one group; `stop`: an id some rows stop at."""
    stops = (stop,) if stop is not None else ()
    return [SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True, stop_token_ids=stops),
            SamplingParams(max_tokens=17, temperature=0.9, seed=3, repetition_penalty=1.3, ignore_eos=True,
                           stop_token_ids=stops),
            SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=40, seed=5, repetition_penalty=1.2),
            SamplingParams(max_tokens=7, temperature=0.7, seed=9, ignore_eos=True)]


async def _run(eng: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], str | None]:
    toks: list[int] = []
    reason = None
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        assert chunk.error is None, chunk.error
        toks.extend(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return toks, reason


class _Counts:
    """Launches of several steps, and the ids each ending row put in the prefix cache."""

    def __init__(self) -> None:
        self.launches: list[int] = []
        self.cached: list[list[int]] = []
        self.ran: list[int] = []  # the steps each of those ran


@contextlib.contextmanager
def _cached() -> Iterator[list[list[int]]]:
    """The ids each ending row hands the prefix cache, while the block runs."""
    cached: list[list[int]] = []
    cache_pages = Scheduler.cache_pages

    def counting_cache(self, component, ids, pages):  # type: ignore[no-untyped-def]
        cached.append(list(ids))
        return cache_pages(self, component, ids, pages)

    Scheduler.cache_pages = counting_cache  # type: ignore[method-assign]
    try:
        yield cached
    finally:
        Scheduler.cache_pages = cache_pages  # type: ignore[method-assign]


async def _outputs(folder: Path, steps: int, params: list[SamplingParams], reservation: str = "lazy",
                   late: list[SamplingParams] | None = None, device: str = "cpu", eager: bool = False,
                   arriving: float = 0.0) -> tuple[list[tuple[list[int], str | None]], _Counts]:
    """The outputs of every prompt under every `params`, started together;
    then `late`'s, started while the first still run. `eager`: no CUDA graphs;
    `arriving`: the share of a launch's steps after which the worker is told
    that new requests wait (seeded), which ends the launch there."""
    counts = _Counts()
    eng = Engine(EngineConfig(model=str(folder), devices=(device,), dtype="float32", enforce_eager=eager,
                              scheduler=SchedulerConfig(
        page_size=4, num_pages=768, kv_reservation=reservation, num_scheduler_steps=steps)))
    await eng.start()
    if arriving:
        rng = random.Random(11)
        eng.workers[0].executor.arriving = lambda: rng.random() < arriving
    try:
        with launches(counts.ran) as counts.launches, _cached() as counts.cached:
            tasks = [asyncio.ensure_future(_run(eng, f"r{i}.{j}", prompt, sp))
                     for i, prompt in enumerate(_prompts()) for j, sp in enumerate(params)]
            if late:
                await asyncio.sleep(0.05)
                tasks += [asyncio.ensure_future(_run(eng, f"late{j}", _prompts()[0], sp))
                          for j, sp in enumerate(late)]
            outs = await asyncio.gather(*tasks)
        prompts = [p for p in _prompts() for _ in params] + [_prompts()[0]] * len(late or [])
        ran = [prompt + out for prompt, (out, _) in zip(prompts, outs)]
        for ids in counts.cached:  # each ending row's ids, as its pages hold them: its prompt, then its output
            assert any(seq[:len(ids)] == ids for seq in ran), ids
        for _ in range(500):
            if eng.pages_in_use() == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.pages_in_use() == 0  # every page back in the pool (the prefix cache's idle ones count free)
        return outs, counts
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("reservation,device,eager", [("lazy", "cpu", False), ("request", "cpu", False)]
                         + ([("lazy", "cuda:0", False), ("lazy", "cuda:0", True)] if torch.cuda.is_available() else []))
async def test_outputs_are_those_of_one_step_a_launch(hf_folder: Path, reservation: str, device: str,
                                                      eager: bool) -> None:
    """On CUDA with graphs and without: an eager step plans its attention through the planner's page-locked
    buffer, which the next step's plan rewrites while launches run ahead of the device."""
    plain, _ = await _outputs(hf_folder, 1, _params(None), reservation, device=device, eager=eager)
    # a stop id the first greedy row meets first at its 6th, 7th or 8th token: inside its second launch of 4
    greedy = plain[0][0]
    at = next(i for i in (5, 6, 7) if greedy[i] not in greedy[:i])
    one, counts_one = await _outputs(hf_folder, 1, _params(greedy[at]), reservation, device=device, eager=eager)
    assert not counts_one.launches
    assert one[0] == (greedy[:at + 1], "stop")
    for steps in (4, 3):
        many, counts = await _outputs(hf_folder, steps, _params(greedy[at]), reservation, device=device, eager=eager)
        assert many == one
        assert counts.launches and max(counts.launches) == steps
        assert sorted(counts.cached) == sorted(counts_one.cached)


async def test_launches_that_arrivals_end_early_keep_the_outputs(hf_folder: Path) -> None:
    """A launch ends at the step it has queued when new requests wait: its
    rows' tokens, stops and cached ids are those of one step a launch."""
    plain, _ = await _outputs(hf_folder, 1, _params(None))
    greedy = plain[0][0]
    at = next(i for i in (5, 6, 7) if greedy[i] not in greedy[:i])
    one, counts_one = await _outputs(hf_folder, 1, _params(greedy[at]))
    many, counts = await _outputs(hf_folder, 4, _params(greedy[at]), arriving=0.4)
    assert many == one
    assert sorted(counts.cached) == sorted(counts_one.cached)
    cut = [(planned, ran) for planned, ran in zip(counts.launches, counts.ran) if ran < planned]
    assert len(counts.ran) == len(counts.launches) and len(cut) >= 3 and 4 in counts.ran


async def test_rows_that_need_a_decision_a_step_keep_launches_single_until_they_leave(hf_folder: Path) -> None:
    """min_tokens (stop ids banned a while) and logprobs launch one step at a
    time while such a row runs; the others' outputs do not change."""
    params = _params(None)
    late = [SamplingParams(max_tokens=9, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=11, temperature=0.5, seed=1, min_tokens=8, stop_token_ids=(5, 6, 7))]
    one, _ = await _outputs(hf_folder, 1, params, late=late)
    many, counts = await _outputs(hf_folder, 4, params, late=late)
    assert many == one and counts.launches


# ---------------------------------------------------------------- the scheduler's plans


class _Group(FakeGroup):
    """A standing group whose rows lack pages at lengths `kv` and may run `room` steps."""

    def __init__(self, kv: list[int], held: list[int], room: int, emits: bool = False) -> None:
        super().__init__(len(kv), emits=emits)
        self.kv, self.held, self.room = kv, held, room

    def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
        out = []
        for i, (kv, held) in enumerate(zip(self.kv, self.held)):
            out += [i] * max(0, -(-(kv + ahead) // page_size) - held)
        return out

    def steps_room(self, most: int) -> int:
        return min(most, self.room)


def _scheduler(steps: int | None, pages: int = 64) -> tuple[Scheduler, PagePool]:
    pool = PagePool(pages, 4)
    caps = {DECODE: ModeCaps(max_rows=8, max_tokens=64), ("llm", "prefill"): ModeCaps(max_rows=8, max_tokens=64)}
    return Scheduler(caps, {"llm": pool}, grow_pages=True, steps=LaunchSteps.of(steps)), pool


def test_a_launch_of_several_steps_gets_the_pages_all_of_them_write() -> None:
    sched, pool = _scheduler(4)
    group = _Group(kv=[3, 4, 6, 8], held=[1, 1, 2, 3], room=9)
    sched.add_group(DECODE, group)
    plan = sched.schedule()
    assert plan is not None and plan.steps == 4
    assert [row for row, _ in plan.grow] == [0, 1, 2]  # rows 0-2 cross into a page they lack; row 3 holds 8..11
    group.room = 2
    assert sched.schedule().steps == 2  # a row within 2 of its cap


def test_one_step_a_launch_while_new_rows_wait_or_pages_run_short() -> None:
    sched, pool = _scheduler(4)
    group = _Group(kv=[3, 4], held=[1, 1], room=9)
    sched.add_group(DECODE, group)
    item = WorkItem("new", "main", "llm", "prefill", num_tokens=5, pages_needed=2, starts_row=True)
    sched.add(item)
    taken = pool.allocate(pool.num_free)  # no page for the prompt: it waits, and the group steps one at a time
    plan = sched.schedule()
    assert plan is not None and plan.group is group and plan.steps == 1
    pool.free(taken)
    sched.running["llm"] = sched.max_running["llm"] = 2  # the prompt waits for a running row to end: no hold
    plan = sched.schedule()
    assert plan is not None and plan.group is group and plan.steps == 4
    sched, pool = _scheduler(4, pages=4)
    pool.allocate(3)
    group = _Group(kv=[4, 7], held=[1, 2], room=9)  # 4 steps need 2 pages, one step needs 1
    sched.add_group(DECODE, group)
    plan = sched.schedule()
    assert plan.steps == 1 and [row for row, _ in plan.grow] == [0]


def test_auto_runs_several_steps_only_for_a_group_whose_tokens_no_client_reads() -> None:
    for emits, steps, want in ((False, None, AUTO_STEPS), (True, None, 1), (True, 8, 8), (False, 8, 8),
                               (False, 1, 1)):
        sched, _ = _scheduler(steps)
        sched.add_group(DECODE, _Group(kv=[3, 4], held=[2, 2], room=9, emits=emits))
        plan = sched.schedule()
        assert plan is not None and plan.steps == want, (emits, steps)


def test_the_cli_takes_and_checks_the_steps() -> None:
    from mstar.config import ConfigError, parse_args

    assert parse_args(["--num-scheduler-steps", "8"]).engine.scheduler.num_scheduler_steps == 8
    assert parse_args(["--num-scheduler-steps", "auto"]).engine.scheduler.num_scheduler_steps is None
    assert parse_args([]).engine.scheduler.num_scheduler_steps == 1
    for bad in ("0", "-2", "four"):
        with pytest.raises(ConfigError):
            parse_args(["--num-scheduler-steps", bad])



Shown = list[dict[int, str]]  # per request: its text so far at each chunk's count of output tokens


async def _texts(steps: int, params: list[SamplingParams], shown: Shown | None = None
                 ) -> tuple[list[tuple[str, tuple[int, ...], str | None, int | str | None, int]], list[int]]:
    """Text prompts on the built-in tiny-llama (a byte tokenizer), run
    together: each request's text, ids, finish and stop reasons, usage;
    into `shown`, the text each had shown at each of its chunks."""
    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(num_scheduler_steps=steps)))
    await eng.start()

    async def one(i: int, sp: SamplingParams) -> tuple[str, tuple[int, ...], str | None, int | str | None, int]:
        text, ids, last = "", (), None
        seen: dict[int, str] = {}
        async for chunk in eng.submit(GenerateRequest(f"t{i}", eng.model_name, {"prompt": f"story {i}:"}, sp)):
            assert chunk.error is None, chunk.error
            text, ids, last = text + chunk.text, ids + chunk.token_ids, chunk
            seen[chunk.num_output_tokens] = text
        if shown is not None:
            shown.append(seen)
        assert last is not None
        return text, ids, last.finish_reason, last.stop_reason, last.num_output_tokens

    return await together(eng, [one(i, sp) for i, sp in enumerate(params)])


async def test_text_stop_strings_and_usage_are_those_of_one_step_a_launch() -> None:
    """Detokenised text in runs of a launch's tokens, stop strings found
    between them (the tokens after a match dropped), usage counted alike."""
    base = [SamplingParams(max_tokens=40, temperature=0.8, seed=20 + i, ignore_eos=True) for i in range(4)]
    plain, _ = await _texts(1, base)
    stop = plain[0][0][9:11]  # a stop string the first request meets in its tenth or eleventh byte
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=20, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=40, temperature=0.8, seed=21, ignore_eos=True, stop=[stop],
                             include_stop_str_in_output=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=22, ignore_eos=True),
              SamplingParams(max_tokens=33, temperature=0.8, seed=23, ignore_eos=True,
                             stop_token_ids=(plain[3][1][13],))]
    one, none = await _texts(1, params)
    assert one[0][2] == "stop" and one[0][3] == stop and len(one[0][1]) < 40
    assert one[3][2] == "stop"  # its stop id, the 14th token's, inside a launch of 4
    many, launches = await _texts(4, params)
    assert many == one and not none and launches.count(4) >= 5


async def test_streamed_text_is_shown_as_soon_as_one_step_a_launch_shows_it() -> None:
    """A launch's run of byte tokens is detokenised a token at a time: its
    complete characters are not held back behind an incomplete last one."""
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(3)]
    one: Shown = []
    many: Shown = []
    await _texts(1, params, one)
    await _texts(8, params, many)
    for a, b in zip(one, many):
        assert len(b) < len(a)  # fewer, larger chunks
        for count, text in b.items():
            assert text == a[count], count  # what the run shows by its last token: what one step a launch had


async def _aborted_on_stop(folder: Path, steps: int, stop: int | None) -> tuple[list[int], int]:
    """A greedy request aborted by the worker right after launching the
    steps that draw `stop` (none: not aborted); its tokens and the tokens
    its usage counts."""
    run_group = Executor._run_group

    def aborting(self, plan):  # type: ignore[no-untyped-def]
        run_group(self, plan)
        p = self._inflight.get(plan.group)
        if stop is not None and p is not None and "r" in p.request_ids and stop in p.host.reshape(-1).tolist():
            self.walker.abort("r")  # that launch is still unread, as when an abort is taken in

    eng = Engine(EngineConfig(model=str(folder), devices=("cpu",), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=256, num_scheduler_steps=steps)))
    await eng.start()
    Executor._run_group = aborting  # type: ignore[method-assign]
    try:
        stream = eng.submit(GenerateRequest("r", eng.model_name, {"prompt_ids": [1, 17, 99, 230, 5, 61]},
                                            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                           stop_token_ids=(stop,) if stop is not None else ())))
        tokens = [t async for chunk in stream for t in chunk.token_ids]
        return tokens, await stream.settled(5.0)
    finally:
        Executor._run_group = run_group  # type: ignore[method-assign]
        await eng.shutdown()


async def test_an_abort_counts_no_token_drawn_after_the_stop_id(hf_folder: Path) -> None:
    plain, _ = await _aborted_on_stop(hf_folder, 1, None)
    stop = plain[next(i for i in range(3, 20) if plain[i] not in plain[:i])]
    one, many = await _aborted_on_stop(hf_folder, 1, stop), await _aborted_on_stop(hf_folder, 8, stop)
    assert many[1] == one[1] and many[1] <= plain.index(stop) + 2
