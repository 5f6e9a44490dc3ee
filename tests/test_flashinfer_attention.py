"""FlashInferAttention against TorchPagedAttention: random bf16 q/k/v and cache
contents, rows on random non-contiguous pages; decode, prefill, mixed, RoPE,
and a CUDA-graph bucket captured once and replayed with new rows.

Needs CUDA and flashinfer (the GPU machine: scripts/gpu_check.sh tests).
"""

from __future__ import annotations


import pytest
import torch
from paged_tables import random_caches, scattered_tables

if not torch.cuda.is_available():
    pytest.skip("FlashInfer attention needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

from mstar.engine.memory.attention import TorchPagedAttention  # noqa: E402
from mstar.engine.memory.flashinfer_attention import FlashInferAttention  # noqa: E402
from mstar.engine.memory.kv_cache import KVCache  # noqa: E402
from mstar.models.layers.rotary import RotaryEmbedding  # noqa: E402
from mstar.types import Rotary  # noqa: E402

DEVICE = "cuda"
PAGE = 16
HQ, HKV, D = 24, 8, 128      # Orpheus-3B's attention shape
LAYERS = 2
NUM_PAGES = 160
SCALE = 0.1                  # not 1/sqrt(D): the scale must reach the kernel
ATOL = RTOL = 2e-2
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
KV_DTYPES = [BF16, FP8]
NUM_PAGES_FP8 = 800           # the float8 tests' many rows of up to ~150 tokens


def caches(seed: int, kv_dtype: torch.dtype = BF16) -> tuple[KVCache, KVCache]:
    """Two caches with the same random contents: one for FlashInfer, one for the reference."""
    return random_caches(seed, LAYERS, HKV, D, pages(kv_dtype), PAGE, DEVICE, kv_dtype)


def pages(kv_dtype: torch.dtype) -> int:
    return NUM_PAGES_FP8 if kv_dtype == FP8 else NUM_PAGES


def close(got: torch.Tensor, want: torch.Tensor, kv_dtype: torch.dtype) -> None:
    """bf16 pages: FlashInfer against the reference at bf16's tolerance. float8
    pages: decode runs through XQA, whose Hopper kernel multiplies in float8
    (queries and softmax probabilities rounded to e4m3 too; the reference reads
    the same float8 keys and values in float32). On the H200 its outputs
    (magnitudes up to ~1) differed by at most 0.15, and by more than 0.06 in at
    most 0.1% of elements; a row read from a wrong page differs by ~1 in most
    of its elements."""
    if kv_dtype == BF16:
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)
        return
    err = (got.float() - want.float()).abs()
    assert err.max() <= 0.25 and (err > 0.06).float().mean() <= 0.01, (err.max(), (err > 0.06).float().mean())


def same_pages(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal keys or values in the pages: bf16's own rounding of a rotated key
    may differ in its last bit, which float8 rounding may carry one e4m3 step."""
    tol = 2 ** -3 if got.dtype == FP8 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def tables(gen: torch.Generator, ctx: list[int], new: list[int], spare: int = 2,
           kv_dtype: torch.dtype = BF16) -> list[list[int]]:
    return scattered_tables(gen, ctx, new, page=PAGE, num_pages=pages(kv_dtype), spare=spare)


def rotary_for(positions: torch.Tensor) -> Rotary:
    rope = RotaryEmbedding(D, 4096, theta=500000.0, device=DEVICE)
    return Rotary(cos=rope.cos, sin=rope.sin, positions=positions.to(DEVICE))


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """RoPE written out here, independent of the kernel under test: rotate-half
    in float32, rounded once."""
    cos = rotary.cos[rotary.positions].unsqueeze(1)
    sin = rotary.sin[rotary.positions].unsqueeze(1)
    xf = x.float()
    half = x.shape[-1] // 2
    return (xf * cos + torch.cat((-xf[..., half:], xf[..., :half]), dim=-1) * sin).to(x.dtype)


def new_tokens(gen: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(t, HQ, D, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(t, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(t, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    return q, k, v


def reference(ref: TorchPagedAttention, layer: int, q, k, v, rotary: Rotary | None) -> torch.Tensor:
    if rotary is not None:
        q, k = rotate(q, rotary), rotate(k, rotary)
    return ref.forward(layer, q, k, v, SCALE)


def check_step(ctx: list[int], new: list[int], seed: int, *, use_rotary: bool = False,
               tensor_cores: bool = False, causal: bool = True, kv_dtype: torch.dtype = BF16,
               split_kv: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    fi_cache, ref_cache = caches(seed, kv_dtype)
    bt = tables(gen, ctx, new, kv_dtype=kv_dtype)
    qs = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    context_lens = torch.tensor(ctx)
    attn = FlashInferAttention(fi_cache, HQ, max_pages_per_row=64, decode_tensor_cores=tensor_cores,
                               split_kv=split_kv)
    fi = attn.plan(qs, context_lens, bt, causal)
    ref = TorchPagedAttention(ref_cache, qs, context_lens, bt, causal)
    rows = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(new))
    positions = context_lens[rows] + torch.arange(int(qs[-1])) - qs[rows]
    rotary = rotary_for(positions) if use_rotary else None
    for layer in range(LAYERS):
        q, k, v = new_tokens(gen, int(qs[-1]))
        out = fi.forward(layer, q, k, v, SCALE, rotary)
        want = reference(ref, layer, q, k, v, rotary)
        assert out.shape == (int(qs[-1]), HQ, D) and out.dtype == torch.bfloat16
        close(out, want, kv_dtype)
        # both wrote the same (rotated) keys and values into the same slots
        same_pages(fi_cache.k[layer], ref_cache.k[layer])
        torch.testing.assert_close(fi_cache.v[layer].float(), ref_cache.v[layer].float(), atol=0, rtol=0)


@pytest.mark.parametrize("tensor_cores,kv_dtype,split_kv", [(False, BF16, True), (True, BF16, True), (True, FP8, True),
                                                             (True, BF16, False)])
def test_decode_batch(tensor_cores, kv_dtype, split_kv):
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 300, (16,), generator=gen).tolist()
    ctx[0], ctx[1], ctx[2] = 0, PAGE - 1, PAGE  # first token, last slot of a page, first slot of the next
    ctx[3] = 139   # a length of 140: the first fp8 benchmark crashed there
    check_step(ctx, [1] * 16, seed=2, tensor_cores=tensor_cores, kv_dtype=kv_dtype, split_kv=split_kv)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_fp8_decode_lengths(rows):
    """XQA over float8 pages: one row (its split over the sequence), a few, many; rows of every length
    around a page and a 64-token tile."""
    gen = torch.Generator().manual_seed(rows)
    ctx = (torch.randint(0, 140, (rows,), generator=gen) if rows > 3 else torch.tensor([139, 63, 64][:rows])).tolist()
    check_step(ctx, [1] * rows, seed=rows, kv_dtype=FP8)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_batch_with_and_without_context(kv_dtype):
    check_step(ctx=[0, 0, 20, 33, 0, 16], new=[37, 5, 16, 50, 128, 1], seed=3, kv_dtype=kv_dtype)


def test_non_causal_blocks_over_their_rows_context():
    # a block of new tokens attending to all of itself and its row's cache (an image's latents)
    check_step([40, 0, 17], [9, 16, 33], seed=9, causal=False)
    check_step([40, 0, 17], [9, 16, 33], seed=9, causal=False, use_rotary=True)


def test_mixed_batch():
    check_step(ctx=[0, 40, 17, 5, 100, 0], new=[20, 1, 1, 9, 1, 1], seed=4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rotary_is_applied_before_the_write(kv_dtype):
    check_step(ctx=[0, 40, 17, 5], new=[20, 1, 1, 9], seed=5, use_rotary=True, kv_dtype=kv_dtype)
    check_step(ctx=[3, 40, 170], new=[1, 1, 1], seed=6, use_rotary=True, kv_dtype=kv_dtype)


@pytest.mark.parametrize("use_rotary,tensor_cores,kv_dtype,split_kv", [
    (False, False, BF16, True), (False, True, BF16, True), (True, False, BF16, True), (True, True, BF16, True),
    (True, True, FP8, True), (True, True, BF16, False)])
def test_cuda_graph_bucket_replays_with_new_rows(tensor_cores, use_rotary, kv_dtype, split_kv):
    bucket, rows, layers = 8, 5, range(LAYERS)
    gen = torch.Generator().manual_seed(7)
    fi_cache, ref_cache = caches(7, kv_dtype)
    attn = FlashInferAttention(fi_cache, HQ, graph_batch_sizes=(4, bucket), max_pages_per_row=24,
                               decode_tensor_cores=tensor_cores, split_kv=split_kv)
    q_in = torch.zeros(bucket, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    k_in = torch.zeros(bucket, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_in = torch.zeros(bucket, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    pos_in = torch.zeros(bucket, dtype=torch.long, device=DEVICE)
    rope = rotary_for(pos_in)
    rotary = Rotary(cos=rope.cos, sin=rope.sin, positions=pos_in) if use_rotary else None

    # capture as the engine does: planned for padding rows only, warmed up on a side stream
    ctx_obj = attn.plan_graph(bucket, torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            [ctx_obj.forward(layer, q_in, k_in, v_in, SCALE, rotary) for layer in layers]
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [ctx_obj.forward(layer, q_in, k_in, v_in, SCALE, rotary) for layer in layers]
    torch.cuda.current_stream().wait_stream(stream)
    # the capture wrote k/v of zeros into whatever it was planned on: the scratch page only
    for layer in layers:
        n = pages(kv_dtype)
        torch.testing.assert_close(fi_cache.k[layer][:n].float(), ref_cache.k[layer][:n].float(),
                                   atol=0, rtol=0)

    # one row starts at position 0; a later row grows past the graph's first plan
    for ctx in ([0, 31, 47, 90, 200], [15, 5, 16, 300, 64]):
        bt = tables(gen, ctx, [1] * rows, kv_dtype=kv_dtype)
        width = max(len(r) for r in bt)
        block_table = torch.tensor([r + [0] * (width - len(r)) for r in bt])  # padded like a loop group's
        context_lens = torch.tensor(ctx)
        q, k, v = new_tokens(gen, rows)
        for t in (q_in, k_in, v_in):  # padding rows hold junk: it must not matter
            t.normal_()
        q_in[:rows], k_in[:rows], v_in[:rows] = q, k, v
        pos_in.zero_()
        pos_in[:rows] = context_lens.to(DEVICE)
        assert attn.plan_graph(bucket, context_lens, block_table) is ctx_obj
        graph.replay()
        ref = TorchPagedAttention(ref_cache, torch.arange(rows + 1), context_lens, bt)
        ref_rotary = Rotary(cos=rope.cos, sin=rope.sin, positions=context_lens.to(DEVICE)) if use_rotary else None
        for layer in layers:
            # the reference writes layer by layer after the graph wrote them all: same slots, same values
            want = reference(ref, layer, q, k, v, ref_rotary)
            close(outs[layer][:rows], want, kv_dtype)
            n = pages(kv_dtype)
            torch.testing.assert_close(fi_cache.v[layer][:n].float(), ref_cache.v[layer][:n].float(),
                                       atol=0, rtol=0)


def test_plan_graph_refuses_what_its_buffers_cannot_hold():
    fi_cache, _ = caches(8)
    attn = FlashInferAttention(fi_cache, HQ, graph_batch_sizes=(4,), max_pages_per_row=2)
    table = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="bucket"):
        attn.plan_graph(8, torch.tensor([3]), table)
    with pytest.raises(ValueError, match="do not fit"):
        attn.plan_graph(4, torch.zeros(5, dtype=torch.long), torch.zeros(5, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="pages"):
        attn.plan_graph(4, torch.tensor([2 * PAGE]), table)
