"""The few-row projection kernel (`mstar.kernels.projection.gemv`) against the unfused
torch path: alone, with the norm before it (with and without the residual
add, plain and centered weights) and with SiLU-and-multiply after it. On CPU
tensors through Triton's interpreter (conftest switches it on), on CUDA at
Orpheus-3B's shapes, under CUDA-graph replay, and picked by the model's
layers for a few CUDA rows only."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import poisoned_outputs, same_on_replay

from mstar.kernels.projection import gemv
from mstar.kernels.backend import HAVE_TRITON, dependent_launch
from mstar.models.layers import CenteredRMSNorm, Linear, MergedLinear, RMSNorm
from mstar.models.layers.norm_linear import norm_project

EPS = 1e-5
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton with TRITON_INTERPRET=1 (pip install triton==3.7.1; conftest sets it without CUDA)")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON),
                          reason="needs CUDA and triton (runs on the GPU machine)")


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, silu: bool):
    """x and the residual as row views of wider tensors (strides the kernel must honour), a norm weight,
    and a projection weight scaled so outputs stay near one."""
    gen = torch.Generator().manual_seed(m * 100_003 + n * 101 + k)
    x = (torch.randn(m, k + 8, generator=gen) * 2).to(device=device, dtype=dtype)[:, 4:4 + k]
    residual = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    norm_weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(device=device, dtype=dtype)
    weight = (torch.randn(2 * n if silu else n, k, generator=gen) * k ** -0.5).to(device=device, dtype=dtype)
    return x, residual, norm_weight, weight


def _tolerance(dtype: torch.dtype, interpreted_run: bool) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    # bf16 outputs after up to four roundings (sum, normed value, weight product, gate): a few ulps of the
    # largest output. Triton's interpreter rounds float32 -> bf16 toward zero, not to nearest: more there
    return {"atol": 0.12, "rtol": 4e-2} if interpreted_run else {"atol": 3e-2, "rtol": 2e-2}


def check(m: int, n: int, k: int, dtype: torch.dtype, device: str, *, norm: bool, add: bool, silu: bool,
          centered: bool, config: gemv.GemvConfig | None = None) -> None:
    x, residual, norm_weight, weight = _inputs(m, n, k, dtype, device, silu)
    tol = _tolerance(dtype, device == "cpu")
    if not norm:
        with poisoned_outputs():
            got = gemv.linear(x, weight, config)
        assert got.shape == (m, n) and got.dtype == dtype
        torch.testing.assert_close(got, F.linear(x, weight), **tol)
        return
    res = residual if add else None
    with poisoned_outputs():
        got, stream = gemv._launch(x, res, norm_weight, EPS, centered, weight, None, silu, config)
    want, want_stream = gemv.norm_linear_reference(x, res, norm_weight, EPS, weight, centered=centered, silu=silu)
    assert got.shape == want.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    if device == "cpu":  # the interpreter rounds the sum toward zero
        torch.testing.assert_close(stream, want_stream, **tol)
    else:   # one rounded add, as the reference's
        assert torch.equal(stream, want_stream)
    if not add:
        assert stream is x   # the stream is the input itself: nothing was written


FORMS = [dict(norm=False, add=False, silu=False, centered=False),
         dict(norm=True, add=False, silu=False, centered=False),
         dict(norm=True, add=True, silu=False, centered=False),
         dict(norm=True, add=True, silu=True, centered=False),
         dict(norm=True, add=True, silu=False, centered=True),
         dict(norm=True, add=False, silu=True, centered=True)]
FORM_IDS = ["plain", "norm", "add_norm", "add_norm_silu", "add_centered", "centered_silu"]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 64, 300), (4, 13, 64), (2, 37, 150), (gemv.KERNEL_ROWS, 24, 80)])
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gemv_interpreted(m, n, k, dtype, form):
    # tiles smaller than the shapes, so columns and K both span several blocks and end in a partial one
    check(m, n, k, dtype, "cpu", config=gemv.GemvConfig(block_n=8, block_k=64), **form)
    if form["norm"]:  # the norm's statistics in blocks of another width than the projection's
        check(m, n, k, dtype, "cpu", config=gemv.GemvConfig(block_n=8, block_k=64, stats_block=128), **form)
    # programs that walk several blocks of columns (the interpreter counts one multiprocessor): one program
    # for all of them, and two with unequal shares where the blocks do not divide evenly; with the next step's
    # weight loaded ahead, across K steps and across blocks
    for per_sm, prefetch in ((1, False), (2, False), (0, True), (2, True)):
        check(m, n, k, dtype, "cpu", **form,
              config=gemv.GemvConfig(block_n=8, block_k=64, programs_per_sm=per_sm, prefetch=prefetch))


@interpreted
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gemv_interpreted_shapes_own_tiling(form):
    # `config_for`'s one-row tilings (whole-K blocks, programs walking several blocks, loads ahead) at a
    # small shape: the columns end in a partial block (41 over blocks of 2 or 4), and the programs' shares of
    # the blocks are unequal (21 blocks over 4 programs, 11 over 2)
    check(1, 41, 96, torch.bfloat16, "cpu", **form)


@interpreted
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gemv_interpreted_float16(form):
    check(5, 40, 96, torch.float16, "cpu", config=gemv.GemvConfig(block_n=8, block_k=64, programs_per_sm=2,
                                                                  prefetch=True), **form)


def test_persistent_programs_share_the_blocks_evenly():
    cpu = torch.device("cpu")
    assert gemv._programs(cpu, 5, 0) == 5
    assert gemv._programs(cpu, 5, 2) == 2      # 3 and 2 blocks
    assert gemv._programs(cpu, 768, 264) == 256  # 3 blocks each rather than 264 programs of 2 or 3
    assert gemv._programs(cpu, 7, 100) == 7


def test_gemv_refuses_what_it_cannot_take():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="do not make a projection"):
        gemv._launch(x, None, None, 0.0, False, torch.randn(8, 32), None, False, None)
    with pytest.raises(ValueError, match="at most"):
        gemv._launch(torch.randn(gemv.KERNEL_ROWS + 1, 64), None, None, 0.0, False, torch.randn(8, 64), None, False,
                     None)
    with pytest.raises(ValueError, match="even number"):
        gemv._launch(x, None, torch.ones(64), 1e-5, False, torch.randn(7, 64), None, True, None)
    for bad in (dict(programs_per_sm=-1), dict(stats_block=-2), dict(block_n=0), dict(num_warps=0)):
        with pytest.raises(ValueError, match="must"):
            gemv.GemvConfig(**bad)


def test_an_empty_k_projects_to_zeros():
    # nothing is launched: the output is the sum of no products, not uninitialised memory
    got = gemv.linear(torch.randn(1, 0), torch.randn(3, 0))
    assert got.shape == (1, 3) and torch.equal(got, torch.zeros(1, 3))


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_dependent_launch_needs_hopper_and_a_driver_whose_graphs_capture_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.backends.nvidia.compiler import CUDAOptions

    from mstar.kernels import backend
    asks = "launch_pdl" in CUDAOptions.__dataclass_fields__   # a triton that can ask for it
    for capability, driver, expect in (((9, 0), 12030, asks), ((9, 0), 12020, False), ((8, 0), 13000, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda d=driver: d, raising=False)
        backend._dependent_launch.cache_clear()
        assert backend._dependent_launch(0) == expect, (capability, driver)
    backend._dependent_launch.cache_clear()


def test_cpu_tensors_take_the_modules():
    """On CPU `norm_project` is the norm, the projection and the activation as modules compute them."""
    gen = torch.Generator().manual_seed(0)
    h, residual = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen)
    for norm in (RMSNorm(64, EPS), CenteredRMSNorm(64, EPS)):
        norm.weight.data.normal_(generator=gen)
        gate_up = MergedLinear(64, (("gate", 32), ("up", 32)))
        gate_up.weight.data.normal_(generator=gen)
        assert not gemv.applies(h, gate_up.weight)
        for res in (None, residual):
            got, stream = norm_project(norm, gate_up, h, res, silu=True)
            x, want_stream = norm.stream(h, res)
            y = gate_up(x)
            assert torch.equal(got, F.silu(y[:, :32]) * y[:, 32:]) and torch.equal(stream, want_stream)


@cuda
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,form", [(5120, 3072, 2), (3072, 3072, 0), (8192, 3072, 3), (3072, 8192, 0),
                                      (28736, 3072, 0), (2048, 4096, 4), (1001, 520, 5)])
@pytest.mark.parametrize("config", [None, gemv.GemvConfig(block_n=4, block_k=1024, programs_per_sm=2),
                                    gemv.GemvConfig(block_n=4, block_k=4096, programs_per_sm=3),
                                    gemv.GemvConfig(block_n=4, block_k=1024, prefetch=True),
                                    gemv.GemvConfig(block_n=4, block_k=4096, programs_per_sm=2, prefetch=True)],
                         ids=["shapes_own", "persistent", "persistent_one_k_step", "prefetch", "persistent_prefetch"])
def test_gemv_cuda(m, n, k, form, config):
    check(m, n, k, torch.bfloat16, "cuda", config=config, **FORMS[form])


@cuda
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gemv_cuda_float32(form):
    check(2, 300, 1000, torch.float32, "cuda", **form)


@cuda
def test_gemv_replays_under_cuda_graphs():
    gen = torch.Generator(device="cuda").manual_seed(5)

    def make():
        return [torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)
                for s in ((1, 3072), (1, 3072), (3072,), (2 * 4096, 3072))]
    same_on_replay(make, lambda x, r, nw, w: gemv.norm_linear(x, r, nw, EPS, w, silu=True))
    same_on_replay(make, lambda x, r, nw, w: gemv.linear(x, w))


def _layer_chain(x, r, nw, wq, wo, wgu, wd, config: gemv.GemvConfig | None):
    """Two decoder layers' projections back to back, each reading the one before's output (and the stream
    its first program wrote): what a launch that starts before the kernel ahead of it ends must wait for."""
    for _ in range(2):
        q, r = gemv.norm_linear(x, r, nw, EPS, wq, config=config)
        o = gemv.linear(q, wo, config)
        a, r = gemv.norm_linear(o, r, nw, EPS, wgu, silu=True, config=config)
        x = gemv.linear(a, wd, config)
    return x, r


@cuda
def test_dependent_launches_read_what_the_kernel_before_wrote(monkeypatch):
    """With programmatic dependent launch (Hopper) the chain's outputs are exactly those of plain launches of
    the same tiling, eagerly and replayed from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(9)

    def make():
        def t(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)
        return [t(1, 3072), t(1, 3072), 1 + t(3072, scale=0.1), t(3072, 3072, scale=3072 ** -0.5),
                t(3072, 3072, scale=3072 ** -0.5), t(2 * 8192, 3072, scale=3072 ** -0.5),
                t(3072, 8192, scale=8192 ** -0.5)]
    on = gemv.GemvConfig(block_n=4, block_k=1024, pdl=True)
    shapes_own = gemv.config_for

    def plain(config):
        """The chain as `config` tiles it, launched plainly."""
        if config is not None:
            return lambda *a: _layer_chain(*a, dataclasses.replace(config, pdl=False))
        def chain(*a):
            with monkeypatch.context() as m:
                m.setattr(gemv, "config_for", lambda *s, **kw: dataclasses.replace(shapes_own(*s, **kw), pdl=False))
                return _layer_chain(*a, None)
        return chain

    if not dependent_launch(torch.zeros(1, device="cuda")):   # it would compare plain launches with themselves
        pytest.skip("no programmatic dependent launch on this device")
    persistent = [dataclasses.replace(on, programs_per_sm=2), dataclasses.replace(on, block_k=4096, programs_per_sm=1),
                  dataclasses.replace(on, prefetch=True), dataclasses.replace(on, programs_per_sm=2, prefetch=True)]
    # a fixed tiling, the shapes' own (`config_for`), programs walking several blocks (one K step or more), and
    # the next step's weight loaded ahead (before the wait, under a dependent launch)
    for config in (on, None, *persistent):
        for _ in range(3):
            # fresh inputs, the dependent launches first: the blocks the allocator hands out hold another
            # round's values, so an output read before its kernel wrote it differs
            inputs = make()
            got = _layer_chain(*inputs, config)
            for g, want in zip(got, plain(config)(*inputs)):
                assert torch.equal(g, want)
        same_on_replay(make, lambda *a, c=config: _layer_chain(*a, c))


@cuda
def test_layers_take_the_kernel_for_a_few_cuda_rows_only():
    """`Linear` and `norm_project` give the kernel's exact output at up to MAX_ROWS rows, cuBLAS's above."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    lin = Linear(2048, 1024, device="cuda", dtype=torch.bfloat16)
    lin.weight.data.normal_(generator=gen)
    norm = RMSNorm(2048, EPS, device="cuda", dtype=torch.bfloat16)
    for m in (1, gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
        x = torch.randn(m, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
        few = m <= gemv.MAX_ROWS
        assert torch.equal(lin(x), gemv.linear(x, lin.weight) if few else F.linear(x, lin.weight))
        got = norm_project(norm, lin, x, r)
        if few:
            want = gemv.norm_linear(x, r, norm.weight, EPS, lin.weight)
        else:
            normed, stream = norm(x, r)
            want = (F.linear(normed, lin.weight), stream)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

