"""Qwen3.5's Triton kernels against their torch references: the gated delta
net's decode steps (`kernels.delta_step`), its gated norm, and the gated
attention's centred per-head norm with partial rotary; on CPU tensors
through Triton's interpreter at toy shapes, and on CUDA at Qwen3.5-9B's
shapes (the GPU machine), where the delta steps must also replay unchanged
under a CUDA graph.

Inputs arrive as the model makes them: q, k and v as column views of the
conv's output, the state as one layer's view of [slots, layers, ...], the
rows' slots out of order, every other slot filled with noise that must stay
as it was.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import same_on_replay, tolerance

from mstar.kernels import delta_rule, delta_step, head_norm_rope, norm
from mstar.kernels.backend import HAVE_TRITON

LAYERS, LAYER = 3, 1
TOY = {"hk": 2, "hv": 4, "dk": 16, "dv": 24}
QWEN35_9B = {"hk": 16, "hv": 32, "dk": 128, "dv": 128}


def _devices() -> list:
    interpreted = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
    return [pytest.param("cpu", marks=pytest.mark.skipif(not interpreted, reason="needs TRITON_INTERPRET=1")),
            pytest.param("cuda", marks=pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON),
                                                          reason="needs CUDA (runs on the GPU machine)"))]


def _case(device: str, rows: int, dtype: torch.dtype, seed: int, shape: dict) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    key, value = hk * dk, hv * dv
    slots_total = rows + 3
    mixed = torch.randn(rows, 2 * key + value + 8, generator=gen)[:, 4:4 + 2 * key + value]

    def on(t: torch.Tensor, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return t.to(device=device, dtype=as_dtype)
    mixed = on(mixed)
    q, k, v = mixed.split((key, key, value), dim=-1)
    return {
        "mixed": mixed,
        "q": q.reshape(rows, hk, dk), "k": k.reshape(rows, hk, dk), "v": v.reshape(rows, hv, dv),
        "ab": on(torch.randn(rows, 2 * hv + 3, generator=gen) * 2),
        "a_log": on(torch.empty(hv).uniform_(0, 2.7, generator=gen)),
        "dt_bias": on(torch.randn(hv, generator=gen)),
        "conv_weight": on(torch.randn(2 * key + value, 1, 4, generator=gen) * 0.5),
        # past inputs, so exact in the activations' dtype
        "conv": on(on(torch.randn(slots_total, LAYERS, 2 * key + value, 3, generator=gen)), torch.float32),
        "rec": on(torch.randn(slots_total, LAYERS, hv, dk, dv, generator=gen) * 0.3, torch.float32),
        "slots": torch.randperm(slots_total, generator=gen)[:rows].to(device),
        "hv": hv,
    }


def _gates(c: dict, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b as column views of one projection's output; `interleaved`: every other column each."""
    hv = c["hv"]
    if interleaved:
        return c["ab"][:, 0:2 * hv:2], c["ab"][:, 1:2 * hv:2]
    return c["ab"][:, :hv], c["ab"][:, hv + 3:]


def _recurrent(c: dict, rec: torch.Tensor, reference: bool, interleaved: bool = False) -> torch.Tensor:
    a, b = _gates(c, interleaved)
    layer = rec[:, LAYER]
    if reference:
        starts = torch.arange(c["q"].shape[0] + 1)
        return delta_rule.delta_rule_rows_reference(c["q"], c["k"], c["v"], a, b, c["a_log"], c["dt_bias"],
                                                    layer, c["slots"], starts)
    return delta_step.recurrent_step(c["q"], c["k"], c["v"], a, b, c["a_log"], c["dt_bias"], layer, c["slots"],
                                     c["v"].dtype)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_recurrent_step(device: str, dtype: torch.dtype, rows: int) -> None:
    shape = TOY if device == "cpu" else QWEN35_9B
    c = _case(device, rows if device == "cpu" else rows * 13, dtype, rows, shape)
    want_rec, got_rec = c["rec"].clone(), c["rec"].clone()
    want = _recurrent(c, want_rec, reference=True)
    got = _recurrent(c, got_rec, reference=False)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tolerance(dtype, device == "cpu"))
    # the state is float32 either way; with bfloat16 inputs the write strength sigmoid(b) is rounded to
    # bfloat16 first, and one ulp of it apart (the interpreter rounds toward zero) moves an update by 2^-8
    state_tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 5e-3, "rtol": 1e-2}
    torch.testing.assert_close(got_rec, want_rec, **state_tol)
    assert not torch.equal(got_rec, c["rec"])
    # gate inputs whose heads are not adjacent (a column stride of 2) read right too
    twisted = c["rec"].clone()
    torch.testing.assert_close(_recurrent(c, twisted, reference=False, interleaved=True),
                               _recurrent(c, c["rec"].clone(), reference=True, interleaved=True),
                               **tolerance(dtype, device == "cpu"))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_conv_step(device: str, dtype: torch.dtype, rows: int) -> None:
    shape = TOY if device == "cpu" else QWEN35_9B
    c = _case(device, rows, dtype, 100 + rows, shape)
    x = c["mixed"]
    want_conv, got_conv = c["conv"].clone(), c["conv"].clone()
    want = delta_rule.causal_conv_rows_reference(x, c["conv_weight"], want_conv[:, LAYER], c["slots"],
                                                 torch.arange(rows + 1))
    got = delta_step.conv_step(x, c["conv_weight"], got_conv[:, LAYER], c["slots"])
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **tolerance(dtype, device == "cpu"))
    torch.testing.assert_close(got_conv, want_conv, atol=0, rtol=0)
    assert not torch.equal(got_conv, c["conv"])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    t, h, d = 5, 4, 128
    x = (torch.randn(t, h, d, generator=gen) * 3).to(device=device, dtype=dtype)
    z = torch.randn(t, h * d + 16, generator=gen).to(device=device, dtype=dtype)[:, 8:8 + h * d].reshape(t, h, d)
    weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    got = norm.gated_rms_norm_triton(x, z, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, norm.gated_rms_norm_reference(x, z, weight, 1e-6),
                               **tolerance(dtype, device == "cpu"))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("rounded", [False, True])
def test_centred_head_norm_with_partial_rotary(device: str, dtype: torch.dtype, t: int, rounded: bool) -> None:
    """The gated attention's queries: each head's [query | gate] in one row of the projection, the query read
    in place (head stride 2D), centred-normed, its first R = D / 4 dims rotated, the rest passed through;
    `rounded`: the rotation as transformers' Qwen3.5 computes it in the activations' dtype, bit for bit."""
    gen = torch.Generator().manual_seed(t)
    heads, d = (4, 32) if device == "cpu" else (16, 256)
    r = d // 4
    rows = (torch.randn(t, heads, 2 * d, generator=gen) * 3).to(device=device, dtype=dtype)
    x = rows[..., :d]
    weight = (0.5 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    angles = torch.rand(t, r // 2, generator=gen) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device) for f in (torch.cos, torch.sin))
    got = head_norm_rope.head_norm_rope_triton(x, weight, cos, sin, 1e-6, centered=True, rounded=rounded)
    want = head_norm_rope.head_norm_rope_reference(x, weight, cos, sin, 1e-6, centered=True, rounded=rounded)
    if rounded:  # transformers' apply_rotary_pos_emb: products and sum in x's dtype, cos/sin cast to it
        normed = norm.rms_norm_reference(x, weight, 1e-6, centered=True)
        c, s = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
        part = normed[..., :r]
        turned = part * c + torch.cat([-part[..., r // 2:], part[..., :r // 2]], -1) * s
        assert torch.equal(want, torch.cat([turned, normed[..., r:]], -1))
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **tolerance(dtype, device == "cpu"))
    # past R the normed value as it is: the reference's norm alone
    torch.testing.assert_close(got[..., r:], norm.rms_norm_reference(x, weight, 1e-6, centered=True)[..., r:],
                               **tolerance(dtype, device == "cpu"))


@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA (runs on the GPU machine)")
def test_decode_steps_replay_under_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs (new slots too): what an eager call on them gives, state included."""
    seeds = iter(range(1000))

    def inputs() -> list[torch.Tensor]:
        c = _case("cuda", 64, torch.bfloat16, next(seeds), QWEN35_9B)
        a, b = _gates(c)
        return [c["mixed"], a.contiguous(), b.contiguous(), c["a_log"], c["dt_bias"], c["conv_weight"],
                c["conv"], c["rec"], c["slots"]]

    def step(mixed, a, b, a_log, dt_bias, weight, conv, rec, slots) -> tuple[torch.Tensor, ...]:
        key, value = 16 * 128, 32 * 128
        x = delta_step.conv_step(mixed, weight, conv[:, LAYER], slots)
        q, k, v = x.split((key, key, value), dim=-1)
        out = delta_step.recurrent_step(q.reshape(-1, 16, 128), k.reshape(-1, 16, 128), v.reshape(-1, 32, 128),
                                        a, b, a_log, dt_bias, rec[:, LAYER], slots, torch.bfloat16)
        return out, conv.clone(), rec.clone()
    same_on_replay(inputs, step)


@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON and delta_rule.fla_chunk() is not None),
                    reason="needs CUDA and fla-core (gpu_check.sh qwen35 installs it after the other GPU tests)")
def test_prompt_rows_through_fla_core() -> None:
    """A mixed step's rows (decode rows of one token beside prompts of up to 300) in bfloat16 through fla's
    chunked kernel, from and back into their slots: the torch form's outputs and states."""
    lengths = [1, 17, 64, 1, 300]
    gen = torch.Generator().manual_seed(3)
    shape = QWEN35_9B
    c = _case("cuda", sum(lengths), torch.bfloat16, 11, shape)
    rows = len(lengths)
    slots = torch.randperm(c["rec"].shape[0], generator=gen)[:rows].to("cuda")
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    a, b = _gates(c)
    want_rec, got_rec = c["rec"].clone(), c["rec"].clone()
    want = delta_rule.delta_rule_rows_reference(c["q"], c["k"], c["v"], a, b, c["a_log"], c["dt_bias"],
                                                want_rec[:, LAYER], slots, starts)
    got = delta_rule.delta_rule_rows(c["q"], c["k"], c["v"], a, b, c["a_log"], c["dt_bias"], got_rec[:, LAYER],
                                     slots, starts)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fla normalises q and k into bfloat16 and multiplies in bfloat16 where the torch form stays in float32
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_rec, want_rec, atol=2e-2, rtol=2e-2)
