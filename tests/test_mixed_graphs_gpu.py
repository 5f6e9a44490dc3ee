"""Mixed steps as CUDA graphs (the GPU machine: scripts/gpu_check.sh tests).

The attention of a mixed bucket (decode rows through their bucket's decode
wrapper, new rows' prompt tokens through a graph-mode paged-prefill wrapper)
captured once and replayed with other rows, against TorchPagedAttention; and
the engine's outputs with mixed-step graphs equal to those without mixing,
lone short prompts (no group running) replayed in them included.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from paged_tables import random_caches, scattered_tables

if not torch.cuda.is_available():
    pytest.skip("mixed-step graphs need a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

from tiny_llama import save_tiny_llama  # noqa: E402
from mstar.config import EngineConfig, SchedulerConfig  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.execution.graphs.mixed_graphs import MixedGraphs  # noqa: E402
from mstar.engine.memory.attention import TorchPagedAttention  # noqa: E402
from mstar.engine.memory.flashinfer_attention import FlashInferAttention  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402

DEVICE = "cuda"
PAGE = 16
HQ, HKV, D = 24, 8, 128
LAYERS = 2
NUM_PAGES = 200
SCALE = 0.1
ATOL = RTOL = 2e-2


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def test_mixed_graphs_are_planned_at_the_decode_buckets_doublings() -> None:
    """Decode buckets four to a doubling; mixed buckets (three graphs each, logits of their own) at the
    doublings and the largest, as the engine builds its backend."""
    from mstar.engine.execution.backends import attention_backend

    fi_cache, _ = random_caches(3, LAYERS, HKV, D, NUM_PAGES, PAGE, DEVICE)
    attn = FlashInferAttention(fi_cache, HQ, graph_batch_sizes=(4, 6, 8), max_pages_per_row=24, mixed_tokens=(32,),
                               mixed_rows=4, mixed_buckets=(4, 8))
    assert attn.graph_batch_sizes == (4, 6, 8) and attn.mixed_graph_buckets == [(4, 32), (8, 32)]
    config = EngineConfig(cuda_graph_batch_sizes=(1, 2, 4, 8, 12, 16, 20))
    built = attention_backend(fi_cache, HQ, 24, config, mixed=True)
    assert built.graph_batch_sizes == (1, 2, 4, 8, 12, 16, 20)
    assert sorted({b for b, _ in built.mixed_graph_buckets}) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_mixed_bucket_replays_any_split_of_its_tokens(kv_dtype: torch.dtype) -> None:
    """Over float8 pages the decode rows go through XQA, the new rows through FlashInfer's prefill."""
    b, t, slots = 8, 32, 4
    gen = torch.Generator().manual_seed(3)
    fi_cache, ref_cache = random_caches(3, LAYERS, HKV, D, NUM_PAGES, PAGE, DEVICE, kv_dtype)
    attn = FlashInferAttention(fi_cache, HQ, graph_batch_sizes=(b,), max_pages_per_row=24, mixed_tokens=(t,),
                               mixed_rows=slots)
    assert attn.mixed_graph_buckets == [(b, t)]
    q_in = torch.zeros(b + t, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    k_in = torch.zeros(b + t, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_in = torch.zeros(b + t, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    empty, table = torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)
    ctx_obj = attn.plan_mixed_graph(b, t, empty, table, torch.zeros(1, dtype=torch.long), empty, table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            [ctx_obj.forward(layer, q_in, k_in, v_in, SCALE) for layer in range(LAYERS)]
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [ctx_obj.forward(layer, q_in, k_in, v_in, SCALE) for layer in range(LAYERS)]
    torch.cuda.current_stream().wait_stream(stream)

    # (decode rows' contexts, new rows' (context, chunk)): a full and a sparse split of the bucket
    for dec_ctx, new in (([40, 7, 100, 16, 0, 33, 64, 5], [(0, 9), (48, 1), (16, 12), (3, 5)]),
                         ([250], [(130, 20)]), ([31, 2], [])):
        n, m = len(dec_ctx), len(new)
        new_ctx, chunks = [c for c, _ in new], [k for _, k in new]
        bt = scattered_tables(gen, dec_ctx + new_ctx, [1] * n + chunks, page=PAGE, num_pages=NUM_PAGES, spare=1)
        k_new = sum(chunks)
        q, k, v = (torch.randn(n + k_new, h, D, generator=gen).to(DEVICE, torch.bfloat16) for h in (HQ, HKV, HKV))
        for buf in (q_in, k_in, v_in):  # padding tokens hold junk: it must not matter
            buf.normal_()
        for buf, src in ((q_in, q), (k_in, k), (v_in, v)):
            buf[:n], buf[b:b + k_new] = src[:n], src[n:]
        new_qs = torch.tensor([0, *torch.tensor(chunks, dtype=torch.long).cumsum(0).tolist()])
        got = attn.plan_mixed_graph(b, t, torch.tensor(dec_ctx), _padded(bt[:n]), new_qs,
                                    torch.tensor(new_ctx, dtype=torch.long),
                                    _padded(bt[n:]) if m else torch.zeros(0, 1, dtype=torch.long))
        assert got is ctx_obj
        graph.replay()
        qs = torch.tensor([*range(n + 1), *(n + new_qs[1:]).tolist()])
        ref = TorchPagedAttention(ref_cache, qs, torch.tensor(dec_ctx + new_ctx), bt)
        for layer in range(LAYERS):
            want = ref.forward(layer, q, k, v, SCALE)
            real = torch.cat([outs[layer][:n], outs[layer][b:b + k_new]])
            if kv_dtype == torch.bfloat16:
                torch.testing.assert_close(real.float(), want.float(), atol=ATOL, rtol=RTOL)
            else:  # XQA multiplies in float8: the bounds of test_flashinfer_attention.close
                err = (real.float() - want.float()).abs()
                assert err.max() <= 0.25 and (err > 0.06).float().mean() <= 0.01, err.max()
            torch.testing.assert_close(fi_cache.v[layer][:NUM_PAGES].float(), ref_cache.v[layer][:NUM_PAGES].float(),
                                       atol=0, rtol=0)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_mixed_gpu"), 384, hidden=256)  # FlashInfer's head size


async def _outputs(folder: Path, mixed: bool, alone: bool = False) -> tuple[list[list[int]], int]:
    """Each request's tokens, and how many mixed steps replayed a graph. With
    `alone`, one request at a time: every prompt arrives when no group runs,
    and the replays counted are of such lone prompts."""
    replays = 0
    hooked = "run_prompts" if alone else "run"
    run = getattr(MixedGraphs, hooked)

    def counting(self, m):
        nonlocal replays
        out = run(self, m)
        replays += out is not None
        return out

    eng = Engine(EngineConfig(model=str(folder), devices=("cuda:0",), dtype="bfloat16",
                              cuda_graph_batch_sizes=(1, 2, 4, 8, 16), scheduler=SchedulerConfig(
                                  page_size=16, num_pages=512, mixed_steps=mixed)))
    await eng.start()
    setattr(MixedGraphs, hooked, counting)
    try:
        rng = random.Random(5)
        shared = [1] + [rng.randrange(3, 384) for _ in range(40)]
        prompts = [shared + [rng.randrange(3, 384) for _ in range(n)] for n in (2, 20, 70, 300)]
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=0.9, seed=4, ignore_eos=True)]

        async def one(rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
            toks = []
            async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
                assert chunk.error is None, chunk.error
                toks.extend(chunk.token_ids)
            return toks
        if alone:
            return [await one(f"r{i}{j}", prompt, sp) for i, prompt in enumerate(prompts)
                    for j, sp in enumerate(params)], replays
        running = asyncio.ensure_future(one("running", [1, 5, 9], SamplingParams(max_tokens=300, temperature=0.0,
                                                                                 ignore_eos=True)))
        tasks = []
        for i, prompt in enumerate(prompts):
            for j, sp in enumerate(params):
                await asyncio.sleep(0.01)
                tasks.append(asyncio.ensure_future(one(f"r{i}{j}", prompt, sp)))
        return [await running, *await asyncio.gather(*tasks)], replays
    finally:
        setattr(MixedGraphs, hooked, run)
        await eng.shutdown()


async def test_engine_outputs_with_mixed_graphs_equal_unmixed(hf_folder: Path) -> None:
    alone, none = await _outputs(hf_folder, False)
    mixed, replays = await _outputs(hf_folder, True)
    assert none == 0 and replays > 0
    assert mixed == alone


async def test_lone_prompts_replay_a_mixed_graph_with_the_eager_tokens(hf_folder: Path) -> None:
    """A prompt arriving when no group runs replays a mixed bucket whose group
    rows are all padding (from a few tokens after a cached prefix to 300: the
    512-token bucket). Tokens as without mixed steps."""
    eager, none = await _outputs(hf_folder, False, alone=True)
    replayed, replays = await _outputs(hf_folder, True, alone=True)
    assert none == 0 and replays > 0
    assert replayed == eager
