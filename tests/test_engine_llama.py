"""A served Llama end to end on CPU: parity with transformers for concurrent
requests sharing batches, stop rules, page admission under a tight budget, and
1,000 requests (some aborted) leaving the store and the page pool as they were."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from http_support import wait_until
from tiny_llama import save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 384


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), VOCAB)


def _hf_greedy(folder: Path, prompts: list[list[int]], new: int, stop: int | None = None,
               min_new: int = 0) -> list[list[int]]:
    """transformers' greedy tokens; `stop` ends them, not before `min_new` (its `min_new_tokens`)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = stop
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0, min_new_tokens=min_new)
        outs.append(out[0, len(p):].tolist())
    return outs


async def _run(eng: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], str | None]:
    toks: list[int] = []
    reason = None
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        toks.extend(chunk.token_ids)
        reason = chunk.finish_reason
    return toks, reason


async def _drained(eng: Engine) -> None:
    for _ in range(3000):
        if eng.pages_in_use() == 0 and len(eng.store) == 0 and not any(w.walker.runs for w in eng.workers):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not drained: {eng.pages_in_use()} pages, {len(eng.store)} tensors")


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 6, 13, 30, 47, 64)]


async def test_concurrent_greedy_matches_transformers(hf_folder: Path) -> None:
    prompts = _prompts()
    new = 24
    expected = _hf_greedy(hf_folder, prompts, new)
    eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(page_size=4, num_pages=512)))
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        # every prompt at once, and each one twice more staggered so that
        # prefills land between the decode steps of running requests
        tasks = [_run(eng, f"a{i}", p, sp) for i, p in enumerate(prompts)]
        first = asyncio.gather(*tasks)
        await asyncio.sleep(0.01)
        later = asyncio.gather(*[_run(eng, f"b{i}", p, sp) for i, p in enumerate(prompts)])
        got_a, got_b = await first, await later
        for i, exp in enumerate(expected):
            assert got_a[i] == (exp, "length"), f"prompt {i}"
            assert got_b[i] == (exp, "length"), f"prompt {i} (staggered)"
        stats = eng.workers[0].stats
        assert stats.rows > 2 * stats.steps  # requests really shared steps
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_eos_and_stop_token_ids_end_with_stop(hf_folder: Path) -> None:
    prompts = _prompts()[:3]
    expected = _hf_greedy(hf_folder, prompts, 12)
    eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(page_size=4, num_pages=256)))
    await eng.start()
    try:
        for i, (p, exp) in enumerate(zip(prompts, expected)):
            stop_at = exp[5]
            cut = exp[: exp.index(stop_at) + 1]
            sp = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
            dropped = eng.workers[0].stats.dropped_rows
            assert await _run(eng, f"s{i}", p, sp) == (cut, "stop")
            # busy until the speculative step is read
            assert await wait_until(lambda: not eng.workers[0].busy, 30), "the worker stayed busy"
            if len(cut) > 2:
                # decode steps are launched before the previous one is read: the step
                # after the stop token ran speculatively and its output was dropped
                assert eng.workers[0].stats.dropped_rows == dropped + 1
        # ignore_eos does not switch off stop_token_ids
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(expected[0][3],))
        toks, reason = await _run(eng, "x", prompts[0], sp)
        assert reason == "stop" and toks[-1] == expected[0][3]
        # min_tokens: the stop ids are not drawn before that many tokens, on the prefill's token (an item step)
        # and on a decode group's: transformers' min_new_tokens, token for token
        for rid, stop, least in (("m0", expected[0][0], 3), ("m5", expected[0][5], 8)):
            want = _hf_greedy(hf_folder, prompts[:1], 12, stop, least)[0]
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,),
                                min_tokens=least)
            toks, reason = await _run(eng, rid, prompts[0], sp)
            assert toks == want and stop not in toks[:least] and len(toks) >= least
            assert reason == ("stop" if toks[-1] == stop else "length")
        # max_tokens=1: the prefill's token is the whole answer
        assert await _run(eng, "one", prompts[0], SamplingParams(max_tokens=1, temperature=0.0)) == (
            expected[0][:1], "length")
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        prompt = eng.tokenizer("tiny-llama").encode("Once upon a time")
        sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, repetition_penalty=1.2, seed=7)
        alone = await _run(eng, "alone", prompt, sp)
        crowd = await asyncio.gather(*[
            _run(eng, f"c{i}", prompt if i == 3 else prompt[: 2 + i],
                 sp if i == 3 else SamplingParams(max_tokens=16, temperature=1.0, seed=i)) for i in range(8)])
        assert crowd[3] == alone
        other = await _run(eng, "other", prompt, SamplingParams(max_tokens=16, temperature=0.9, seed=8))
        assert other[0] != alone[0]
    finally:
        await eng.shutdown()


async def test_tight_page_budget_admits_whole_requests_only() -> None:
    # 12 pages of 16 tokens; each request reserves prompt + max_tokens = 3 pages
    cfg = EngineConfig(model="tiny-llama", max_model_len=64,
                       scheduler=SchedulerConfig(page_size=16, num_pages=12))
    eng = Engine(cfg)
    await eng.start()
    peak = 0

    def watch(_report: object) -> None:
        nonlocal peak
        peak = max(peak, eng.pages_in_use())

    eng.add_report_hook(watch)
    try:
        prompt = list(range(5, 25))
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        results = await asyncio.gather(*[_run(eng, f"r{i}", prompt, sp) for i in range(10)])
        assert all(len(t) == 20 and r == "length" for t, r in results)
        assert len({tuple(t) for t, _ in results}) == 1
        assert 0 < peak <= 12
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_thousand_requests_with_aborts_leave_nothing_behind() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(page_size=8, num_pages=2048)))
    await eng.start()
    pool = eng.workers[0].pools["llm"]
    free_before = pool.num_free
    try:
        rng = random.Random(0)

        async def one(i: int) -> str | None:
            prompt = [rng.randrange(5, 250) for _ in range(rng.randrange(1, 40))]
            sp = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 1.0]), seed=i)
            stream = eng.submit(GenerateRequest(f"q{i}", "tiny-llama", {"prompt_ids": prompt}, sp))
            mode = i % 5
            if mode == 0:  # aborted before its first output
                eng.abort(stream.request_id)
            reason = None
            async for chunk in stream:
                if mode == 1 and not chunk.finished:  # aborted mid-stream
                    await stream.aclose()
                    return "abort"
                reason = chunk.finish_reason
            return reason

        reasons = []
        for start in range(0, 1000, 250):
            reasons += await asyncio.gather(*[one(i) for i in range(start, start + 250)])
        assert reasons.count("abort") >= 200
        assert set(reasons) <= {"abort", "length", "stop"}
        await _drained(eng)
        assert pool.num_free == free_before
        assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
        assert eng.store.num_owners() == 0
        assert not eng.workers[0].scheduler.has_work()
    finally:
        await eng.shutdown()


async def test_decode_rows_step_in_turn_when_more_than_a_step_holds() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(max_num_seqs=3)))
    await eng.start()
    try:
        prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(10)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        together = await asyncio.gather(*[_run(eng, f"t{i}", p, sp) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert together[i] == await _run(eng, f"a{i}", p, sp)
        # the decode loops ran as a tensor-held group, in windows of 3 rows
        groups = list(eng.workers[0].walker.groups.values())
        assert groups and all(len(g) == 0 for g in groups)
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_stop_string_stops_a_decoding_row_and_frees_it() -> None:
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        tok = eng.tokenizer("tiny-llama")
        prompt = tok.encode("ab")
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

        async def text(rid: str, params: SamplingParams) -> tuple[str, str | None]:
            out, reason = [], None
            async for chunk in eng.submit(GenerateRequest(rid, "tiny-llama", {"prompt_ids": prompt}, params)):
                out.append(chunk.text)
                reason = chunk.finish_reason
            return "".join(out), reason

        full, _ = await text("full", sp)
        stop = full[10:13]
        assert len(stop) == 3
        cut, reason = await text("cut", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                       stop=(stop,)))
        assert reason == "stop" and cut == full[: full.index(stop)]
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_min_tokens_holds_stop_strings_back_as_it_holds_stop_ids() -> None:
    """With `min_tokens`, as vLLM: a stop string within the text of the first
    `min_tokens` tokens does not stop the answer; one that ends later does,
    the text cut before it; usage counts the tokens up to that one."""
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        tok = eng.tokenizer("tiny-llama")
        ids = tok.encode("ab")
        free, _ = await _run(eng, "free", ids, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        texts = [tok.decode(free[:n]) for n in range(31)]
        # a character of the 3rd token's text that comes again later, ending in a later token's text
        stop = next(c for c in texts[3][len(texts[2]):] if c in texts[30][len(texts[6]):])
        first_after = next(n for n in range(7, 31) if stop in texts[n][len(texts[6]):])
        for min_tokens, taken in ((0, next(n for n in range(31) if stop in texts[n])), (6, first_after)):
            chunks = [c async for c in eng.submit(GenerateRequest(
                f"min{min_tokens}", eng.model_name, {"prompt_ids": ids},
                SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,),
                               min_tokens=min_tokens)))]
            text = "".join(c.text for c in chunks)
            assert chunks[-1].finish_reason == "stop" and chunks[-1].num_output_tokens == taken
            armed = len(texts[min_tokens])  # a match must end past here
            cut = next(i for i in range(len(texts[taken]))
                       if texts[taken].startswith(stop, i) and i + len(stop) > armed)
            assert text == texts[taken][:cut]
        assert taken > 6 and stop in texts[6]  # the stop string was there before min_tokens, and passed
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_skip_special_tokens_and_include_stop_str_in_output_shape_the_text() -> None:
    """vLLM's text options: `skip_special_tokens=False` keeps special tokens'
    text; `include_stop_str_in_output` keeps the stop string that ended it."""
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        tok = eng.tokenizer("tiny-llama")
        ids = tok.encode("ab")

        async def text(rid: str, params: SamplingParams) -> tuple[str, list[int]]:
            chunks = [c async for c in eng.submit(GenerateRequest(rid, "tiny-llama", {"prompt_ids": ids}, params))]
            return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]

        # a seeded draw hot enough to write a special token (ids 256 on) among the bytes
        for seed in range(40):
            hot = SamplingParams(max_tokens=48, temperature=3.0, seed=seed, ignore_eos=True)
            if any(t >= 256 for t in (await text(f"hot{seed}", hot))[1]):
                break
        shown, got = await text("shown", dataclasses.replace(hot, skip_special_tokens=False))
        skipped, _ = await text("skipped", hot)
        assert shown == tok.decode(got, skip_special_tokens=False) != skipped == tok.decode(got)
        greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        full, _ = await text("full", greedy)
        stop = full[8:10]
        cut, _ = await text("cut", dataclasses.replace(greedy, stop=(stop,)))
        kept, _ = await text("kept", dataclasses.replace(greedy, stop=(stop,), include_stop_str_in_output=True))
        assert cut == full[:full.index(stop)] and kept == cut + stop
        # a stop id ends the text without its own, as vLLM's: kept only with include_stop_str_in_output
        seeded = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
        _, ids_full = await text("ids", seeded)
        at = next(k for k in range(3, 30) if ids_full[k] not in ids_full[:k])
        ended = dataclasses.replace(seeded, stop_token_ids=(ids_full[at],))
        without, got = await text("without", ended)
        with_it, _ = await text("with", dataclasses.replace(ended, include_stop_str_in_output=True))
        assert got == ids_full[:at + 1]
        assert (without, with_it) == (tok.decode(ids_full[:at]), tok.decode(ids_full[:at + 1]))
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_row_that_breaks_the_sampler_fails_alone_and_its_batch_goes_on(monkeypatch) -> None:
    """A prefill of several rows whose sampling raises for one of them runs
    again row by row: the others draw exactly what they draw alone (their KV
    length and draw counter moved on once), only the bad row fails."""
    from mstar.engine.execution import row_sampler

    bad_seed = 4242
    real = row_sampler.sample

    def faulty(logits, st, seen=None, banned=None, **kw):
        if bool((st.seeds == bad_seed).any()):
            raise RuntimeError("injected sampler fault")
        return real(logits, st, seen, banned, **kw)

    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        tok = eng.tokenizer("tiny-llama")
        prompts = [tok.encode(t) for t in ("Once upon a time", "Hello", "The quick brown fox", "1 2 3")]
        params = [SamplingParams(max_tokens=12, temperature=0.8, repetition_penalty=1.2, seed=s) for s in range(4)]
        alone = [await _run(eng, f"alone{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        monkeypatch.setattr(row_sampler, "sample", faulty)
        failed_before = eng.workers[0].stats.failed_steps
        # submitted together: their prefills run as one batch, which the bad row breaks
        crowd = await asyncio.gather(
            *[_run(eng, f"c{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))],
            _run(eng, "bad", prompts[0], SamplingParams(max_tokens=12, temperature=0.8, seed=bad_seed)))
        assert crowd[:4] == alone
        assert crowd[4] == ([], "error")
        assert eng.workers[0].stats.failed_steps > failed_before
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_stop_string_counts_the_tokens_taken_in_not_the_speculative_ones() -> None:
    """Usage counts the tokens up to the stop string's, however many the
    worker drew past it: later steps launched before the stop was seen, or
    the request's `max_tokens` reached there before the stop arrived."""
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        tok = eng.tokenizer("tiny-llama")
        ids = tok.encode("Hello")
        free, _ = await _run(eng, "free", ids, SamplingParams(max_tokens=16, temperature=0.0))
        text = tok.decode(free)
        stop = text[1:3]  # found a couple of tokens in: later steps were already launched when it is seen
        taken = next(n for n in range(1, 17) if stop in tok.decode(free[:n]))
        for max_tokens in (taken + 1, taken + 2, taken + 3, 16):
            chunks = [c async for c in eng.submit(GenerateRequest(
                f"stopped{max_tokens}", eng.model_name, {"prompt_ids": ids},
                SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=(stop,))))]
            got = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].finish_reason == "stop" and len(got) == taken
            assert chunks[-1].num_output_tokens == taken, max_tokens
    finally:
        await eng.shutdown()


async def test_an_aborted_stream_settles_with_what_the_worker_sampled() -> None:
    """`RequestStream.settled`: None while a worker still runs the request
    (within the timeout), then, once the abort has reached every worker, the
    count of tokens they sampled: at least those the client saw."""
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        stream = eng.submit(GenerateRequest("long", "tiny-llama", {"prompt_ids": [1, 2, 3]}, sp))
        chunks = aiter(stream)  # held: a dropped iterator aborts its request
        seen = 0
        while seen < 3:
            seen += len((await anext(chunks)).token_ids)
        assert await stream.settled(0.05) is None  # 2,000 tokens take longer
        eng.abort("long")
        generated = await stream.settled(30.0)
        assert generated is not None and seen <= generated < 2000
        await _drained(eng)
    finally:
        await eng.shutdown()
