"""The kernel comparisons shared by the CPU tests (Triton's interpreter) and
the CUDA tests: random inputs on a device in, the Triton path checked against
the torch reference.

Inputs arrive the way the model produces them: hidden states as row views of
a wider tensor, q/k/v as strided views of one qkv projection, a cache
prefilled with noise so a write to a wrong slot shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from mstar.kernels import activation, head_norm_rope, moe, norm, qkv_store, quantize, rope_kv, router
from mstar.kernels.codec import codec_noise, snake, snake_unit

EPS = 1e-5


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """A kernel's outputs start as NaN: an element no program writes fails the comparison, even where the
    allocator hands back a block an earlier launch of the same shape filled correctly."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t
    with mock.patch.object(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw))), \
            mock.patch.object(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw))):
        yield


def tolerance(dtype: torch.dtype, interpreted: bool) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    # Triton's interpreter rounds fp32 -> bf16 toward zero, not to nearest:
    # with two roundings in a kernel its results can sit two ulps off
    return {"atol": 2e-2, "rtol": 3e-2} if interpreted else {"atol": 1e-2, "rtol": 1.6e-2}


def _rows(gen: torch.Generator, t: int, h: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[t, h] as a row view of a [t, h + 8] tensor (a stride the kernels must honour)."""
    return torch.randn(t, h + 8, generator=gen).to(device=device, dtype=dtype)[:, 4:4 + h]


def check_rms_norm(t: int, h: int, dtype: torch.dtype, device: str, interpreted: bool, centered: bool = False) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x = _rows(gen, t, h, dtype, device) * 3
    weight = (1 + 0.5 * torch.randn(h, generator=gen)).to(device=device, dtype=dtype)
    got = norm.rms_norm_triton(x, weight, EPS, centered)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, norm.rms_norm_reference(x, weight, EPS, centered), **tolerance(dtype, interpreted))


def check_quantize_rows(m: int, k: int, dtype: torch.dtype, device: str, interpreted: bool) -> None:
    """The same scales as the reference, and the same fp8 values bit for bit on CUDA. Triton's interpreter
    casts to float8 with its own rounding (7.78 -> 4.0, 10.5 -> 11.0), so there each value need only hold
    the reference's sign and be within a factor of two of it: enough to show every element lands where it
    belongs."""
    gen = torch.Generator().manual_seed(m * 10 + k)
    x = (_rows(gen, m, k, torch.float32, "cpu") * torch.logspace(-3, 3, m)[:, None]).to(device=device, dtype=dtype)
    x[0, : k // 2] = 0.0   # zeros beside the row's values
    padded = -(-m // 16) * 16   # rows past m: zeros with scale 1, as the torch form pads them
    q, scale = quantize.quantize_rows_triton(x, padded)
    assert q.dtype == quantize.FP8 and q.shape == (padded, k) and scale.shape == (padded, 1)
    assert not q[m:].float().any() and (scale[m:] == 1).all()
    q, scale = q[:m], scale[:m]
    q_ref, scale_ref = quantize.quantize_rows_reference(x)
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=0)
    if interpreted:
        got, want = q.float(), q_ref.float()
        assert torch.equal(torch.sign(got), torch.sign(want))
        assert ((got.abs() <= want.abs() * 2) & (got.abs() * 2 >= want.abs())).all()
    else:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def check_qkv_norm_rope_store(t: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                              device: str, interpreted: bool) -> None:
    """q out and k, v into the cache, as the reference computes them: into a
    paged cache at given slots, and into dense per-row buffers at `start`
    (rows of 1 and of 2 new tokens); nothing else in the caches moves."""
    gen = torch.Generator().manual_seed(t * 1000 + heads * 100 + kv_heads * 10 + d)
    width = (heads + 2 * kv_heads) * d
    qkv = (torch.randn(t, width + 8, generator=gen) * 3).to(device=device, dtype=dtype)[:, 8:]  # a row view
    qw, kw = ((1 + 0.5 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype) for _ in range(2))
    angles = torch.rand(t, d // 2, generator=gen) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device) for f in (torch.cos, torch.sin))
    tol = tolerance(dtype, interpreted) if cache_dtype == dtype else {"atol": 3e-2, "rtol": 3e-2}
    if cache_dtype == torch.float8_e4m3fn:   # a last-bit difference in k's rounding may carry one e4m3 step
        tol = {"atol": 2 ** -3, "rtol": 2 ** -3}

    def caches(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(n, kv_heads, d, generator=gen).to(device=device, dtype=cache_dtype) for _ in "kv")

    slots = torch.randperm(4 * t + 8, generator=gen)[:t].to(device)
    dests = [lambda k, v: qkv_store.KVDest(k, v, slots=slots)]
    for new in (1, 2):
        if t % new == 0:
            dests.append(lambda k, v, new=new: qkv_store.KVDest(k, v, new=new, start=1, capacity=new + 3))
    for make in dests:
        k_got, v_got = caches(4 * t + 8)
        k_want, v_want = k_got.clone(), v_got.clone()
        noise = k_got.clone()
        got = qkv_store.qkv_norm_rope_store_triton(qkv, heads, kv_heads, qw, kw, cos, sin, EPS, make(k_got, v_got))
        want = qkv_store.qkv_norm_rope_store_reference(qkv, heads, kv_heads, qw, kw, cos, sin, EPS,
                                                       make(k_want, v_want))
        assert got.dtype == dtype and got.shape == (t, heads, d)
        torch.testing.assert_close(got, want, **tolerance(dtype, interpreted))
        torch.testing.assert_close(k_got.float(), k_want.float(), **tol)
        torch.testing.assert_close(v_got.float(), v_want.float(), atol=0, rtol=0)
        written = make(k_got, v_got).rows(t, torch.device(device))
        assert written.unique().numel() == t and not torch.equal(k_got.float()[written], noise.float()[written])


def check_head_norm_rope(t: int, heads: int, d: int, dtype: torch.dtype, device: str, interpreted: bool) -> None:
    """Per-head RMSNorm then rotate-half rotary at each token's own angles,
    as the unfused ops compute it."""
    gen = torch.Generator().manual_seed(t * 100 + heads * 10 + d)
    x = (torch.randn(t, heads, d, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    angles = torch.rand(t, d // 2, generator=gen) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device) for f in (torch.cos, torch.sin))
    got = head_norm_rope.head_norm_rope_triton(x, weight, cos, sin, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    want = head_norm_rope.head_norm_rope_reference(x, weight, cos, sin, EPS)
    torch.testing.assert_close(got, want, **tolerance(dtype, interpreted))
    # the rotation alone (`rope`: code2wav's transformer)
    torch.testing.assert_close(head_norm_rope.head_norm_rope_triton(x, None, cos, sin, 0.0),
                               head_norm_rope.rope_reference(x, cos, sin), **tolerance(dtype, interpreted))
    # heads sliced out of a wider row (a qkv projection's q block): read in place
    wide = torch.cat([x.reshape(t, -1), torch.randn(t, 2 * d, generator=gen).to(device=device, dtype=dtype)], -1)
    sliced = wide[:, :heads * d].view(t, heads, d)
    assert t == 1 or not sliced.is_contiguous()
    torch.testing.assert_close(head_norm_rope.head_norm_rope_triton(sliced, weight, cos, sin, EPS), got, atol=0, rtol=0)
    # every token at one angle, the table's row expanded (token stride 0), as a frame's step gives it
    one_cos, one_sin = cos[:1].expand(t, -1), sin[:1].expand(t, -1)
    got = head_norm_rope.head_norm_rope_triton(x, weight, one_cos, one_sin, EPS)
    want = head_norm_rope.head_norm_rope_reference(x, weight, one_cos.contiguous(), one_sin.contiguous(), EPS)
    torch.testing.assert_close(got, want, **tolerance(dtype, interpreted))


def check_fused_add_rms_norm(t: int, h: int, dtype: torch.dtype, device: str, interpreted: bool,
                             centered: bool = False) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + h + 1)
    x = _rows(gen, t, h, dtype, device)
    residual = _rows(gen, t, h, dtype, device) * 4
    weight = (1 + 0.5 * torch.randn(h, generator=gen)).to(device=device, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = norm.fused_add_rms_norm_triton(x, residual, weight, EPS, centered)
    ref_normed, ref_summed = norm.fused_add_rms_norm_reference(x, residual, weight, EPS, centered)
    tol = tolerance(dtype, interpreted)
    torch.testing.assert_close(summed, ref_summed, **tol)
    torch.testing.assert_close(normed, ref_normed, **tol)
    # out of place: the caller's stream is not overwritten
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def check_silu_and_mul(t: int, inter: int, dtype: torch.dtype, device: str, interpreted: bool) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + inter)
    gate_up = _rows(gen, t, 2 * inter, dtype, device) * 3
    got = activation.silu_and_mul_triton(gate_up)
    assert got.shape == (t, inter) and got.dtype == dtype
    torch.testing.assert_close(got, activation.silu_and_mul_reference(gate_up), **tolerance(dtype, interpreted))


def check_snake(b: int, c: int, t: int, dtype: torch.dtype, device: str) -> None:
    """Against the float32 reference on the same (rounded) inputs: the kernel
    computes in float32 and rounds once."""
    gen = torch.Generator().manual_seed(b * 10_000 + c * 100 + t)
    x = (torch.randn(b, c, t, generator=gen) * 2).to(device=device, dtype=dtype)
    alpha = (0.2 + torch.rand(1, c, 1, generator=gen) * 3).to(device=device, dtype=dtype)
    got = snake.snake_triton(x, alpha)
    assert got.shape == x.shape and got.dtype == dtype
    want = snake.snake_reference(x.float(), alpha.float())
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 2e-3}
    torch.testing.assert_close(got.float(), want, **tol)


def check_snake_beta(b: int, c: int, t: int, dtype: torch.dtype, device: str) -> None:
    """SnakeBeta (frequency and magnitude apart) against the float32
    reference on the same rounded inputs."""
    gen = torch.Generator().manual_seed(b * 10_000 + c * 100 + t + 7)
    x = (torch.randn(b, c, t, generator=gen) * 2).to(device=device, dtype=dtype)
    freq, magnitude = ((0.2 + torch.rand(1, c, 1, generator=gen) * 3).to(device=device, dtype=dtype) for _ in "fm")
    with torch.no_grad():  # under autograd snake_beta keeps torch's expression; this checks the kernel
        got = snake.snake_beta(x, freq, magnitude, 1e-9) if device != "cpu" else snake._launch(
            x, freq, magnitude, 1e-9, "snake_beta")
    assert got.shape == x.shape and got.dtype == dtype
    want = snake.snake_beta_reference(x.float(), freq.float(), magnitude.float(), 1e-9)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}
    torch.testing.assert_close(got.float(), want, **tol)


def check_snake_beta_held(b: int, c: int, t: int, reach: int, masked: bool, dtype: torch.dtype, device: str) -> None:
    """The held samples, then SnakeBeta of the new ones zeroed outside `keep`:
    the held part and the zeros exact, the activation against the float32
    reference on the same rounded inputs."""
    gen = torch.Generator().manual_seed(b * 10_000 + c * 100 + t + reach)
    x = (torch.randn(b, c, t, generator=gen) * 2).to(device=device, dtype=dtype)
    held = torch.randn(b, c, reach, generator=gen).to(device=device, dtype=dtype)
    freq, magnitude = ((0.2 + torch.rand(1, c, 1, generator=gen) * 3).to(device=device, dtype=dtype) for _ in "fm")
    keep = (torch.rand(b, t, generator=gen) > 0.3).to(device) if masked else None
    with torch.no_grad():
        got = snake.snake_beta_held(x, freq, magnitude, 1e-9, held, keep) if device != "cpu" else snake._launch_held(
            x, freq, magnitude, 1e-9, held, keep)
    assert got.shape == (b, c, reach + t) and got.dtype == dtype
    assert torch.equal(got[..., :reach], held)
    want = snake.snake_beta_reference(x.float(), freq.float(), magnitude.float(), 1e-9)
    if keep is not None:
        assert bool((got[..., reach:].masked_select(~keep[:, None, :]) == 0).all())
        want = want.masked_fill(~keep[:, None, :], 0.0)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}
    torch.testing.assert_close(got[..., reach:].float(), want, **tol)


def check_snake_dwconv(b: int, c: int, t: int, dilation: int, dtype: torch.dtype, device: str) -> None:
    """Snake then SNAC's depthwise conv (kernel 7, `dilation`, length kept),
    against the float32 reference on the same rounded inputs; edges included."""
    gen = torch.Generator().manual_seed(b * 10_000 + c * 100 + t + dilation)
    x = (torch.randn(b, c, t, generator=gen) * 2).to(device=device, dtype=dtype)
    alpha = (0.2 + torch.rand(1, c, 1, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = (torch.randn(c, 1, 7, generator=gen) * 0.3).to(device=device, dtype=dtype)
    bias = torch.randn(c, generator=gen).to(device=device, dtype=dtype)
    got = snake.snake_dwconv_triton(x, alpha, weight, bias, dilation)
    assert got.shape == x.shape and got.dtype == dtype
    want = snake.snake_dwconv_reference(x.float(), alpha.float(), weight.float(), bias.float(), dilation)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 4e-3}
    torch.testing.assert_close(got.float(), want, **tol)
    # output windows: inside, at either end, one sample, empty; each equal to the whole conv's outputs there
    for offset, width in {(t // 3, t // 3), (0, t // 2 + 1), (t - t // 2 - 1, t // 2 + 1), (t // 2, 1), (t, 0)}:
        part = snake.snake_dwconv_triton(x, alpha, weight, bias, dilation, offset, width)
        assert part.shape == (b, c, width)
        torch.testing.assert_close(part.float(), want[..., offset:offset + width], **tol)
        ref = snake.snake_dwconv_reference(x.float(), alpha.float(), weight.float(), bias.float(), dilation,
                                           offset, width)
        torch.testing.assert_close(ref, want[..., offset:offset + width], atol=1e-6, rtol=1e-6)


def check_snake_unit(b: int, c: int, t: int, dilation: int, dtype: torch.dtype, device: str) -> None:
    """A residual unit's fused halves against their float32 references on the
    same rounded inputs: the depthwise conv + second snake over output
    windows (inside, at either end), and the residual sum + next snake with
    and without bias, noise and the snake, x a view into a longer signal."""
    gen = torch.Generator().manual_seed(b * 10_000 + c * 100 + t + dilation)
    sx = (torch.randn(b, c, t, generator=gen) * 2).to(device=device, dtype=dtype)
    alpha = (0.2 + torch.rand(1, c, 1, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = (torch.randn(c, 1, 7, generator=gen) * 0.3).to(device=device, dtype=dtype)
    bias = torch.randn(c, generator=gen).to(device=device, dtype=dtype)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 4e-3}
    f32 = [a.float() for a in (sx, weight, bias, alpha)]
    whole = snake_unit.dwconv_snake_reference(*f32, dilation)
    for offset, width in {(0, t), (t // 3, t // 3), (0, t // 2 + 1), (t - t // 2 - 1, t // 2 + 1), (t, 0)}:
        got = snake_unit.dwconv_snake_triton(sx, weight, bias, alpha, dilation, offset, width)
        assert got.shape == (b, c, width) and got.dtype == dtype
        torch.testing.assert_close(got.float(), whole[..., offset:offset + width], **tol)
        want = snake_unit.dwconv_snake_reference(*f32, dilation, offset, width)
        torch.testing.assert_close(want, whole[..., offset:offset + width], atol=1e-6, rtol=1e-6)
    longer = (torch.randn(b, c, t + 5, generator=gen) * 2).to(device=device, dtype=dtype)
    x = longer[..., 3:3 + t]   # a span of a longer signal: rows strided, samples contiguous
    y = torch.randn(b, c, t, generator=gen).to(device=device, dtype=dtype)
    noise = torch.randn(b, 1, t, generator=gen).to(device=device, dtype=dtype)
    for with_bias, with_noise, with_snake in ((True, False, True), (False, True, True), (True, True, False)):
        args = (bias if with_bias else None, alpha if with_snake else None, noise if with_noise else None)
        out, snaked = snake_unit.residual_snake_triton(x, y, *args)
        ref_out, ref_snaked = snake_unit.residual_snake_reference(
            x.float(), y.float(), *(a.float() if a is not None else None for a in args))
        assert out.dtype == dtype and (snaked is None) == (not with_snake)
        torch.testing.assert_close(out.float(), ref_out, **tol)
        if with_snake:
            torch.testing.assert_close(snaked.float(), ref_snaked, **tol)


def check_codec_noise(rows: int, length: int, start: int, dtype: torch.dtype, device: str) -> None:
    """SNAC's seeded normals: the kernel's hash is the reference's bit for bit
    (negative and 64-bit seeds, a column offset), its float32 Box-Muller
    within an ulp or two of torch's, one rounding to `dtype`."""
    seeds = torch.tensor([0, 1, -7, 2**40 + 3, -(2**62), 12345][:rows] * (rows // 6 + 1))[:rows].to(device)
    for block in (0, 3):
        got = codec_noise.seeded_normal_triton(seeds, block, length, start, dtype)
        want = codec_noise.seeded_normal_reference(seeds, block, length, start)
        assert got.shape == (rows, length) and got.dtype == dtype
        tol = {"atol": 4e-6, "rtol": 4e-6} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 1e-3}
        torch.testing.assert_close(got.float(), want, **tol)


def check_rope_and_store(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                         device: str, interpreted: bool) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + hq * 100 + hkv * 10 + d)
    page, max_pos = 4, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    angles = torch.rand(max_pos, d, generator=gen) * 6.3
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    num_pages = (t + page - 1) // page + 2
    slots = torch.randperm(num_pages * page, generator=gen)[:t].to(device)
    k_cache = torch.randn(num_pages, page, hkv, d, generator=gen).to(device=device, dtype=cache_dtype)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=gen).to(device=device, dtype=cache_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()

    got_q = rope_kv.rope_and_store_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    ref_q = rope_kv.rope_and_store_reference(q, k, v, cos, sin, positions, ref_k, ref_v, slots)
    assert got_q.shape == q.shape and got_q.dtype == dtype
    torch.testing.assert_close(got_q, ref_q, **tolerance(dtype, interpreted))
    # k is rounded to its own dtype, then the cache's: bf16 spacing if either is bf16
    narrowest = torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) else torch.float32
    torch.testing.assert_close(k_cache, ref_k, **tolerance(narrowest, interpreted))
    # v is a plain cast: exact but for the interpreter's rounding toward zero
    v_tol = tolerance(narrowest, interpreted) if interpreted else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(v_cache, ref_v, **v_tol)


def moe_routing(gen: torch.Generator, t: int, e: int, k: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct experts [t, k] and weights [t, k] summing to 1,
    on the generator's device. Skewed: every token picks expert 0 (its run
    spans several blocks once t passes a block) and none picks the last;
    else uniform, as random weights route."""
    scores = torch.rand(t, e, generator=gen, device=gen.device)
    if skewed:
        scores[:, 0], scores[:, -1] = 2.0, -1.0
    top, experts = scores.topk(k, dim=-1)
    return experts, torch.softmax(top * 4, dim=-1)


# the real routed-expert shapes (hidden, intermediate, experts, top k)
MOE_SHAPES = {"thinker": (2048, 768, 128, 8), "talker": (1024, 384, 128, 6)}


def moe_inputs(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, device: str, skewed: bool,
               seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x [t, h] (a row view of a wider tensor), gate_up [e, 2I, h] and down
    [e, h, I] scaled so every stage's values are O(1), and a routing; drawn
    on `device` (real shapes hold a billion weights)."""
    gen = torch.Generator(device).manual_seed(seed + t * 1000 + h + inter + e * 7 + k)
    x = torch.randn(t, h + 8, generator=gen, device=device).to(dtype)[:, 4:4 + h]
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen, device=device) * h ** -0.5).to(dtype)
    down = (torch.randn(e, h, inter, generator=gen, device=device) * inter ** -0.5).to(dtype)
    experts, weights = moe_routing(gen, t, e, k, skewed)
    return x, gate_up, down, experts, weights.to(dtype)


def check_fused_moe(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, device: str, interpreted: bool,
                    skewed: bool = True, tiles: moe.MoeTiles | None = None) -> None:
    x, gate_up, down, experts, weights = moe_inputs(t, h, inter, e, k, dtype, device, skewed)
    got = moe.fused_moe_triton(x, gate_up, down, experts, weights, tiles)
    assert got.shape == (t, h) and got.dtype == dtype
    want = moe.fused_moe_reference(x, gate_up, down, experts, weights)
    assert want.abs().mean() > 0.1  # a kernel that drops experts cannot pass as small numbers
    torch.testing.assert_close(got, want, **tolerance(dtype, interpreted))


def check_moe_align(t: int, e: int, k: int, block_m: int, device: str, skewed: bool) -> None:
    """The align step's layout against a stable sort: each expert's rows in
    token order from a block boundary, padded to a whole block with the
    n_slots sentinel, and the expert of every block in use."""
    gen = torch.Generator(device).manual_seed(t * 100 + e + block_m)
    experts, _ = moe_routing(gen, t, e, k, skewed)
    slots, block_expert, used = moe.align_blocks(experts.reshape(-1), t * k, e, block_m)
    experts, slots, block_expert, used = experts.cpu(), slots.cpu(), block_expert.cpu(), int(used.item())
    counts = torch.bincount(experts.reshape(-1), minlength=e)
    runs = (counts + block_m - 1) // block_m * block_m
    assert used == int(runs.sum())
    start = 0
    for expert in range(e):
        n, run = int(counts[expert]), int(runs[expert])
        want = (experts.reshape(-1) == expert).nonzero().flatten()  # flat indices in token order
        assert torch.equal(slots[start:start + n].long(), want), f"expert {expert}'s rows"
        assert (slots[start + n:start + run] == t * k).all(), f"expert {expert}'s padding"
        assert (block_expert[start // block_m:(start + run) // block_m] == expert).all()
        start += run


def same_on_replay(make_inputs: Callable[[], list[torch.Tensor]],
                   op: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
    """Capture `op` in a CUDA graph on static inputs, refill them with new
    values, replay, and compare with an eager run on the new values."""
    static = make_inputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(*static)  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static)
    fresh = make_inputs()
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    expect = op(*fresh)
    outs = out if isinstance(out, tuple) else (out,)
    expects = expect if isinstance(expect, tuple) else (expect,)
    for o, e in zip(outs, expects):
        torch.testing.assert_close(o, e, atol=0, rtol=0)


def check_route_top_k(tokens: int, experts: int, k: int, renormalize: bool, dtype: torch.dtype, device: str) -> None:
    """The kernel picks the reference's experts, in its order (most likely
    first), and weights within a float32 rounding of its (at most one step
    of `dtype` apart, where a rounding boundary falls between them)."""
    gen = torch.Generator().manual_seed(tokens * 1000 + experts + k)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(device=device, dtype=dtype)
    got_experts, got_weights = router.route_top_k_triton(logits, k, renormalize, dtype)
    _, want_weights = router.route_top_k_reference(logits, k, renormalize, dtype)
    # torch.topk orders equal probabilities as it likes (on CUDA not by index); the kernel takes the lower
    # index first, as a stable sort does: the experts to expect (bf16 logits tie often)
    want_experts = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True, stable=True)[1][:, :k]
    assert got_experts.dtype == torch.int64 and got_weights.dtype == dtype
    assert got_experts.cpu().tolist() == want_experts.cpu().tolist()
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 8e-3}
    torch.testing.assert_close(got_weights.float(), want_weights.float(), **tol)
    if renormalize:
        summed = {"atol": 1e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}
        torch.testing.assert_close(got_weights.float().sum(-1), torch.ones(tokens, device=device), **summed)
