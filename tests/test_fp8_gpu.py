"""fp8 projections on CUDA (`torch._scaled_mm`, row-wise scales) against the
CPU reference of the same quantized operands, at row counts that need
padding to the GEMM's multiple of 16, and replayed from a CUDA graph. Needs
a GPU of compute capability 8.9 or later (the GPU machine:
scripts/gpu_check.sh sampler); and a served model over float8 KV pages."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 GEMMs need a CUDA device of compute capability 8.9 or later", allow_module_level=True)

from mstar.kernels.projection.gemv import weight_only_reference  # noqa: E402
from mstar.models.layers import Linear  # noqa: E402
from mstar.models.layers.fp8 import quantize_weight  # noqa: E402


def _layer(bias: bool) -> Linear:
    torch.manual_seed(1)
    lin = Linear(3072, 1024, bias=bias, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.normal_(0, 0.02)
    if bias:
        lin.bias.data.normal_(0, 0.1)
    quantize_weight(lin)
    return lin


def _reference(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    cpu = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=torch.bfloat16)
    cpu.weight = torch.nn.Parameter(lin.weight.cpu(), requires_grad=False)
    cpu.register_buffer("weight_scale", lin.weight_scale.cpu())
    if lin.bias is not None:
        cpu.bias.data.copy_(lin.bias.cpu())
    return cpu(x.cpu())


@pytest.mark.parametrize("rows", [1, 5, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_fp8_matches_the_reference(rows, bias):
    lin = _layer(bias)
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    got = lin(x).cpu().float()
    if rows == 1 and not bias:  # the one-row kernel's product is weight-only: x is not quantized
        want = weight_only_reference(x.cpu(), lin.weight.cpu(), lin.weight_scale.cpu()).float()
    else:
        want = _reference(lin, x).float()
    # the same quantized operands; only the summation order and bf16 rounding of the output differ
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_fp8_projections_replay_under_cuda_graphs():
    lin = _layer(False)
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    want = lin(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lin(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, lin(x))
    assert not torch.equal(out, want)


def _served_llama(folder, kv_cache_dtype: str) -> tuple[list[int], list[dict[int, float]], object]:
    """A tiny Llama's greedy tokens on CUDA (decode from CUDA graphs), each position's top-5 logprobs, and its
    attention backend."""
    from greedy_top5 import greedy_top5

    from mstar.config import EngineConfig, SchedulerConfig

    config = EngineConfig(model=str(folder), devices=("cuda:0",), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                          cuda_graph_batch_sizes=(1, 2, 4), scheduler=SchedulerConfig(page_size=16, num_pages=256))
    return greedy_top5(config, [5, 9, 200, 7] * 9, tokens=24,
                       inspect=lambda eng: eng.workers[0].runners["llm"].attention)


def test_a_served_model_over_float8_pages_decodes_through_xqa(tmp_path):
    """`--kv-cache-dtype fp8` on CUDA: prefill through FlashInfer over float8 pages, decode through XQA from
    CUDA graphs; the first position's top-5 stay within 0.2 of bf16 pages' (0.107 on the H200: XQA rounds
    the queries and softmax probabilities to e4m3 too, beside the keys and values)."""
    from tiny_llama import save_tiny_llama

    folder = save_tiny_llama(tmp_path, 384, hidden=256)
    full_tokens, full_top, full_attn = _served_llama(folder, "auto")
    fp8_tokens, fp8_top, fp8_attn = _served_llama(folder, "fp8")
    assert not full_attn.xqa and fp8_attn.xqa == (torch.cuda.get_device_capability()[0] in (9, 10, 12))
    assert fp8_attn.cache.k[0].dtype == torch.float8_e4m3fn
    assert len(fp8_tokens) == len(full_tokens) == 24 and len(fp8_top) == 24
    first = full_top[0]
    assert set(fp8_top[0]) == set(first)
    assert max(abs(fp8_top[0][t] - lp) for t, lp in first.items()) < 0.2
    assert fp8_tokens[0] == full_tokens[0]
