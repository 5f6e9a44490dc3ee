"""Projections of a few rows: activations x [M, K] (up to `KERNEL_ROWS`;
the layers send one, `MAX_ROWS`) and a weight [N, K] in, x @ weight.T
[M, N] out, in x's dtype; optionally with the RMSNorm before the projection
and the SiLU-and-multiply after it done in the same kernel.

At one decode row a projection only streams its weight through the GPU.
cuBLAS's GEMM for such a shape may split K over programs and add a reduction
kernel, and the norm and the activation around it are kernels of their own.
Here each program reads blocks of the weight's rows once and owns their
outputs: with `norm_weight` it forms the normed input itself (each program
reads the few rows of x, which stay in cache, and takes their statistics
first), and with `silu` the weight is a merged gate/up [2I, K] and the
program computes both halves of its columns and writes silu(gate) * up
[M, I]. A program may own several blocks of columns (`programs_per_sm`),
walked as one loop over (block, K step), and load each step's weight one
step ahead (`prefetch`): Triton does not pipeline this loop itself (its
products are no `tl.dot`), and a one-row projection's speed is the bytes
of weight in flight.

On Hopper and later a launch is a programmatic dependent of the kernel
before it: its programs start while that kernel's last ones run, read their
first block of the weight, and only then wait for its output. The weight is
never written by the kernel just before (a model's weights are fixed while it
serves; a weight `_launch` has to copy first turns the overlap off), so that
read needs no wait.

With `weight_scale` the weight is float8 (e4m3) rows with a float32 scale
each (`--quantization fp8`, `models/layers/fp8.py`), half the bytes to
stream. The input rows stay as they are (weight-only): the products of x
and the float8 weight sum in float32, and each column's sum is times its
row's scale. The fp8 GEMM of more rows quantizes x too (`torch._scaled_mm`
takes two float8 sides); here that would cost each program a division per
element of x on top of the weight's stream (measured on an H100: ~0.7-1.0
TB/s against cuBLAS's fp8 path's ~0.7-1.7), for a less exact product.

At one row of float8 weights the tensor-core form (`gemv_mma.py`,
`GemvConfig.mma`) may take the products instead, the weight as float16:
its conversion costs half an instruction an element there. `config_for`
sends it the merged gate/up, the one projection it is faster for.

The arithmetic matches the unfused torch path: the residual add, the normed
value and the weight multiply are rounded to x's dtype where the reference
rounds them (`kernels/norm.py`), the products accumulate in float32, and the
gate is rounded before its SiLU (`kernels/activation.py`). Only the
summation order of the dot products differs from cuBLAS's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.kernels.activation import silu_and_mul_reference
from mstar.kernels.backend import block_size, cdiv, dependent_launch, jit, tl, use_triton
from mstar.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from mstar.kernels.projection import gemv_mma
from mstar.kernels.projection.blocks import input_block, store_block, weight_block
from mstar.kernels.quantize import FP8

MAX_ROWS = 1    # at two rows cuBLAS was as fast or faster on three of a Llama layer's four projections (H100)
MIN_WEIGHT = 1 << 20  # elements; a smaller weight's projection is a few microseconds either way
KERNEL_ROWS = 16  # the most rows a launch takes (its accumulators grow with them)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_WIDTH = 16384  # outputs from which a projection is a vocabulary's head: its blocks fill the GPU as they are
# the tensor-core kernel's pass over the row before its products (its bound; the norm's statistics): in one
# block where K allows, since nothing else is in flight while it runs
MMA_STATS_BLOCK = 4096


@dataclass(frozen=True)
class GemvConfig:
    """How a launch tiles the weight: output columns and K per program step."""
    block_n: int = 8
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 1
    pdl: bool = True  # launch as a programmatic dependent where the device has it (Hopper and later)
    # K per step of the norm's statistics pass (0: block_k); a block as wide as K reads x in one trip to the
    # cache before the weight's stream starts, where block_k's steps take several
    stats_block: int = 0
    # programs per multiprocessor, each walking several blocks of columns in one loop (0: a program per block);
    # a program's loads then run on from one block into the next, and its norm statistics serve them all
    programs_per_sm: int = 0
    # each step issues the next step's weight loads before its own products: twice the bytes in flight a program
    prefetch: bool = False
    # float8 weights at one row: the products on the tensor cores (`gemv_mma.py`), a program a block of columns
    # (blocks of 16 or more; programs_per_sm and prefetch do not apply, num_stages pipelines its K steps)
    mma: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: blocks, warps and stages must be positive")
        if self.mma and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"{self}: tensor-core products take blocks of 16 or more")
        if self.mma and (self.programs_per_sm or self.prefetch):
            raise ValueError(f"{self}: the tensor-core kernel runs a program a block, its K steps pipelined: "
                             f"programs_per_sm and prefetch do not apply")
        if self.stats_block < 0 or self.programs_per_sm < 0:
            raise ValueError(f"{self}: stats_block and programs_per_sm must not be negative (0: the default)")


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear`/`norm_linear` take the kernel for x [M, K] and this
    weight: CUDA, at most MAX_ROWS rows, a weight of x's dtype (or float8
    rows, with their scales) with unit stride along K, of at least
    MIN_WEIGHT elements."""
    return (use_triton(x) and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dtype in (x.dtype, FP8)
            and x.dtype in DTYPES and weight.dim() == 2 and weight.stride(-1) == 1 and x.stride(-1) == 1
            and weight.numel() >= MIN_WEIGHT)


def config_for(rows: int, n: int, k: int, norm: bool = False, silu: bool = False, fp8: bool = False,
               half: bool = False) -> GemvConfig:
    """A fixed tiling from the shape (no autotuning: launches stay the same
    from run to run and capturable), the fastest of a sweep of Orpheus-3B's
    projections (`scripts/bench_gemv.py`, on an H100).

    One row: a projection of a hidden-wide output runs a few programs a
    multiprocessor, each walking narrow blocks of columns in K steps of up
    to 4,096 with the next step's weight loaded ahead, so that its loads run back
    to back (plain: 2 columns, 4 per multiprocessor; with the norm ahead,
    whose statistics each program then takes once: 4 columns, 2 per
    multiprocessor). The merged gate/up (two weight streams a program) keeps
    a program per block of 2 columns, its statistics in one pass over K. A
    vocabulary's head has programs enough to fill the GPU in blocks of 1,024.
    More rows: narrower K blocks, whose products take registers. float8
    weights at one row: the merged gate/up of half-precision rows (`half`:
    bf16 or float16 x) on the tensor cores (`gemv_mma.py`) in blocks of 32
    columns; the rest on CUDA cores, a program a block of 8 columns with K
    in one step (their conversion to float32, not their bytes, sets the
    pace)."""
    whole_k = block_size(k)
    if fp8 and rows == 1 and n < HEAD_WIDTH and silu and half:  # tensor cores: the fastest of
        # `bench_gemv.py --fp8 --mma 1`'s sweep (H100) for the merged gate/up, against ~1.2x its time on CUDA cores
        return GemvConfig(block_n=32, block_k=max(16, min(256, whole_k)), num_warps=4, num_stages=3, mma=True)
    if fp8 and rows == 1 and n < HEAD_WIDTH:  # the fastest of `bench_gemv.py --fp8`'s sweep (H100)
        if silu:
            return GemvConfig(block_n=4, block_k=min(1024, whole_k), num_warps=4, programs_per_sm=4, prefetch=True,
                              stats_block=min(4096, whole_k))
        # a program a block of 8 columns, K in one step: faster than the tensor cores for qkv (10.2 against
        # 11.3 us) and than programs walking several blocks for o and down
        return GemvConfig(block_n=8, block_k=min(4096, whole_k), num_warps=8)
    if rows == 1 and n < HEAD_WIDTH:
        if silu:
            return GemvConfig(block_n=2, block_k=min(1024, whole_k), num_warps=4, prefetch=True,
                              stats_block=min(4096, whole_k))
        if norm:
            return GemvConfig(block_n=4, block_k=min(4096, whole_k), num_warps=8, programs_per_sm=2, prefetch=True)
        return GemvConfig(block_n=2, block_k=min(4096, whole_k), num_warps=4, programs_per_sm=4, prefetch=True)
    plain = not norm and n < HEAD_WIDTH
    block_k = (2048 if k >= 8192 else 1024) * (2 if plain else 1) // block_size(rows)
    return GemvConfig(block_n=4, block_k=max(16, min(block_k, whole_k)), num_warps=8 if plain else 4)


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T, no bias; `weight_scale` [N]: the weight is
    float8 rows, each times its scale."""
    return _launch(x, None, None, 0.0, False, weight, weight_scale, False, config)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, *, centered: bool = False, silu: bool = False,
                config: GemvConfig | None = None,
                weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(projection of rmsnorm(x + residual), x + residual); residual None:
    the norm of x itself, and x comes back as the stream. With `silu` the
    weight is gate and up stacked [2I, K] and the output silu(gate) * up;
    with `weight_scale` [N] it is float8 rows, each times its scale."""
    if use_triton(x):
        return _launch(x, residual, norm_weight, eps, centered, weight, weight_scale, silu, config)
    return norm_linear_reference(x, residual, norm_weight, eps, weight, centered=centered, silu=silu,
                                 weight_scale=weight_scale)


def norm_linear_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, *, centered: bool = False, silu: bool = False,
                          weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        normed, stream = rms_norm_reference(x, norm_weight, eps, centered), x
    else:
        normed, stream = fused_add_rms_norm_reference(x, residual, norm_weight, eps, centered)
    y = F.linear(normed, weight) if weight_scale is None else weight_only_reference(normed, weight, weight_scale)
    return (silu_and_mul_reference(y) if silu else y), stream


def weight_only_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times float8 weight rows [N, K] with their scales [N], as the
    kernel computes it: x as it is, the float8 weight, their products summed
    in float32, each column's sum times its row's scale, in x's dtype."""
    sums = x.float() @ weight.float().t()
    return (sums * weight_scale.reshape(1, -1).float()).to(x.dtype)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
            centered: bool, weight: torch.Tensor, weight_scale: torch.Tensor | None, silu: bool,
            config: GemvConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    if not (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make a projection")
    fp8 = weight.dtype == FP8
    if fp8 != (weight_scale is not None) or (fp8 and weight_scale.numel() != weight.shape[0]):
        raise ValueError(f"a {weight.dtype} weight {tuple(weight.shape)} with scales "
                         f"{None if weight_scale is None else tuple(weight_scale.shape)}: float8 weights, and only "
                         f"they, take one scale per row")
    m, k = x.shape
    if m > KERNEL_ROWS:
        raise ValueError(f"{m} rows: the kernel takes at most {KERNEL_ROWS}")
    if silu and weight.shape[0] % 2:
        raise ValueError(f"a merged gate/up weight needs an even number of rows, got {weight.shape[0]}")
    if residual is not None and norm_weight is None:
        raise ValueError("a residual add comes with the norm after it (norm_linear)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    copied = weight.stride(-1) != 1
    weight = weight.contiguous() if copied else weight
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    out = (torch.empty if k else torch.zeros)(m, n, dtype=x.dtype, device=x.device)  # no K: a sum of nothing
    res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    stream = torch.empty_like(x) if res is not None else x
    cfg = config or config_for(m, n, k, norm_weight is not None, silu, fp8, x.dtype in gemv_mma.MMA_DTYPES)
    if m and n and k:
        norm = norm_weight is not None
        nw = norm_weight.contiguous() if norm_weight is not None else None
        scale = weight_scale.reshape(-1).float() if weight_scale is not None else None
        # a weight copied by the kernel just before is read only after the wait: no dependent launch then
        pdl = cfg.pdl and not copied and dependent_launch(x)
        if cfg.mma:
            if scale is None:
                raise ValueError(f"{cfg}: the tensor-core kernel takes float8 weights, got {weight.dtype}")
            gemv_mma.launch(x, res, nw, eps, centered, weight, scale, silu, out, stream, cfg.block_n, cfg.block_k,
                            cfg.stats_block or min(block_size(k), MMA_STATS_BLOCK), cfg.num_warps, cfg.num_stages,
                            pdl)
            return out, stream
        _gemv_kernel[(_programs(x.device, cdiv(n, cfg.block_n), cfg.programs_per_sm),)](
            x, res if res is not None else x, nw if nw is not None else x, weight, scale if scale is not None else x,
            out, stream,
            m, n, k, x.stride(0), res.stride(0) if res is not None else 0, weight.stride(0), out.stride(0),
            stream.stride(0), n if silu else 0, eps,
            ROWS=block_size(m), NORM=norm, RESIDUAL=res is not None, CENTERED=centered, SILU=silu, FP8=fp8,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STATS_BLOCK=cfg.stats_block or cfg.block_k, PDL=pdl,
            PREFETCH=cfg.prefetch,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **({"launch_pdl": True} if pdl else {}))
    return out, stream


def _programs(device: torch.device, blocks: int, per_sm: int) -> int:
    """The grid: a program per block of columns, or about `per_sm` a multiprocessor, sharing the blocks evenly."""
    if not per_sm:
        return blocks
    return cdiv(blocks, cdiv(blocks, _multiprocessors(device) * per_sm))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # the interpreter runs programs one by one on the CPU: one "multiprocessor" gives each program several blocks
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@jit
def _products(acc, acc_up, xs, w, wu, SILU: tl.constexpr):
    """The accumulators with a K block's products added: the rows times the weight block (and its up half)."""
    acc += tl.sum(xs[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SILU:
        acc_up += tl.sum(xs[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
    return acc, acc_up


@jit(any_value=("m",))
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, ws_ptr, out_ptr, stream_ptr, m, n, k,
                 stride_x, stride_r, stride_w, stride_out, stride_stream, up_rows, eps,
                 ROWS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, CENTERED: tl.constexpr,
                 SILU: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STATS_BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    # program p owns the blocks of columns p, p + G, p + 2G, ... (G programs), walked as one loop over
    # (block, K step): the weight's loads run on from one block into the next, and the norm's statistics are
    # taken once per program. With PREFETCH each step issues the next step's weight loads before its products.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    k_steps = tl.cdiv(k, BLOCK_K)
    steps = tl.cdiv(tl.cdiv(n, BLOCK_N) - pid, programs) * k_steps
    rows = tl.arange(0, ROWS)
    row_mask = rows < m
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    # the up half's offset in 64 bits: I x K passes 2**31 elements in a wide enough MLP
    up_offset = up_rows.to(tl.int64) * stride_w
    if PDL or PREFETCH:
        # the first block of the weight (under PDL while the kernel before ends; its output, x and the
        # residual, only after the wait)
        cols = pid * BLOCK_N + offs_n
        first_mask = (cols < n)[:, None] & (offs_k < k)[None, :]
        if PREFETCH:
            w_cur, wu_cur = weight_block(w_ptr, stride_w, up_offset, cols, offs_k, first_mask, SILU)
        else:
            w_first, wu_first = weight_block(w_ptr, stride_w, up_offset, cols, offs_k, first_mask, SILU)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:
        # the rows' statistics first: every program reads the few rows of x (from cache after the first)
        sq = tl.zeros([ROWS], dtype=tl.float32)
        offs_s = tl.arange(0, STATS_BLOCK)
        for k0 in range(0, k, STATS_BLOCK):
            kk = k0 + offs_s
            mask = row_mask[:, None] & (kk < k)[None, :]
            xs = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0).to(tl.float32)
            if RESIDUAL:
                rs = tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0).to(tl.float32)
                summed = (xs + rs).to(dtype)
                # the stream after the add, written once, by the first program
                tl.store(stream_ptr + rows[:, None] * stride_stream + kk[None, :], summed, mask=mask & (pid == 0))
                xs = summed.to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        inv = tl.rsqrt(sq / k + eps)
    # each K block's products summed at once: accumulators of [ROWS, BLOCK_N] leave registers for wide blocks of
    # the weight in flight, which is what sets a few-row projection's speed
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if PDL and not PREFETCH:
        xs = input_block(x_ptr, r_ptr, nw_ptr, rows, row_mask, stride_x, stride_r, offs_k, offs_k < k, inv, dtype,
                         NORM, RESIDUAL, CENTERED)
        acc, acc_up = _products(acc, acc_up, xs, w_first, wu_first, SILU)
        if k_steps == 1:
            cols = pid * BLOCK_N + offs_n
            store_block(out_ptr, acc, acc_up, rows, row_mask, cols, cols < n, stride_out, ws_ptr, up_rows,
                        dtype, SILU, FP8)
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for step in range(1 if PDL and not PREFETCH else 0, steps):
        cols = (pid + (step // k_steps) * programs) * BLOCK_N + offs_n
        col_mask = cols < n
        kk = (step % k_steps) * BLOCK_K + offs_k
        k_mask = kk < k
        if PREFETCH:
            ahead = step + 1
            cols_ahead = (pid + (ahead // k_steps) * programs) * BLOCK_N + offs_n
            kk_ahead = (ahead % k_steps) * BLOCK_K + offs_k
            w_next, wu_next = weight_block(w_ptr, stride_w, up_offset, cols_ahead, kk_ahead,
                                           (cols_ahead < n)[:, None] & (kk_ahead < k)[None, :] & (ahead < steps),
                                           SILU)
        else:
            w_cur, wu_cur = weight_block(w_ptr, stride_w, up_offset, cols, kk, col_mask[:, None] & k_mask[None, :],
                                         SILU)
        xs = input_block(x_ptr, r_ptr, nw_ptr, rows, row_mask, stride_x, stride_r, kk, k_mask, inv, dtype,
                         NORM, RESIDUAL, CENTERED)
        acc, acc_up = _products(acc, acc_up, xs, w_cur, wu_cur, SILU)
        if PREFETCH:
            w_cur = w_next
            wu_cur = wu_next
        if step % k_steps == k_steps - 1:
            store_block(out_ptr, acc, acc_up, rows, row_mask, cols, col_mask, stride_out, ws_ptr, up_rows,
                        dtype, SILU, FP8)
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
