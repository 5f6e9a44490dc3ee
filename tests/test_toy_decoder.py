"""Modes with signatures, run by the engine: the toy audio decoder
(`toys/audio_decoder.py`) served on the CPU with concurrent requests of
different lengths, placeholder counts and sampling, against the same modules
run unbatched in a plain loop over a dense KV cache. Tokens are identical and
hidden states within 1e-5; a request whose audio does not fit its
placeholders fails alone; a decode loop whose body has a second step (a
probe reading each step's hidden state) computes the same. Also:
`step_bindings` and packing by signature."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.graph import BindingError, Component, Emit, In, Kind, Loop, MaxTokens, Mode, Out, Step, Walk, step_bindings
from mstar.types import GenerateRequest, SamplingParams, TokenBatch
from toys.audio_decoder import DECODE, MEL, PLACEHOLDER, PREFILL, VOCAB, ToyAudioModel, mrope_positions
from toys.dense import DenseAttention, draw

TOL = 1e-5


@torch.inference_mode()
def reference(model: ToyAudioModel, ids: list[int], mel: torch.Tensor, params: SamplingParams,
              ) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """Tokens, the prompt's hidden states and each decode step's, one request
    at a time: positions and placeholders worked out here, not by the runtime."""
    assert params.seed is not None
    audio = model.encoder.encode([mel])["emb"][0]
    at = [i for i, t in enumerate(ids) if t == PLACEHOLDER]
    assert len(at) == audio.shape[0]
    attn = DenseAttention()
    n = len(ids)
    pos = mrope_positions(ids)
    out = model.decoder.prefill(TokenBatch(
        input_ids=torch.tensor(ids), positions=pos, query_start=torch.tensor([0, n]),
        logits_index=torch.tensor([n - 1]), attn=attn, embeds={"audio": (audio, torch.tensor(at, dtype=torch.long))}))
    tokens = [draw(out["logits"][0], params, params.seed, 0)]
    prompt_hidden = out["hidden"]
    following = int(pos.max()) + 1  # decode goes on from the prompt's last position, on all three axes
    hidden = []
    for k in range(1, params.max_tokens):
        out = model.decoder.decode(TokenBatch(
            input_ids=torch.tensor([tokens[-1]]), positions=torch.full((3, 1), following + k - 1),
            query_start=torch.tensor([0, 1]), logits_index=torch.tensor([0]), attn=attn))
        hidden.append(out["hidden"][0])
        tokens.append(draw(out["logits"][0], params, params.seed, k))
    return tokens, prompt_hidden, hidden


def _prompt(gen: torch.Generator, before: int, audio: int, after: int) -> list[int]:
    def text(n: int) -> list[int]:
        return (torch.randint(PLACEHOLDER + 1, VOCAB, (n,), generator=gen)).tolist()
    return text(before) + [PLACEHOLDER] * audio + text(after)


# (text before, audio rows, text after, max_tokens, temperature): greedy and seeded draws, 0 to 7 audio rows
CASES = [(3, 5, 2, 6, 0.0), (1, 2, 6, 4, 0.9), (5, 0, 4, 7, 0.7), (2, 7, 1, 5, 0.0), (4, 3, 3, 8, 1.2)]


def _requests(gen: torch.Generator) -> list[tuple[list[int], torch.Tensor, SamplingParams]]:
    out = []
    for i, (before, audio, after, max_tokens, temperature) in enumerate(CASES):
        mel = torch.randn(audio, MEL, generator=gen)
        out.append((_prompt(gen, before, audio, after), mel,
                    SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + i)))
    return out


async def _engine(model: ToyAudioModel) -> Engine:
    eng = Engine(EngineConfig(model="toy", devices=("cpu",)), model=model)
    await eng.start()
    return eng


async def _run(eng: Engine, rid: str, ids: list[int], mel: torch.Tensor, params: SamplingParams, walk: str):
    stream = eng.submit(GenerateRequest(rid, "toy", {"prompt_ids": ids, "mel": mel}, params, walk=walk))
    return [c async for c in stream]


def _split(chunks) -> tuple[list[int], list, list]:
    """Tokens, the prompt's hidden states ([T][H] lists) and the decode steps' ([H] lists)."""
    tokens = [t for c in chunks for t in c.token_ids]
    data = [c.data for c in chunks if c.data is not None]
    return tokens, [d for d in data if isinstance(d[0], list)], [d for d in data if not isinstance(d[0], list)]


async def test_concurrent_requests_match_the_unbatched_reference_and_a_bad_row_fails_alone() -> None:
    model = ToyAudioModel()
    gen = torch.Generator().manual_seed(7)
    requests = _requests(gen)
    expected = [reference(model, ids, mel, params) for ids, mel, params in requests]
    # one more request: 4 placeholders but 5 rows of audio
    bad = (_prompt(gen, 2, 4, 2), torch.randn(5, MEL, generator=gen), SamplingParams(max_tokens=5, seed=1))
    gate = threading.Event()
    model.encoder.gate = gate  # the first encode holds the worker: the others queue, and batch
    eng = await _engine(model)
    try:
        runs = [asyncio.ensure_future(_run(eng, f"r{i}", ids, mel, params, "listen"))
                for i, (ids, mel, params) in enumerate(requests[:2])]
        runs.append(asyncio.ensure_future(_run(eng, "bad", *bad, "listen")))
        runs += [asyncio.ensure_future(_run(eng, f"r{i}", ids, mel, params, "listen"))
                 for i, (ids, mel, params) in enumerate(requests) if i >= 2]
        await asyncio.sleep(0.2)
        gate.set()
        results = await asyncio.gather(*runs)
        failed = results.pop(2)
        assert failed[-1].finish_reason == "error"
        assert "'audio_emb' has 5 rows for 4 placeholder tokens" in (failed[-1].error or ""), failed[-1].error
        for chunks, (ids, _, params), (tokens, prompt_hidden, hidden) in zip(results, requests, expected):
            assert chunks[-1].finish_reason == "length", chunks[-1]
            got_tokens, got_prompt, got_hidden = _split(chunks)
            assert got_tokens == tokens
            assert len(got_prompt) == 1 and len(got_hidden) == params.max_tokens - 1
            torch.testing.assert_close(torch.tensor(got_prompt[0]), prompt_hidden, atol=TOL, rtol=0)
            torch.testing.assert_close(torch.tensor(got_hidden), torch.stack(hidden), atol=TOL, rtol=0)
        worker = eng.workers[0]
        assert worker.stats.failed_steps == 1  # the prefill batch once; its rows then ran alone
        assert worker.stats.rows > worker.stats.steps  # rows did share steps
        assert worker.walker.groups  # two outputs and a rope delta: decode ran in a group all the same
        assert eng.pages_in_use() == 0 and len(eng.store) == 0
    finally:
        await eng.shutdown()


async def test_a_decode_loop_with_a_rope_delta_runs_in_a_group() -> None:
    """`transcribe` binds the token alone: its rows join a decode group,
    which places them at their cached length plus their rope delta, on all
    three position axes."""
    model = ToyAudioModel()
    requests = _requests(torch.Generator().manual_seed(11))
    expected = [reference(model, ids, mel, params)[0] for ids, mel, params in requests]
    eng = await _engine(model)
    try:
        results = await asyncio.gather(*[_run(eng, f"t{i}", ids, mel, params, "transcribe")
                                         for i, (ids, mel, params) in enumerate(requests)])
        assert [_split(chunks)[0] for chunks in results] == expected
        (group,) = eng.workers[0].walker.groups.values()
        assert group.axes == 3 and not group.extras
    finally:
        await eng.shutdown()


class _Probe(torch.nn.Module):
    def scale(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": h * 2 + 1}


class _ProbedModel(ToyAudioModel):
    """`listen` with a loop body of two steps: decode, then a plain step over
    the hidden state decode wrote in the same round."""

    components = {**ToyAudioModel.components,
                  "probe": Component(modes=(Mode("scale", (In("h", Kind.TENSOR),), (Out("y", Kind.TENSOR),)),))}
    walks = {"probed": Walk(
        Step("enc", "encode", {"mel": "mel"}, {"emb": "audio_emb"}),
        Step("dec", "prefill", {"ids": "prompt_ids", "audio": "audio_emb", "pos": "mrope"}, {"token": "text"}),
        Loop((Step("dec", "decode", {"ids": "text"}, {"token": "text", "hidden": "hidden"}),
              Step("probe", "scale", {"h": "hidden"}, {"y": "scaled"})), until=MaxTokens()),
        Emit("text"), Emit("scaled", modality="data"),
        inputs=("prompt_ids", "mel", "mrope"))}
    default_walk = "probed"

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        return _Probe() if component == "probe" else super().build_component(component, device, dtype)


async def test_a_decode_loop_with_a_second_step_in_its_body_matches_the_reference() -> None:
    model = _ProbedModel()
    requests = _requests(torch.Generator().manual_seed(5))
    expected = [reference(model, ids, mel, params) for ids, mel, params in requests]
    eng = await _engine(model)
    try:
        results = await asyncio.gather(*[_run(eng, f"p{i}", ids, mel, params, "probed")
                                         for i, (ids, mel, params) in enumerate(requests)])
        for chunks, (tokens, _, hidden) in zip(results, expected):
            assert chunks[-1].finish_reason == "length"
            assert [t for c in chunks for t in c.token_ids] == tokens
            # the round that reaches max_tokens stops at decode: its probe never runs
            scaled = [c.data for c in chunks if c.data is not None]
            torch.testing.assert_close(torch.tensor(scaled), torch.stack(hidden[:-1]) * 2 + 1, atol=2 * TOL, rtol=0)
        assert eng.pages_in_use() == 0 and len(eng.store) == 0
    finally:
        await eng.shutdown()


async def test_preempted_rows_keep_their_hidden_states_and_positions() -> None:
    """Lazy pages in a pool far smaller than the requests need: decode rows
    with a rope delta and a hidden output are swapped out and back, and
    every token and hidden state is still the reference's."""
    from mstar.config import SchedulerConfig

    model = ToyAudioModel()
    model.context = 32
    requests = _requests(torch.Generator().manual_seed(13))
    expected = [reference(model, ids, mel, params) for ids, mel, params in requests]
    eng = Engine(EngineConfig(model="toy", devices=("cpu",), scheduler=SchedulerConfig(
        page_size=4, num_pages=12, kv_reservation="lazy")), model=model)
    await eng.start()
    try:
        results = await asyncio.gather(*[_run(eng, f"z{i}", ids, mel, params, "listen")
                                         for i, (ids, mel, params) in enumerate(requests)])
        for chunks, (tokens, prompt_hidden, hidden) in zip(results, expected):
            got_tokens, got_prompt, got_hidden = _split(chunks)
            assert got_tokens == tokens
            torch.testing.assert_close(torch.tensor(got_hidden), torch.stack(hidden), atol=TOL, rtol=0)
        assert eng.workers[0].preemption.preempted > 0
        assert eng.pages_in_use() == 0
    finally:
        await eng.shutdown()


def test_step_bindings_name_the_values_by_signature() -> None:
    by_name = Step("dec", "prefill", {"pos": "mrope", "ids": "prompt_ids"}, {"hidden": "h"})
    assert step_bindings(by_name, PREFILL) == ({"pos": "mrope", "ids": "prompt_ids"}, {"hidden": "h"})
    by_position = Step("dec", "decode", "text", ("text", "h"))
    assert step_bindings(by_position, DECODE) == ({"ids": "text"}, {"token": "text", "hidden": "h"})
    with pytest.raises(BindingError, match=r"binds inputs \['wav'\] the mode does not have"):
        step_bindings(Step("dec", "decode", {"wav": "x"}, {"token": "t"}), DECODE)
    with pytest.raises(BindingError, match="binds 3 outputs by position; the mode has"):
        step_bindings(Step("dec", "decode", "t", ("a", "b", "c")), DECODE)


def test_a_host_input_stays_on_the_host_where_the_others_move() -> None:
    """`In(host=True)`: a mode reads it in Python, so it is handed over on
    the host (stacked, or a list when ragged) while the step's device takes
    the rest (here the meta device, standing for one)."""
    from mstar.engine.execution.pack import stacked

    rows = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    assert stacked(In("p", Kind.TENSOR, host=True), rows, torch.device("meta")).device.type == "cpu"
    assert stacked(In("p", Kind.TENSOR), rows, torch.device("meta")).device.type == "meta"
    ragged = stacked(In("p", Kind.TENSOR, ragged=True, host=True), rows, torch.device("meta"))
    assert [t.device.type for t in ragged] == ["cpu", "cpu"] and ragged[1].tolist() == [3, 4]


def test_pack_kv_positions_extra_and_outputs_by_signature() -> None:
    """Rows without positions go on from their cached tokens plus their rope
    delta on every axis; TENSOR inputs land in `extra` (stacked, or a list
    when ragged or left out); a rows="all" output is cut per row."""
    from mstar.engine.execution.pack import kv_outputs, pack_kv
    from mstar.engine.worker.kv_rows import KVRow

    sig = Mode("step", (In("ids", Kind.IDS), In("pos", Kind.POSITIONS, axes=3, optional=True),
                        In("cond", Kind.TENSOR), In("notes", Kind.TENSOR, ragged=True, optional=True)),
               (Out("token", Kind.TOKEN), Out("h", Kind.HIDDEN, rows="all")), kv="append", query="ids")
    parts = [KVRow("dec", [0], kv_len=10, rope_delta=-4), KVRow("dec", [1])]
    rows = [{"ids": torch.tensor([5]), "cond": torch.ones(2), "notes": torch.zeros(3)},
            {"ids": torch.tensor([1, 2, 3]), "pos": torch.tensor([[0, 1, 1], [0, 0, 1], [0, 1, 0]]),
             "cond": torch.zeros(2)}]
    reads = [{n: f"v_{n}" for n in row} for row in rows]
    planned = []
    packed = pack_kv(rows, reads, parts, sig, 3, lambda qs, ctx, pages, causal: planned.append((qs, ctx, pages)),
                     torch.device("cpu"))
    batch = packed.batch
    assert batch.positions.tolist() == [[6, 0, 1, 1], [6, 0, 0, 1], [6, 0, 1, 0]]
    assert batch.start_positions.tolist() == [6, 0] and batch.logits_index.tolist() == [0, 3]
    assert packed.lens == [1, 3] and packed.rope_deltas == [None, -1]  # max 1 + 1 - 3 tokens
    assert torch.equal(batch.extra["cond"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert isinstance(batch.extra["notes"], list) and batch.extra["notes"][1] is None
    assert planned[0][1].tolist() == [10, 0] and planned[0][2] == [[0], [1]]
    values = kv_outputs({"h": torch.arange(8.0).view(4, 2)}, sig, {"token": "t", "h": "hs"}, packed.lens,
                        torch.tensor([7, 8]), "x.step")
    assert values["t"].tolist() == [7, 8] and [v.shape[0] for v in values["hs"]] == [1, 3]
    rows[1]["pos"] = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="'v_pos' holds positions of 2 tokens; the row brings 3"):
        pack_kv(rows, reads, parts, sig, 3, lambda *a: None, torch.device("cpu"))
