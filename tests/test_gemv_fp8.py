"""The few-row projection kernel over float8 weight rows (`--quantization
fp8`), weight-only: the input rows as they are, each column's float32 sum
times its weight row's scale. Checked against its reference
(`gemv.weight_only_reference`) in every form the layers use (alone, after
the norm with and without the residual add, with SiLU-and-multiply after
it): on CPU tensors through Triton's interpreter, on CUDA at Orpheus-3B's
shapes, under CUDA-graph replay, and picked by `Linear` and `norm_project`
at one CUDA row, close to the fp8 GEMM that more rows take. Its tensor-core
form (`GemvConfig.mma`, `gemv_mma.py`) likewise, and across the magnitudes
its power-of-two scaling of the row into float16 covers."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import poisoned_outputs, same_on_replay

from mstar.kernels.projection import gemv
from mstar.kernels.backend import HAVE_TRITON
from mstar.kernels.quantize import FP8, quantize_rows_reference
from mstar.models.layers import Linear, RMSNorm
from mstar.models.layers.fp8 import fp8_linear, quantize_weight
from mstar.models.layers.norm_linear import norm_project

EPS = 1e-5
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton with TRITON_INTERPRET=1 (pip install triton==3.7.1; conftest sets it without CUDA)")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON
                               and torch.cuda.get_device_capability() >= (8, 9)),
                          reason="needs CUDA of compute capability 8.9 or later and triton (the GPU machine)")



# (norm, residual add, silu, centered)
FORMS = {"plain": (False, False, False, False), "norm": (True, False, False, False),
         "add_norm": (True, True, False, False), "add_norm_silu": (True, True, True, False),
         "add_norm_centered": (True, True, False, True), "norm_centered_silu": (True, False, True, True)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, silu: bool):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = (torch.randn(m, k + 8, generator=gen) * 2).to(device=device, dtype=dtype)[:, 4:4 + k]
    residual = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    norm_weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(device=device, dtype=dtype)
    full = torch.randn(2 * n if silu else n, k, generator=gen) * k ** -0.5
    q, scale = quantize_rows_reference(full)
    return x, residual, norm_weight, q.to(device), scale.reshape(-1).to(device)


def check(m: int, n: int, k: int, dtype: torch.dtype, device: str, form: str, rel: float,
          config: gemv.GemvConfig | None = None) -> None:
    """The kernel's output within `rel` of the reference's largest magnitude. `_launch`, not `norm_linear`:
    on CPU tensors `norm_linear` is the reference itself."""
    norm, add, silu, centered = FORMS[form]
    x, residual, norm_weight, w, w_scale = _inputs(m, n, k, dtype, device, silu)
    if centered:
        norm_weight = norm_weight - 1
    res = residual if add else None
    with poisoned_outputs():
        got, stream = gemv._launch(x, res, norm_weight if norm else None, EPS, centered, w, w_scale, silu, config)
    if norm:
        want, want_stream = gemv.norm_linear_reference(x, res, norm_weight, EPS, w, centered=centered, silu=silu,
                                                       weight_scale=w_scale)
        torch.testing.assert_close(stream, want_stream, atol=rel, rtol=rel)
    else:
        want = gemv.weight_only_reference(x, w, w_scale)
    assert got.shape == want.shape == (m, n) and got.dtype == dtype
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * scale, f"{form} {m}x{n}x{k} {dtype}: off by {err:.3g} of {scale:.3g}"


@interpreted
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 37, 150)])
@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_gemv_interpreted(m, n, k, form):
    # float32 rows: only the summation order differs from the reference
    for config in (gemv.GemvConfig(block_n=8, block_k=64), gemv.GemvConfig(block_n=8, block_k=64, stats_block=128),
                   gemv.GemvConfig(block_n=8, block_k=64, programs_per_sm=2, prefetch=True)):
        check(m, n, k, torch.float32, "cpu", form, 1e-5, config)
    # bfloat16 rows: the interpreter rounds float32 -> bf16 toward zero (the sum, the normed input, the gate, the
    # output): a few ulps
    check(m, n, k, torch.bfloat16, "cpu", form, 4e-2, gemv.GemvConfig(block_n=8, block_k=64))


@interpreted
@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_gemv_interpreted_shapes_own_tiling(form):
    check(1, 41, 96, torch.bfloat16, "cpu", form, 4e-2)
    check(1, 41, 8, torch.float16, "cpu", form, 1e-3)  # K under a tensor-core product's 16


MMA_CONFIGS = [gemv.GemvConfig(block_n=16, block_k=32, mma=True),
               gemv.GemvConfig(block_n=32, block_k=64, stats_block=128, mma=True)]


@interpreted
@pytest.mark.parametrize("n,k", [(40, 96), (37, 150)])
@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_gemv_mma_interpreted(n, k, form):
    # float16 rows go in as they are and come out rounded once: within an ulp (2^-11) of the largest output;
    # bfloat16 rows: the interpreter rounds float32 -> bf16 toward zero, a bf16 ulp or two
    for config in MMA_CONFIGS:
        check(1, n, k, torch.float16, "cpu", form, 1e-3, config)
        check(1, n, k, torch.bfloat16, "cpu", form, 4e-2, config)


@interpreted
@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1e5, 1e30])
@pytest.mark.parametrize("form", ["plain", "norm", "add_norm", "add_norm_centered"])
def test_fp8_gemv_mma_scales_any_row_into_float16(magnitude, form):
    """Rows far outside float16's range (large: inf unscaled; small: its subnormals) or a norm weight that
    takes them there: the power-of-two scaling keeps the product the CUDA-core kernel's (the same interpreter
    roundings, only the summation order differs)."""
    x, r, nw, w, ws = _inputs(1, 40, 96, torch.bfloat16, "cpu", False)
    if form == "plain":
        x = (x.float() * magnitude).to(torch.bfloat16)
        nw = None
    else:  # the norm's output is x's scale-free: its weight sets the magnitude (centered: 1 + a weight near 0)
        nw = ((nw.float() - 1 if FORMS[form][3] else nw.float()) * magnitude).to(torch.bfloat16)
    res, centered = (r if FORMS[form][1] else None), FORMS[form][3]
    got = gemv._launch(x, res, nw, EPS, centered, w, ws, False, MMA_CONFIGS[0])[0].float()
    core = gemv._launch(x, res, nw, EPS, centered, w, ws, False, gemv.GemvConfig(block_n=8, block_k=64))[0].float()
    assert torch.isfinite(got).all() and core.abs().max() > 0
    assert (got - core).abs().max() <= 1e-2 * core.abs().max()


@interpreted
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")  # numpy's,
@pytest.mark.parametrize("form", ["plain", "norm", "add_norm_silu"])                       # under the interpreter
def test_fp8_gemv_mma_zero_and_nonfinite_rows(form):
    """A row of zeros gives zeros (no shift from log2(0)); an inf or NaN in the row gives the reference's infs
    and NaNs, column by column."""
    norm, add, silu, _ = FORMS[form]
    x, r, nw, w, ws = _inputs(1, 40, 96, torch.float16, "cpu", silu)
    res, nw = (torch.zeros_like(r) if add else None), (nw if norm else None)
    zero = gemv._launch(torch.zeros_like(x), res, nw, EPS, False, w, ws, silu, MMA_CONFIGS[0])[0]
    assert torch.equal(zero, torch.zeros_like(zero))
    for bad in (float("inf"), float("nan")):
        row = x.clone().index_fill_(1, torch.tensor([3]), bad)
        got = gemv._launch(row, res, nw, EPS, False, w, ws, silu, MMA_CONFIGS[0])[0]
        want = (gemv.norm_linear_reference(row, res, nw, EPS, w, silu=silu, weight_scale=ws)[0] if norm
                else gemv.weight_only_reference(row, w, ws))
        assert not torch.isfinite(got).any()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isposinf(), want.isposinf())


def test_fp8_config_for_sends_only_one_half_precision_gate_up_row_to_the_tensor_cores():
    n, k = 3072, 3072
    assert gemv.config_for(1, n, k, silu=True, norm=True, fp8=True, half=True).mma
    assert gemv.config_for(1, n, 8, silu=True, norm=True, fp8=True, half=True).block_k == 16
    for kwargs in (dict(rows=2, silu=True, norm=True, fp8=True, half=True), dict(rows=1, silu=True, norm=True,
                   fp8=True), dict(rows=1, norm=True, fp8=True, half=True), dict(rows=1, fp8=True, half=True),
                   dict(rows=1, silu=True, norm=True, half=True),
                   dict(rows=1, n=gemv.HEAD_WIDTH, silu=True, norm=True, fp8=True, half=True)):
        assert not gemv.config_for(**{"n": n, "k": k, **kwargs}).mma, kwargs


@interpreted
def test_fp8_gemv_float32_row_after_norm_takes_the_cuda_cores():
    check(1, 40, 96, torch.float32, "cpu", "add_norm_silu", 1e-5)


def test_fp8_gemv_mma_takes_one_float8_row_of_half_precision():
    with pytest.raises(ValueError, match="16 or more"):
        gemv.GemvConfig(block_n=8, block_k=64, mma=True)
    with pytest.raises(ValueError, match="do not apply"):
        gemv.GemvConfig(block_n=16, block_k=64, mma=True, prefetch=True)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    q, scale = quantize_rows_reference(w.float())
    with pytest.raises(ValueError, match="float8 weights"):
        gemv.linear(x, w, MMA_CONFIGS[0])
    with pytest.raises(ValueError, match="one row"):
        gemv.linear(torch.randn(2, 64, dtype=torch.bfloat16), q, MMA_CONFIGS[0], weight_scale=scale.reshape(-1))
    with pytest.raises(ValueError, match="one row"):
        gemv.linear(x.float(), q, MMA_CONFIGS[0], weight_scale=scale.reshape(-1))
    with pytest.raises(ValueError, match="comes with the norm"):  # neither kernel adds a residual it does not norm
        gemv._launch(x, x, None, EPS, False, q, scale.reshape(-1), False, MMA_CONFIGS[0])


def test_fp8_weights_come_with_their_scales_only():
    x = torch.randn(1, 64)
    w = torch.randn(32, 64)
    q, scale = quantize_rows_reference(w)
    with pytest.raises(ValueError, match="one scale per row"):
        gemv._launch(x, None, None, EPS, False, q, None, False, None)
    with pytest.raises(ValueError, match="one scale per row"):
        gemv._launch(x, None, None, EPS, False, w, scale.reshape(-1), False, None)
    with pytest.raises(ValueError, match="one scale per row"):
        gemv._launch(x, None, None, EPS, False, q, scale.reshape(-1)[:5], False, None)


def test_the_weight_only_reference_is_near_the_full_product():
    # x stays as it is: the error is the weight's rounding alone, within e4m3's relative step (2^-4) of the
    # largest output, and scaling the sums by the row scales equals dequantizing the weight first
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, generator=gen)
    w = torch.randn(64, 512, generator=gen) * 0.05
    wq, ws = quantize_rows_reference(w)
    assert wq.dtype == FP8
    got = gemv.weight_only_reference(x, wq, ws.reshape(-1))
    full = x @ w.t()
    assert (got - full).abs().max() <= 2 ** -4 * full.abs().max()
    torch.testing.assert_close(got, x @ (wq.float() * ws).t(), atol=1e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("n,k,form", [(5120, 3072, "add_norm"), (3072, 3072, "plain"), (8192, 3072, "add_norm_silu"),
                                      (3072, 8192, "plain"), (5120, 3072, "norm"), (1001, 520, "add_norm_silu")])
@pytest.mark.parametrize("config", [None, gemv.GemvConfig(block_n=4, block_k=1024, programs_per_sm=2, prefetch=True),
                                    gemv.GemvConfig(block_n=8, block_k=4096, programs_per_sm=2, prefetch=True),
                                    gemv.GemvConfig(block_n=16, block_k=128, num_stages=3, mma=True),
                                    gemv.GemvConfig(block_n=64, block_k=256, num_warps=8, num_stages=4, mma=True)],
                         ids=["shapes_own", "persistent_prefetch", "wide", "mma", "mma_wide"])
def test_fp8_gemv_cuda(n, k, form, config):
    # summation order and cuda's own bf16 rounding only: within a bf16 ulp or two of the output's magnitude
    check(1, n, k, torch.bfloat16, "cuda", form, 1.6e-2, config)


@cuda
def test_fp8_gemv_replays_under_cuda_graphs():
    gen = torch.Generator(device="cuda").manual_seed(5)
    _, scale = quantize_rows_reference(torch.randn(2 * 4096, 3072, device="cuda", generator=gen))

    def make():
        x, r, nw = (torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for s in ((1, 3072), (1, 3072), (3072,)))
        w = torch.randn(2 * 4096, 3072, generator=gen, device="cuda").to(FP8)
        return [x, r, nw, w]
    for config in (None, gemv.GemvConfig(block_n=16, block_k=128, num_stages=3, mma=True)):
        same_on_replay(make, lambda x, r, nw, w: gemv.norm_linear(x, r, nw, EPS, w, silu=True, config=config,
                                                                  weight_scale=scale.reshape(-1)))


@cuda
def test_fp8_layers_take_the_kernel_at_one_cuda_row_only():
    """A float8 `Linear` and `norm_project` give the kernel's exact output at one row, the fp8 GEMM's above;
    the two stay close (the GEMM quantizes x too: a few % of the largest output)."""
    torch.manual_seed(1)
    lin = Linear(3072, 1024, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.normal_(0, 0.02)
    quantize_weight(lin)
    norm = RMSNorm(3072, EPS, device="cuda", dtype=torch.bfloat16)
    for m in (1, 2):
        x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
        gemm = fp8_linear(x, lin.weight, lin.weight_scale, None, 16)
        if m <= gemv.MAX_ROWS:
            assert torch.equal(lin(x), gemv.linear(x, lin.weight, weight_scale=lin.weight_scale))
            got = norm_project(norm, lin, x, r)
            want = gemv.norm_linear(x, r, norm.weight, EPS, lin.weight, weight_scale=lin.weight_scale)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert torch.equal(lin(x), gemm)
        torch.testing.assert_close(lin(x), gemm, atol=6e-2 * gemm.abs().max().item(), rtol=0)
