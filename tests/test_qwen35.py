"""Qwen3.5's hybrid text decoder (gated delta nets beside gated attention,
per-row recurrent state) on the CPU against transformers' own
`Qwen3_5ForCausalLM` with the same weights: greedy tokens equal for
concurrent prompts batched in one decode group, with as many state slots as
rows or fewer (rows wait for a slot), and under preemption (a swapped row's
state leaves its slot and comes back); slots and pages all free after.
The official `openai` client's completions and chat against `qwen3.5-tiny`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import torch
from greedy_top5 import greedy_top5
from http_support import openai_client
from tiny_llama import generated
from tiny_qwen35 import save_tiny_qwen35

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.models.qwen3_5.config import Qwen35Config
from mstar.types import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 33, 7], [1, *range(40, 140)], [1, 2], [1, *range(300, 330)], [1, 17, 17, 17]]
NEW = 12


def _checkpoint(folder: Path, experts: int = 0, prompts: list[list[int]] = PROMPTS,
                edit: Callable[[dict], None] | None = None) -> tuple[Path, list[list[int]]]:
    """The folder (its config.json changed by `edit`), and transformers' greedy continuation of each prompt."""
    save_tiny_qwen35(folder, experts=experts)
    if edit is not None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    cls = transformers.Qwen3_5MoeForCausalLM if experts else transformers.Qwen3_5ForCausalLM
    hf = cls.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None   # as the engine's ignore_eos: EOS is a token like any other
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False)
            want.append(out[0, len(p):].tolist())
    return folder, want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    return _checkpoint(tmp_path_factory.mktemp("qwen35"))


def test_the_moe_decoder_matches_transformers(tmp_path: Path) -> None:
    """`qwen3_5_moe`: experts stored one by one stack into the MoE layer's
    weights; routed experts with renormalised weights beside a gated shared
    expert. Greedy tokens of concurrent prompts equal transformers'."""
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]   # the dense tests take the long one through its chunks
    folder, want = _checkpoint(tmp_path, experts=4, prompts=prompts)
    assert _served(folder, prompts) == want


def test_a_folder_saved_without_mrope_section_loads_as_transformers_reads_it(tmp_path: Path) -> None:
    """transformers saves a small config without `mrope_section` and reads it as the 9B's (11, 11, 10), cut to
    the rotary frequencies (4 here); so does mstar, and the greedy tokens are transformers'."""
    def drop(config: dict) -> None:
        del config["rope_parameters"]["mrope_section"]
    prompts = [PROMPTS[0], PROMPTS[3]]
    folder, want = _checkpoint(tmp_path, prompts=prompts, edit=drop)
    assert _served(folder, prompts) == want
    from mstar.models.layers.mrope import mrope_axes
    from mstar.models.registry import load_model
    assert load_model(str(folder)).config.mrope_section == (11, 11, 10)
    # transformers' recomposition: T everywhere, then H at 1, 4, ... below 3·11 and W at 2, 5, ... below 3·10
    assert mrope_axes((11, 11, 10), 4).tolist() == [0, 1, 2, 0]
    assert mrope_axes((11, 11, 10), 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_the_config_reads_the_layer_pattern_and_the_state_shapes(checkpoint: tuple[Path, list]) -> None:
    from mstar.models.registry import load_model
    model = load_model(str(checkpoint[0]))
    cfg = model.config
    assert isinstance(cfg, Qwen35Config)
    assert cfg.attention_layers == (1, 3) and cfg.delta_layers == (0, 2) and cfg.rotary_dim == 8
    assert model.kv_spec("llm").num_layers == 2
    spec = dict((name, shape) for name, shape, _ in model.state_spec("llm").tensors)
    assert spec == {"conv": (2, 2 * 2 * 16 + 4 * 16, 3), "rec": (2, 4, 16, 16)}


def _served(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """mstar's greedy continuations of `prompts` from the folder, concurrent."""
    async def run() -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(folder), scheduler=SchedulerConfig(page_size=4)))
        await eng.start()
        try:
            return await _all(eng, prompts)
        finally:
            await eng.shutdown()
    return asyncio.run(run())


async def _all(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return list(await asyncio.gather(*(generated(eng, f"r{i}", p, greedy) for i, p in enumerate(prompts))))


async def _free(eng: Engine, slots: int) -> None:
    pool = eng.workers[0].scheduler.slots["llm"]
    for _ in range(1500):
        if pool.num_free == slots and eng.pages_in_use() == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{slots - pool.num_free} state slots, {eng.pages_in_use()} pages still held")


@pytest.mark.parametrize("slots", [None, 2])
async def test_greedy_tokens_equal_transformers(checkpoint: tuple[Path, list], slots: int | None) -> None:
    folder, want = checkpoint
    eng = Engine(EngineConfig(model=str(folder), scheduler=SchedulerConfig(page_size=4, state_slots=slots)))
    await eng.start()
    steps: list[int] = []
    eng.add_report_hook(lambda r: steps.append(r.rows) if r.mode == "decode" else None)
    try:
        assert await _all(eng, PROMPTS) == want
        assert max(steps) == (slots or len(PROMPTS))   # decode rows batched, never more than the slots
        await _free(eng, slots or eng.config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()


async def test_preempted_rows_carry_their_state_out_and_back(checkpoint: tuple[Path, list]) -> None:
    """A KV pool smaller than the prompts need together (`--kv-reservation
    lazy`): rows are swapped out mid-answer, and their recurrent state with
    their pages."""
    folder, want = checkpoint
    eng = Engine(EngineConfig(model=str(folder), max_model_len=160, scheduler=SchedulerConfig(
        page_size=4, num_pages=40, kv_reservation="lazy")))
    await eng.start()
    try:
        assert await _all(eng, PROMPTS) == want
        assert eng.workers[0].preemption.preempted > 0
        await _free(eng, eng.config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("mixed", [True, False])
async def test_chunked_and_mixed_prefills_carry_the_state_on(checkpoint: tuple[Path, list], mixed: bool) -> None:
    """Prompts arriving while others decode, in chunks of at most 16 tokens a
    step: each chunk goes on from the state the one before left, riding in
    the decode group's steps (mixed) or in steps of its own."""
    folder, want = checkpoint
    eng = Engine(EngineConfig(model=str(folder), scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=16, mixed_steps=mixed)))
    await eng.start()
    chunks: list[int] = []
    decoding = asyncio.Event()  # reports reach hooks on the event loop
    eng.add_report_hook(lambda r: chunks.append(r.rows) if r.mode == "prefill"
                        else decoding.set() if r.mode == "decode" else None)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    try:
        # a long answer decodes all along, so every prompt arrives beside running rows however slow the box
        hold = asyncio.ensure_future(generated(eng, "hold", PROMPTS[0], dataclasses.replace(greedy, max_tokens=300)))
        await asyncio.wait_for(decoding.wait(), 60)
        tasks = []
        for i, prompt in enumerate(PROMPTS):
            tasks.append(asyncio.ensure_future(generated(eng, f"r{i}", prompt, greedy)))
            await asyncio.sleep(0.05)
        assert list(await asyncio.gather(*tasks)) == want
        assert not hold.done(), "the long answer ended before the prompts had all run beside it"
        eng.abort("hold")
        await hold
        stats = eng.workers[0].stats
        assert (stats.mixed_rows > 0) == mixed
        assert sum(chunks) + stats.mixed_rows >= 12   # unchunked, the 5 prompts would take 5 rows; chunked 12
        await _free(eng, eng.config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(EngineConfig(model="qwen3.5-tiny", scheduler=SchedulerConfig(page_size=4))) as api:
        yield api


@pytest.mark.asyncio(loop_scope="module")
async def test_the_openai_client_completes_and_chats(client: openai.AsyncOpenAI) -> None:
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    done = await client.completions.create(model="qwen3.5-tiny", prompt="Once upon", max_tokens=6, **greedy)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    stream = await client.completions.create(model="qwen3.5-tiny", prompt="Once upon", max_tokens=6, stream=True,
                                             **greedy)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == done.choices[0].text
    chat = await client.chat.completions.create(model="qwen3.5-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5


@pytest.mark.parametrize("n", [1, 16, 63, 64, 150])
def test_the_chunked_delta_rule_equals_the_token_by_token_one(n: int) -> None:
    """`chunked_delta_rule` (long prompts: one triangular solve a chunk)
    against the recurrence it stands for, from a state that is not empty,
    with decays strong and weak and write strengths from 0 to 1."""
    from mstar.kernels import delta_rule
    gen = torch.Generator().manual_seed(n)
    h, dk, dv = 3, 8, 5
    q = delta_rule._l2norm(torch.randn(n, h, dk, generator=gen)) * dk ** -0.5
    k = delta_rule._l2norm(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    g = -torch.rand(n, h, generator=gen) * 3
    beta = torch.rand(n, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    out, s = delta_rule.chunked_delta_rule(q, k, v, g, beta, s0, chunk=16)
    want, state = torch.empty_like(v), s0[None]
    for t in range(n):
        o, state = delta_rule._step(state, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        want[t] = o[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, state[0], atol=1e-5, rtol=1e-5)


async def test_metrics_and_health_count_the_state_slots(checkpoint: tuple[Path, list]) -> None:
    eng = Engine(EngineConfig(model=str(checkpoint[0]), scheduler=SchedulerConfig(page_size=4, state_slots=3)))
    await eng.start()
    try:
        labels = '{device="cpu",component="llm"}'
        stream = eng.submit(GenerateRequest("long", eng.model_name, {"prompt_ids": [1, 2, 3]},
                                            SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
        async for chunk in stream:
            if chunk.token_ids:
                break
        text = eng.metrics_text()
        assert f"mstar_state_slots_in_use{labels} 1" in text and f"mstar_state_slots_total{labels} 3" in text
        assert eng.health()["devices"][0]["state_slots"] == {"llm": {"in_use": 1, "total": 3}}
        eng.abort("long")
        async for _ in stream:
            pass
        await _free(eng, 3)
        assert f"mstar_state_slots_in_use{labels} 0" in eng.metrics_text()
    finally:
        await eng.shutdown()


async def test_a_failed_mixed_step_fails_its_rows_with_state(checkpoint: tuple[Path, list],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step that raises may have updated the running rows' states in
    place before it did: those rows fail with the new ones instead of
    stepping again (a model without state steps them again alone)."""
    from mstar.engine.execution import group_steps as group_steps_module

    def broken(*args, **kwargs):
        raise ValueError("a new row's table is broken")
    monkeypatch.setattr(group_steps_module, "mixed_inputs", broken)
    eng = Engine(EngineConfig(model=str(checkpoint[0]), scheduler=SchedulerConfig(page_size=4)))
    await eng.start()
    try:
        greedy = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        async def run(rid: str, prompt: list[int], sp: SamplingParams) -> list:
            return [c async for c in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp))]
        running = aiter(eng.submit(GenerateRequest("running", eng.model_name, {"prompt_ids": [1, 5, 9]}, greedy)))
        rest = [await anext(running)]  # its first token: it decodes in its group, with 999 steps to go
        new = await run("new", [1, 7, 8, 9], SamplingParams(max_tokens=4))
        rest += [c async for c in running]
        assert "a new row's table is broken" in (new[-1].error or "")
        assert "a new row's table is broken" in (rest[-1].error or "") and len(rest) < 1000
        await _free(eng, eng.config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()


def test_fp8_weights_serve_a_delta_net_model(tmp_path: Path) -> None:
    """`--quantization fp8` turns the delta nets' merged input projection too (208 x 64 here): the model
    serves, its first greedy choice the full-precision one's, and the layers' warm-up (run before serving
    on CUDA) makes its inputs in the activations' dtype, not float8."""
    folder = save_tiny_qwen35(tmp_path / "q", value_heads=8)
    full_tokens, full_top, _ = greedy_top5(EngineConfig(model=str(folder)), [1, 5, 9, 33, 7], tokens=4)

    def turned(eng: Engine) -> int:
        module = eng.workers[0].runners["llm"].module
        delta_nets = [layer.linear_attn for layer in module.layers if hasattr(layer, "linear_attn")]
        for net in delta_nets:
            net.warm()   # what compile_kernels runs on CUDA, here on the quantized layer
        return sum(net.in_proj.weight.dtype == torch.float8_e4m3fn for net in delta_nets)
    fp8_tokens, fp8_top, in_projs = greedy_top5(EngineConfig(model=str(folder), quantization="fp8"),
                                                [1, 5, 9, 33, 7], tokens=4, inspect=turned)
    assert in_projs == 2   # both delta-net layers' merged projections are float8
    assert fp8_tokens[0] == full_tokens[0] and len(fp8_tokens) == 4
    # the tiny checkpoint's head is scaled up eightfold (wide logits), which widens fp8's logprob error too
    assert max(abs(fp8_top[0][t] - lp) for t, lp in full_top[0].items() if t in fp8_top[0]) < 0.4


def test_every_qwen35_shape_is_served_by_name() -> None:
    """The registry names them itself (importing `builtins` would bring torch into the command line's
    start); they are `builtins.BY_NAME`'s, all of them."""
    from mstar.models.qwen3_5.builtins import BY_NAME
    from mstar.models.registry import BUILTINS

    assert {name for name in BUILTINS if name.startswith("qwen3.5-")} == set(BY_NAME)
