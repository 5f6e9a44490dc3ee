"""The Triton kernels of mstar.kernels against their torch references, run on
CPU tensors through Triton's interpreter (conftest switches it on), and the
dispatch that sends CPU tensors to the references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import (check_fused_add_rms_norm, check_fused_moe, check_head_norm_rope, check_moe_align,
                          check_qkv_norm_rope_store, check_rms_norm, check_rope_and_store, check_silu_and_mul,
                          check_snake, check_snake_beta, check_snake_beta_held, check_route_top_k,
                          check_snake_dwconv, check_snake_unit, check_codec_noise, moe_inputs, check_quantize_rows)
from sampling_kernel_cases import (check_exponential_noise, check_draw_tokens, check_wide_descent, check_wide_draw,
                                   check_window_draw,
                                   check_repetition_penalty)

from mstar.kernels import activation, fused_add_rms_norm, moe, norm, rms_norm, rope_and_store, rope_kv, silu_and_mul
from mstar.kernels.backend import HAVE_TRITON, block_size, num_warps

interpreted = pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton with TRITON_INTERPRET=1 (pip install triton==3.7.1; conftest sets it without CUDA)")
DTYPES = [torch.float32, torch.bfloat16]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (7, 96), (33, 128), (3, 4096)])
@pytest.mark.parametrize("check", [check_rms_norm, check_fused_add_rms_norm], ids=["plain", "fused_add"])
@pytest.mark.parametrize("centered", [False, True], ids=["weight", "centered"])
def test_rms_norm(check, t, h, dtype, centered):
    check(t, h, dtype, "cpu", interpreted=True, centered=centered)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 64), (7, 1500), (33, 128), (2, 2048)])
def test_silu_and_mul(t, inter, dtype):
    check_silu_and_mul(t, inter, dtype, "cpu", interpreted=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t", [(1, 3, 5), (2, 4, 1500), (3, 64, 2048), (5, 13, 37)])
def test_snake(b, c, t, dtype):
    check_snake(b, c, t, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t,dilation", [(1, 2, 5, 1), (2, 3, 40, 3), (2, 8, 1100, 9), (1, 4, 9, 9)])
def test_snake_dwconv(b, c, t, dilation, dtype):
    check_snake_dwconv(b, c, t, dilation, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t,dilation", [(1, 2, 5, 1), (2, 3, 40, 3), (2, 8, 1100, 9), (3, 23, 37, 1)])
def test_snake_unit(b, c, t, dilation, dtype):
    check_snake_unit(b, c, t, dilation, dtype, "cpu")


def test_snake_dwconv_rejects_a_grouped_weight():
    from mstar.kernels.codec.snake import snake_dwconv_triton

    with pytest.raises(ValueError, match="depthwise"):
        snake_dwconv_triton(torch.zeros(1, 4, 8), torch.ones(1, 4, 1), torch.zeros(4, 2, 7), None, 1)


@interpreted
@pytest.mark.parametrize("rows,vocab", [(1, 5), (4, 3000), (2, 156_940)])
def test_exponential_noise(rows, vocab):
    check_exponential_noise(rows, vocab, "cpu")


# the table's decode row, and tiles that split H and I over several column
# tiles and reduction steps, with ragged last ones
MOE_TILES = [None, moe.MoeTiles(32, moe.Gemm(32, 16, 2, 1), moe.Gemm(32, 32, 2, 1))]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,inter,e", [(1, 64, 16, 4), (5, 48, 48, 6), (33, 32, 40, 8), (33, 64, 16, 5)])
@pytest.mark.parametrize("tiles", MOE_TILES, ids=["table", "split"])
def test_fused_moe(t, h, inter, e, tiles, dtype):
    """Top 2 where every token picks expert 0 (33 rows: three 16-row blocks)
    and none the last expert; at T 1 and 5 most experts get no row."""
    check_fused_moe(t, h, inter, e, 2, dtype, "cpu", interpreted=True, tiles=tiles)


@interpreted
def test_fused_moe_uniform_routing():
    check_fused_moe(40, 64, 32, 8, 3, torch.float32, "cpu", interpreted=True, skewed=False)


@interpreted
@pytest.mark.parametrize("t,e,k,block_m", [(1, 4, 2, 16), (33, 8, 2, 16), (33, 6, 3, 32), (700, 5, 2, 16),
                                           (4200, 5, 2, 64)])
@pytest.mark.parametrize("skewed", [True, False], ids=["skewed", "uniform"])
def test_moe_align(t, e, k, block_m, skewed):
    """700 x 2 routed rows take two steps of the align step's decode chunk,
    4200 x 2 three of its prefill chunk."""
    check_moe_align(t, e, k, block_m, "cpu", skewed)


@pytest.mark.parametrize("tokens,expected", [(1, 16), (64, 16), (256, 16), (512, 32), (4096, 64)])
def test_moe_tiles_by_rows_per_expert(tokens, expected):
    """The thinker's routing (top 8 of 128): decode steps take 16-row blocks."""
    assert moe.tiles_for(tokens, 8, 128).block_m == expected


def test_moe_reference_matches_a_dense_loop():
    """Every (token, slot) pair one at a time in float64 against the per-expert loop."""
    x, gate_up, down, experts, weights = moe_inputs(6, 32, 24, 5, 2, torch.float64, "cpu", skewed=True)
    want = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            e = experts[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe.fused_moe_reference(x, gate_up, down, experts, weights), want)


def test_snake_reference_is_the_package_formula():
    from mstar.kernels.codec.snake import ALPHA_EPS, snake, snake_reference

    x, alpha = torch.randn(2, 3, 17), torch.rand(1, 3, 1) + 0.1
    want = x + (alpha + ALPHA_EPS).reciprocal() * torch.sin(alpha * x).pow(2)
    assert torch.equal(snake_reference(x, alpha), want)
    assert torch.equal(snake(x, alpha), want)  # CPU tensors take the reference


@interpreted
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 64), (7, 8, 1, 128), (33, 6, 6, 64), (5, 12, 4, 128)])
def test_rope_and_store(t, hq, hkv, d, dtype, cache_dtype):
    check_rope_and_store(t, hq, hkv, d, dtype, cache_dtype, "cpu", interpreted=True)


@interpreted
def test_rope_and_store_head_dim_not_a_power_of_two():
    check_rope_and_store(5, 4, 2, 80, torch.float32, torch.float32, "cpu", interpreted=True)


@interpreted
def test_empty_batches_launch_nothing():
    x = torch.zeros(0, 64)
    assert norm.rms_norm_triton(x, torch.ones(64), 1e-6).shape == (0, 64)
    assert activation.silu_and_mul_triton(torch.zeros(0, 128)).shape == (0, 64)
    q, kv = torch.zeros(0, 4, 64), torch.zeros(0, 2, 64)
    cache = torch.zeros(2, 4, 2, 64)
    out = rope_kv.rope_and_store_triton(q, kv, kv, torch.ones(8, 64), torch.zeros(8, 64),
                                        torch.zeros(0, dtype=torch.long), cache, cache.clone(),
                                        torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 4, 64)
    gate_up, down = torch.zeros(4, 32, 64), torch.zeros(4, 64, 16)
    idle = torch.zeros(0, 2, dtype=torch.long)
    assert moe.fused_moe_triton(torch.zeros(0, 64), gate_up, down, idle, idle.float()).shape == (0, 64)


@interpreted
def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_triton(torch.zeros(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rms_norm_triton(torch.zeros(2, 64), torch.zeros(3, 64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="even"):
        activation.silu_and_mul_triton(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="head_dim"):
        rope_kv.rope_and_store_triton(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                                      torch.ones(4, 16), torch.ones(4, 16), torch.zeros(1, dtype=torch.long),
                                      torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8),
                                      torch.zeros(1, dtype=torch.long))
    x, gate_up, down, experts, weights = moe_inputs(3, 32, 16, 4, 2, torch.float32, "cpu", skewed=False)
    with pytest.raises(ValueError, match="x"):
        moe.fused_moe_triton(x[:, :16], gate_up, down, experts, weights)
    with pytest.raises(ValueError, match="down"):
        moe.fused_moe_triton(x, gate_up, down[:, :, :8], experts, weights)
    with pytest.raises(ValueError, match="weights"):
        moe.fused_moe_triton(x, gate_up, down, experts, weights[:, :1])


def test_cpu_tensors_take_the_references():
    gen = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(3, 32, generator=gen) for _ in range(3))
    assert torch.equal(rms_norm(x, w[0], 1e-6), norm.rms_norm_reference(x, w[0], 1e-6))
    for a, b in zip(fused_add_rms_norm(x, r, w[0], 1e-6), norm.fused_add_rms_norm_reference(x, r, w[0], 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(x), activation.silu_and_mul_reference(x))
    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    cos, sin = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    pos, slots = torch.tensor([5, 0, 2]), torch.tensor([7, 1, 4])
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(4)]
    got = rope_and_store(q, k, k + 1, cos, sin, pos, caches[0], caches[1], slots)
    ref = rope_kv.rope_and_store_reference(q, k, k + 1, cos, sin, pos, caches[2], caches[3], slots)
    assert torch.equal(got, ref) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    routed = moe_inputs(3, 32, 16, 4, 2, torch.float32, "cpu", skewed=False)
    assert torch.equal(moe.fused_moe(*routed), moe.fused_moe_reference(*routed))


def test_reference_rope_matches_the_unfused_formula():
    """In fp32 the reference is exactly x * cos + rotate_half(x) * sin, the
    formula the model applied before the rotation moved into attention."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 16, generator=gen)
    cos, sin = torch.randn(9, 16, generator=gen), torch.randn(9, 16, generator=gen)
    pos = torch.tensor([0, 8, 3, 3, 1])
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    assert torch.equal(rope_kv.apply_rope(x, cos, sin, pos), x * c + rotated * s)


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_block_size(n, expected):
    assert block_size(n) == expected


def test_num_warps_is_a_power_of_two_at_most_16():
    for elements in (1, 100, 256, 1000, 4096, 1 << 20):
        w = num_warps(elements)
        assert 1 <= w <= 16 and w & (w - 1) == 0


@interpreted
def test_snac_decoder_through_the_fused_kernels_matches_the_reference(monkeypatch):
    """The residual units' wiring of snake_dwconv (weight, bias, dilation) and
    snake: a small depthwise SNAC decoded with the Triton path (interpreted)
    against the torch path, same weights, same seeded noise."""
    from mstar.kernels.codec import snake as snake_kernels
    from mstar.models.snac import SnacConfig, load_snac_decoder

    cfg = SnacConfig(sampling_rate=16_000, encoder_dim=8, encoder_rates=(2, 2), decoder_dim=64,
                     decoder_rates=(2, 2), attn_window_size=None, codebook_size=64, codebook_dim=4,
                     vq_strides=(2, 1), noise=True, depthwise=True)
    decoder = load_snac_decoder(None, load_format="dummy", config=cfg)
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 64, (2, 3 * (2 // s)), generator=gen) for s in cfg.vq_strides]
    seeds = torch.tensor([5, 6])
    with torch.no_grad():
        want = decoder.decode(codes, seeds=seeds)
        monkeypatch.setattr(snake_kernels, "use_triton", lambda x: True)
        calls = []
        fused = snake_kernels.snake_dwconv_triton
        monkeypatch.setattr(snake_kernels, "snake_dwconv_triton", lambda *a: calls.append(1) or fused(*a))
        got = decoder.decode(codes, seeds=seeds)
    assert len(calls) == 3 * len(cfg.decoder_rates)  # every residual unit took the fused kernel
    assert got.shape == want.shape and want.abs().max() > 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,kv_heads,d", [(1, 4, 2, 16), (6, 3, 1, 64), (2, 2, 2, 128), (4, 8, 2, 256)])
def test_qkv_norm_rope_store(t, heads, kv_heads, d, dtype):
    check_qkv_norm_rope_store(t, heads, kv_heads, d, dtype, dtype, "cpu", interpreted=True)


@interpreted
def test_qkv_norm_rope_store_in_half_precision_into_a_cache_of_another_dtype():
    check_qkv_norm_rope_store(4, 4, 2, 64, torch.float16, torch.float16, "cpu", interpreted=True)
    check_qkv_norm_rope_store(4, 4, 2, 64, torch.bfloat16, torch.float32, "cpu", interpreted=True)


@pytest.mark.parametrize("t,new,start,capacity,rows", [(4, 1, 1, 1, 16), (5, 2, 0, 4, 16), (4, 1, 0, 4, 15)])
def test_qkv_store_refuses_a_dense_layout_past_its_caches(t, new, start, capacity, rows):
    """On the device a store past the caches writes over other memory, so
    the layout is checked on the host first."""
    from mstar.kernels.qkv_store import KVDest, qkv_norm_rope_store_triton

    k, v = torch.zeros(rows, 1, 8), torch.zeros(rows, 1, 8)
    cos = sin = torch.ones(t, 8)
    with pytest.raises(ValueError, match="do not fit"):
        qkv_norm_rope_store_triton(torch.zeros(t, 24), 1, 1, torch.ones(8), torch.ones(8), cos, sin, 1e-6,
                                   KVDest(k, v, new=new, start=start, capacity=capacity))


def test_a_frame_cache_refuses_tokens_that_do_not_split_over_its_rows():
    from mstar.models.qwen3_omni.speech.code_predictor import FrameCache

    with pytest.raises(ValueError, match="do not split"):
        FrameCache(2, 4).kv_dest(0, 5, 1, 8, torch.float32, torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,d", [(1, 4, 16), (5, 3, 64), (2, 2, 128)])
def test_head_norm_rope(t, heads, d, dtype):
    check_head_norm_rope(t, heads, d, dtype, "cpu", interpreted=True)


@interpreted
@pytest.mark.parametrize("filtered", [True, False])
@pytest.mark.parametrize("rows,vocab,dtype", [(13, 40, torch.float32), (7, 300, torch.float16)])
def test_draw_tokens(rows, vocab, dtype, filtered):
    check_draw_tokens(rows, vocab, filtered, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("rows,length,start,dtype", [(2, 7, 0, torch.float32), (6, 2500, 2006, torch.float16)])
def test_codec_noise(rows, length, start, dtype):
    check_codec_noise(rows, length, start, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("rows,vocab,dtype", [(3, 50, torch.float32), (5, 5000, torch.bfloat16)])
def test_repetition_penalty(rows, vocab, dtype):
    check_repetition_penalty(rows, vocab, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("filtered", [True, False])
@pytest.mark.parametrize("rows,vocab,dtype,block", [(7, 40, torch.float32, 16), (7, 300, torch.float16, 64)])
def test_wide_draw(rows, vocab, dtype, block, filtered):
    check_wide_draw(rows, vocab, filtered, dtype, "cpu", block)


@pytest.mark.parametrize("how", ["reference", pytest.param("triton", marks=interpreted),
                                 pytest.param("wide", marks=interpreted)])
def test_window_draw(how):
    """A window of the vocabulary draws what the whole row draws with the ids outside it at -inf
    (`--audio-logits-only`'s sampler), in each of the three draws."""
    from mstar.kernels.sampling import draw, wide_draw
    kernel = {"reference": draw.draw_tokens_reference, "triton": draw.draw_tokens_triton,
              "wide": lambda *a, **kw: wide_draw.draw_tokens_wide(*a, block=32, **kw)}[how]
    check_window_draw(9, 200, 64, 190, torch.float32, "cpu", kernel)


@interpreted
def test_wide_draw_searches_more_blocks_than_groups():
    """The search's and ties' programs loop over every GROUPS-th block: a row of 10 blocks, every row
    searching (no descent), with top-k and top-p."""
    from mstar.kernels.sampling import wide_draw
    check_draw_tokens(3, 150, True, torch.float32, "cpu",
                      lambda *a: wide_draw.draw_tokens_wide(*a, block=16, descent_steps=0))


@interpreted
@pytest.mark.parametrize("rows,vocab,dtype,block", [(11, 70, torch.float32, 16), (6, 900, torch.bfloat16, 128)])
def test_wide_descent(rows, vocab, dtype, block):
    check_wide_descent(rows, vocab, dtype, "cpu", block)


# the interpreter runs what a GPU compile refuses (a loop variable that changes type, a global read in a
# kernel): the kernels written since the H200 last ran them are compiled for an H100/H200 target on this CPU
# box, in a process of its own (this one's kernels are the interpreter's)
_COMPILE_FOR_SM90 = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from mstar.kernels.codec import codec_noise, snake, snake_unit
from mstar.kernels.sampling import penalty, wide_descent as d, wide_draw as w
ints = {"n_rows": "i32", "stride": "i64", "offset": "i64", "first": "i32",
        "vocab": "i32", "blocks": "i32", "mul_a": "i32", "mul_b": "i32",
        "salt": "i32", "inv_2_24": "fp32", "channels": "i32", "length": "i32", "width": "i32", "dilation": "i32",
        "eps": "fp32", "x_batch_stride": "i64", "x_channel_stride": "i64", "block": "i32", "start": "i32",
        "golden": "u32", "mix1": "u32", "mix2": "u32", "two_pi": "fp32"}
pointers = {"logits_ptr": "*bf16", "skip_ptr": "*i8", "top_ptr": "*i64", "k_cut_ptr": "*i64", "k_need_ptr": "*i64",
            "lo_ptr": "*i64", "hi_ptr": "*i64", "cut_ptr": "*i64", "p_cut_ptr": "*i64", "seeds_ptr": "*i64",
            "counters_ptr": "*i64", "at_ptr": "*i64", "first_ptr": "*i64", "win_at_ptr": "*i64", "seen_ptr": "*u8",
            "cand_ptr": "*i64", "state_ptr": "*i8"}
halves = {"x_ptr", "w_ptr", "b_ptr", "alpha_ptr", "y_ptr", "noise_ptr", "snaked_ptr"}
constexprs = {"BLOCK": 1024, "WAYS": w.WAYS, "GROUPS": w.GROUPS, "BLOCKS": 128, "TAPS": 7, "ROWS": 1}
kernels = [(w._max_kernel, {}), (w._total_kernel, {"TOP_K": True}), (w._total_kernel, {"TOP_K": False}),
           (w._narrow_kernel, {}), (w._above_kernel, {"MASS": True, "TOP_K": True}),
           (w._above_kernel, {"MASS": True, "TOP_K": False}), (w._above_kernel, {"MASS": False, "TOP_K": True}),
           (w._tie_kernel, {"MASS": True, "TOP_K": False}), (w._tie_kernel, {"MASS": False, "TOP_K": True}),
           (w._race_kernel, {"FILTER": True, "TOP_K": True}), (w._race_kernel, {"FILTER": False, "TOP_K": False}),
           *[(d._descend_kernel, {"FIRST": first, "LAST": last, "TOP_K": top_k})
             for first, last, top_k in ((True, False, True), (False, False, False), (False, True, True),
                                        (True, True, False))],
           *[(d._settle_kernel, {"FIRST": first, "LAST": last})
             for first, last in ((True, False), (False, False), (False, True), (True, True))],
           (penalty._penalty_kernel, {}), (codec_noise._normal_kernel, {}),
           (snake._snake_kernel, {"ROWS": 16, "BLOCK": 64}),
           (snake_unit._dwconv_snake_kernel, {}), (snake_unit._dwconv_snake_kernel, {"ROWS": 32, "BLOCK": 32}),
           (snake_unit._residual_snake_kernel, {"HAS_BIAS": True, "HAS_NOISE": True, "SNAKE": True}),
           (snake_unit._residual_snake_kernel, {"HAS_BIAS": False, "HAS_NOISE": False, "SNAKE": False}),
           (snake_unit._residual_snake_kernel, {"HAS_BIAS": True, "HAS_NOISE": True, "SNAKE": True, "ROWS": 64,
                                                 "BLOCK": 16})]
for kernel, flags in kernels:
    names = kernel.arg_names
    known = {**constexprs, **flags}
    halved = kernel.fn.__module__.endswith("snake_unit") or kernel is codec_noise._normal_kernel
    def kind(n):
        if n in known:
            return "constexpr"
        if n in ints:
            return ints[n]
        return pointers.get(n, "*fp16" if halved and (n in halves or n == "out_ptr") else "*fp32")
    signature = {n: kind(n) for n in names}
    source = ASTSource(kernel, signature, constexprs={n: v for n, v in known.items() if n in names})
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in compiled.asm, (kernel, sorted(compiled.asm))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_new_kernels_compile_for_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,k,renormalize", [(5, 8, 2, True), (40, 128, 8, True), (7, 60, 4, False)])
def test_route_top_k(tokens, experts, k, renormalize, dtype):
    check_route_top_k(tokens, experts, k, renormalize, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter truncates to bf16
@pytest.mark.parametrize("b,c,t", [(1, 3, 5), (2, 16, 1500), (3, 7, 20)])
def test_snake_beta(b, c, t, dtype):
    check_snake_beta(b, c, t, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,t,reach,masked", [(1, 3, 5, 6, True), (2, 8, 40, 18, False), (3, 4, 1100, 0, True),
                                                 (2, 5, 7, 1030, True)])
def test_snake_beta_held(b, c, t, reach, masked, dtype):
    check_snake_beta_held(b, c, t, reach, masked, dtype, "cpu")


def test_a_kernel_unspecialised_on_a_parameter_it_lacks_is_refused():
    """triton ignores names it does not find, which would bring back a compile per alignment or value."""
    from mstar.kernels.backend import jit

    def kernel(x_ptr, n):
        return None
    with pytest.raises(TypeError, match="seeds_ptr"):
        jit(per_row=("seeds_ptr",))(kernel)
    with pytest.raises(TypeError, match="rows"):
        jit(any_value=("rows",))(kernel)


@interpreted
@pytest.mark.parametrize("m,k", [(1, 64), (5, 3072), (3, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows(m, k, dtype):
    check_quantize_rows(m, k, dtype, "cpu", interpreted=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repetition_penalty_at_seen_tokens_is_the_whole_forms(dtype):
    """The CPU's penalty, computed at the seen tokens only, equals the torch form over every id bit for bit
    (-inf and NaN logits, rows without a penalty), and leaves its input as it was."""
    from mstar.kernels.sampling import penalty as penalty_kernels

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3000, generator=gen) * 4).to(dtype)
    logits[:, ::11] = float("-inf")
    logits[2, 5] = float("nan")
    seen = torch.rand(6, 3000, generator=gen) < 0.2
    seen[2, 5] = True
    penalty = torch.tensor([1.3, 1.0, 2.0, 0.7, 1.1, 3.0])
    before = logits.clone()
    x, pen = logits.float(), penalty[:, None]
    whole = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    got = penalty_kernels.repetition_penalty_reference(logits, seen, penalty)
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), whole.isnan())
    assert torch.equal(got.nan_to_num(0.0), whole.nan_to_num(0.0))
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(0.0), before.nan_to_num(0.0))
