"""The Triton kernels of mstar.kernels on CUDA: against their torch
references at model-sized shapes, picked by the public ops for CUDA tensors,
and unchanged under CUDA-graph capture and replay. Runs on the GPU machine."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (MOE_SHAPES, check_quantize_rows, check_fused_add_rms_norm, check_route_top_k,
                          check_head_norm_rope, check_qkv_norm_rope_store, check_fused_moe, check_moe_align,
                          check_rms_norm, check_rope_and_store, check_silu_and_mul, check_snake, check_snake_beta,
                          check_snake_beta_held, check_snake_dwconv, check_snake_unit, check_codec_noise, moe_inputs,
                          moe_routing, same_on_replay)
from sampling_kernel_cases import (check_draw_tokens, check_wide_descent, check_wide_draw, check_exponential_noise,
                                   check_window_draw,
                                   check_repetition_penalty)

from mstar.kernels import activation, fused_add_rms_norm, moe, norm, rms_norm, rope_and_store, rope_kv, silu_and_mul
from mstar.kernels.backend import HAVE_TRITON

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON),
                                reason="needs CUDA and triton (runs on the GPU machine)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (7, 96), (33, 3072), (512, 8192)])
@pytest.mark.parametrize("check", [check_rms_norm, check_fused_add_rms_norm], ids=["plain", "fused_add"])
@pytest.mark.parametrize("centered", [False, True], ids=["weight", "centered"])
def test_rms_norm(check, t, h, dtype, centered):
    check(t, h, dtype, "cuda", interpreted=False, centered=centered)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 64), (7, 1500), (33, 8192), (256, 14336)])
def test_silu_and_mul(t, inter, dtype):
    check_silu_and_mul(t, inter, dtype, "cuda", interpreted=False)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 64), (7, 8, 1, 128), (33, 24, 8, 128), (300, 64, 8, 128),
                                        (5, 12, 4, 80)])
def test_rope_and_store(t, hq, hkv, d, dtype, cache_dtype):
    check_rope_and_store(t, hq, hkv, d, dtype, cache_dtype, "cuda", interpreted=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t", [(1, 3, 5), (16, 64, 8192), (4, 1024, 16)])
def test_snake(b, c, t, dtype):
    check_snake(b, c, t, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t,dilation", [(1, 2, 5, 1), (16, 64, 8192, 9), (8, 512, 128, 3)])
def test_snake_dwconv(b, c, t, dilation, dtype):
    check_snake_dwconv(b, c, t, dilation, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t,dilation", [(1, 2, 5, 1), (16, 64, 8192, 9), (8, 512, 128, 3), (64, 1024, 37, 1)])
def test_snake_unit(b, c, t, dilation, dtype):
    check_snake_unit(b, c, t, dilation, dtype, "cuda")


@pytest.mark.parametrize("rows,length,start,dtype", [(2, 7, 0, torch.float32), (64, 2132, 2006, torch.float16)])
def test_codec_noise(rows, length, start, dtype):
    check_codec_noise(rows, length, start, dtype, "cuda")


@pytest.mark.parametrize("rows,vocab,dtype", [(3, 50, torch.float32), (64, 156_940, torch.bfloat16)])
def test_repetition_penalty(rows, vocab, dtype):
    check_repetition_penalty(rows, vocab, dtype, "cuda")


@pytest.mark.parametrize("rows,vocab", [(1, 5), (256, 156_940)])
def test_exponential_noise(rows, vocab):
    check_exponential_noise(rows, vocab, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 16, 64, 512, 4096])
@pytest.mark.parametrize("part", sorted(MOE_SHAPES))
def test_fused_moe(part, t, dtype):
    """Random (uniform) routing at the real shapes: decode steps leave most
    experts without a row, 4096 tokens give each about 256."""
    check_fused_moe(t, *MOE_SHAPES[part], dtype, "cuda", interpreted=False, skewed=False)


@pytest.mark.parametrize("t", [33, 700])
def test_fused_moe_skewed(t):
    """Every token on expert 0 (44 blocks at 700 tokens) and none on the last."""
    check_fused_moe(t, *MOE_SHAPES["thinker"], torch.bfloat16, "cuda", interpreted=False, skewed=True)


@pytest.mark.parametrize("t,k,block_m", [(1, 8, 16), (64, 8, 16), (512, 6, 32), (4096, 8, 64)])
@pytest.mark.parametrize("skewed", [True, False], ids=["skewed", "uniform"])
def test_moe_align(t, k, block_m, skewed):
    check_moe_align(t, 128, k, block_m, "cuda", skewed)


def test_fused_moe_waits_on_nothing():
    """No host sync (no .item(), .tolist(), nonzero): what CUDA graphs need."""
    routed = moe_inputs(64, *MOE_SHAPES["talker"], torch.bfloat16, "cuda", skewed=False)
    moe.fused_moe_triton(*routed)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_moe_triton(*routed)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fused_moe_replays_under_cuda_graphs():
    """Captured with one routing, replayed with another: the grid and every
    buffer are sized from shapes alone."""
    h, inter, e, k = MOE_SHAPES["talker"]
    _, gate_up, down, _, _ = moe_inputs(1, h, inter, e, k, torch.bfloat16, "cuda", skewed=False)
    gen = torch.Generator(device="cuda").manual_seed(5)

    def make():
        experts, weights = moe_routing(gen, 8, e, k, skewed=False)
        return [torch.randn(8, h, generator=gen, device="cuda", dtype=torch.bfloat16), experts,
                weights.to(torch.bfloat16)]

    same_on_replay(make, lambda x, experts, weights: moe.fused_moe(x, gate_up, down, experts, weights))


def test_cuda_tensors_take_triton():
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 256, generator=gen).cuda().bfloat16() for _ in range(2))
    w = torch.randn(256, generator=gen).cuda().bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), norm.rms_norm_triton(x, w, 1e-6))
    for a, b in zip(fused_add_rms_norm(x, r, w, 1e-6), norm.fused_add_rms_norm_triton(x, r, w, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(x), activation.silu_and_mul_triton(x))
    q, k = x.view(5, 4, 64), r.view(5, 4, 64)[:, :2]
    cos, sin = torch.randn(8, 64, generator=gen).cuda(), torch.randn(8, 64, generator=gen).cuda()
    pos, slots = torch.tensor([5, 0, 2, 7, 7]).cuda(), torch.tensor([9, 1, 4, 0, 3]).cuda()
    caches = [torch.zeros(3, 4, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    got = rope_and_store(q, k, k, cos, sin, pos, caches[0], caches[1], slots)
    ref = rope_kv.rope_and_store_triton(q, k, k, cos, sin, pos, caches[2], caches[3], slots)
    assert torch.equal(got, ref) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    routed = moe_inputs(5, 256, 64, 8, 2, torch.bfloat16, "cuda", skewed=False)
    assert torch.equal(moe.fused_moe(*routed), moe.fused_moe_triton(*routed))


def _maker(*shapes: tuple[int, ...], dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(7)  # advances: every call draws new values
    return lambda: [torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes]


def test_norms_replay_under_cuda_graphs():
    same_on_replay(_maker((8, 2048), (2048,)), lambda x, w: rms_norm(x, w, 1e-5))
    same_on_replay(_maker((8, 2048), (8, 2048), (2048,)), lambda x, r, w: fused_add_rms_norm(x, r, w, 1e-5))


def test_silu_and_mul_replays_under_cuda_graphs():
    same_on_replay(_maker((8, 2 * 3000)), silu_and_mul)


def test_rope_and_store_replays_under_cuda_graphs():
    t, hq, hkv, d, pages, page = 8, 8, 2, 128, 6, 16
    floats = _maker((t, hq, d), (t, hkv, d), (t, hkv, d), (pages, page, hkv, d), (pages, page, hkv, d))
    gen = torch.Generator(device="cuda").manual_seed(3)
    cos, sin = torch.randn(64, d, device="cuda"), torch.randn(64, d, device="cuda")

    def make():
        q, k, v, k_cache, v_cache = floats()
        positions = torch.randint(0, 64, (t,), generator=gen, device="cuda")
        slots = torch.randperm(pages * page, generator=gen, device="cuda")[:t]
        return [q, k, v, positions, k_cache, v_cache, slots]

    def op(q, k, v, positions, k_cache, v_cache, slots):
        return rope_and_store(q, k, v, cos, sin, positions, k_cache, v_cache, slots), k_cache, v_cache

    same_on_replay(make, op)


def test_qkv_norm_rope_store_replays_under_cuda_graphs():
    from mstar.kernels.qkv_store import KVDest, qkv_norm_rope_store

    t, hq, hkv, d, slots_n = 8, 8, 2, 128, 96
    floats = _maker((t, (hq + 2 * hkv) * d), (d,), (d,), (t, d), (t, d), (slots_n, hkv, d), (slots_n, hkv, d))
    gen = torch.Generator(device="cuda").manual_seed(5)

    def make():
        return [*floats(), torch.randperm(slots_n, generator=gen, device="cuda")[:t]]

    def op(qkv, qw, kw, cos, sin, k_cache, v_cache, slots):
        q = qkv_norm_rope_store(qkv, hq, hkv, qw, kw, cos, sin, 1e-6, KVDest(k_cache, v_cache, slots=slots))
        return q, k_cache, v_cache

    same_on_replay(make, op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,kv_heads,d", [(1, 16, 2, 128), (8, 32, 4, 128), (300, 16, 16, 64)])
def test_qkv_norm_rope_store(t, heads, kv_heads, d, dtype):
    check_qkv_norm_rope_store(t, heads, kv_heads, d, dtype, dtype, "cuda", interpreted=False)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_qkv_norm_rope_store_into_a_cache_of_another_dtype(cache_dtype):
    check_qkv_norm_rope_store(7, 8, 2, 128, torch.bfloat16, cache_dtype, "cuda", interpreted=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,d", [(1, 16, 128), (7, 4, 64), (300, 32, 128)])
def test_head_norm_rope(t, heads, d, dtype):
    check_head_norm_rope(t, heads, d, dtype, "cuda", interpreted=False)


@pytest.mark.parametrize("filtered", [True, False])
@pytest.mark.parametrize("rows,vocab,dtype", [(13, 40, torch.float32), (64, 2048, torch.bfloat16),
                                              (32, 3072, torch.bfloat16), (5, 4096, torch.float32)])
def test_draw_tokens(rows, vocab, dtype, filtered):
    check_draw_tokens(rows, vocab, filtered, dtype, "cuda")


@pytest.mark.parametrize("filtered", [True, False])
@pytest.mark.parametrize("rows,vocab,dtype,block", [(13, 40, torch.float32, 16), (64, 156940, torch.bfloat16, 2048),
                                                    (7, 151936, torch.float32, 1024)])
def test_wide_draw(rows, vocab, dtype, block, filtered):
    check_wide_draw(rows, vocab, filtered, dtype, "cuda", block)


@pytest.mark.parametrize("rows,how", [(64, "wide"), (5, "reference")])
def test_window_draw(rows, how):
    """Orpheus's own ids' window of its vocabulary (`--audio-logits-only`), a strided view of bf16 rows."""
    from mstar.kernels.sampling import draw
    kernel = {"wide": draw.draw_tokens_wide, "reference": draw.draw_tokens_reference}[how]
    check_window_draw(rows, 156940, 128256, 156940, torch.bfloat16, "cuda", kernel)


@pytest.mark.parametrize("rows,vocab,dtype,block", [(11, 70, torch.float32, 16), (64, 156940, torch.bfloat16, 2048)])
def test_wide_descent(rows, vocab, dtype, block):
    check_wide_descent(rows, vocab, dtype, "cuda", block)


def test_the_wide_draw_is_compiled_before_serving():
    """After `compile_wide_draw` over a decode graph's logits, the sampler's
    draws of more rows (bfloat16 logits, and float32 ones as a penalty
    leaves them; with and without top-k) compile nothing more."""
    from mstar.kernels.sampling import draw, wide_descent, wide_draw
    logits = torch.randn(128, 156940, device="cuda").to(torch.bfloat16)
    draw.compile_wide_draw(logits)
    kernels = [wide_draw._max_kernel, wide_draw._total_kernel, wide_draw._above_kernel, wide_draw._narrow_kernel,
               wide_draw._tie_kernel, wide_draw._race_kernel, wide_descent._descend_kernel,
               wide_descent._settle_kernel]
    device = torch.cuda.current_device()

    def compiled() -> list[int]:
        return [len(kernel.device_caches[device][0]) for kernel in kernels]
    before = compiled()
    assert all(before)
    rows = 100
    params = [torch.full((rows,), 0.6), torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.8),
              torch.zeros(rows), torch.arange(rows) * 11, torch.arange(rows)]
    params = [p.cuda() for p in params]
    for x in (logits[:rows], logits[:rows].float()):
        draw.draw_tokens(x, *params, 0, True, top_k_active=False, top_p_active=True)
        params[1] = torch.full((rows,), 40, device="cuda")
        draw.draw_tokens(x, *params, 3, True, top_k_active=True, top_p_active=True)
    # an eager draw's parameters as `SamplingTensors.build` stacks them: 99 rows leave every column but the
    # first off 16-byte alignment
    rows = 99
    floats = torch.tensor([[0.6] * rows, [0.8] * rows, [0.0] * rows], device="cuda")
    ints = torch.stack([torch.full((rows,), 40), torch.arange(rows) * 11, torch.arange(rows)]).cuda()
    for top_k in (False, True):
        draw.draw_tokens(logits[:rows], floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], 0, True,
                         top_k_active=top_k, top_p_active=True)
    torch.cuda.synchronize()
    assert compiled() == before


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k,renormalize", [(1, 128, 8, True), (300, 128, 8, True), (7, 60, 4, False)])
def test_route_top_k(tokens, experts, k, renormalize, dtype):
    check_route_top_k(tokens, experts, k, renormalize, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,c,t", [(1, 3, 5), (2, 16, 1500)])
def test_snake_beta(b, c, t, dtype):
    check_snake_beta(b, c, t, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,c,t,reach,masked", [(1, 3, 5, 6, True), (32, 96, 1920, 54, True), (32, 768, 32, 2, False),
                                                 (4, 16, 3, 0, True)])
def test_snake_beta_held(b, c, t, reach, masked, dtype):
    check_snake_beta_held(b, c, t, reach, masked, dtype, "cuda")


def test_a_burst_of_a_new_row_count_compiles_no_sampling_kernel():
    """The sampler's per-row columns (top-p, min-p, seeds, counters) are rows
    of one stacked tensor, so their addresses' alignment follows the row
    count; a kernel compiled per alignment stalled the first burst of a new
    size for seconds (the filtered race takes about 4 s to compile)."""
    from triton import knobs

    from mstar.engine.execution.sampler import SamplingTensors, sample
    from mstar.types import SamplingParams

    def step(rows: int) -> None:
        params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=50, min_p=0.01)] * rows
        st = SamplingTensors.build(params, list(range(rows)), [0] * rows, "cuda")
        sample(torch.randn(rows, 2048, device="cuda"), st)

    step(1)  # compiles what a first request would
    compiled: list[str] = []
    previous = knobs.runtime.jit_cache_hook

    def seen(*, repr: str, **_) -> bool:
        compiled.append(repr.split("[")[0])
        return False
    knobs.runtime.jit_cache_hook = seen
    try:
        for rows in (2, 3, 4, 5, 6, 8, 32):
            step(rows)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiled == [], f"compiled again for a new row count: {compiled}"


@pytest.mark.parametrize("m,k", [(1, 64), (5, 3072), (400, 8192)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows(m, k, dtype):
    check_quantize_rows(m, k, dtype, "cuda", interpreted=False)
