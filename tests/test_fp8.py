"""`--quantization fp8` on the CPU reference: row quantization's error,
fp8 projections against the full-precision product, which modules turn
(projections, not the LM head or embeddings), and a served model whose
logits stay close to the unquantized ones."""

from __future__ import annotations

import pytest
import torch
from greedy_top5 import greedy_top5

from mstar.config import EngineConfig
from mstar.models.layers import Linear, VocabHead, quantize_linears
from mstar.kernels.quantize import FP8, FP8_MAX, quantize_rows
from mstar.models.layers.fp8 import fp8_linear, quantize_weight


def test_rows_quantize_within_e4m3s_step():
    x = torch.randn(7, 256) * torch.logspace(-3, 3, 7)[:, None]   # rows of very different sizes
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (7, 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((7,), FP8_MAX))  # each row's largest maps to 448
    back = q.float() * scale
    big = x.abs() > x.abs().amax(1, keepdim=True) / 64   # e4m3's relative step 2^-4 holds away from subnormals
    assert ((back - x).abs()[big] <= x.abs()[big] * 2 ** -4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_projection_is_close_to_the_full_one(dtype):
    torch.manual_seed(0)
    lin = Linear(128, 64, bias=True, dtype=dtype)
    lin.weight.data.normal_(0, 0.05)
    lin.bias.data.normal_(0, 0.1)
    x = torch.randn(5, 3, 128, dtype=dtype)
    full = lin(x).float()
    assert quantize_linears(lin) == 0   # not under a decoder's `layers`
    quantize_weight(lin)
    assert lin.weight.dtype == FP8 and lin.weight_scale.shape == (64,)
    got = lin(x)
    assert got.dtype == dtype and got.shape == (5, 3, 64)
    rel = (got.float() - full).norm() / full.norm()
    assert rel < 0.05, rel
    # the layer's path is the function's
    torch.testing.assert_close(got, fp8_linear(x, lin.weight, lin.weight_scale, lin.bias))


def test_only_projections_turn():
    from mstar.models.registry import load_model
    model = load_model("tiny-llama")
    decoder = model.build_component("llm", torch.device("cpu"), torch.float32)
    n = quantize_linears(decoder)
    layers = len(decoder.layers)
    assert n == 4 * layers   # qkv, o, gate_up, down
    assert isinstance(decoder.lm_head, VocabHead) and decoder.lm_head.weight.dtype == torch.float32
    assert decoder.embed_tokens.weight.dtype == torch.float32
    assert all(m.weight.dtype == FP8 for m in decoder.modules() if isinstance(m, Linear))


def test_only_the_language_models_decoder_layers_turn():
    """Qwen3-Omni: the thinker's and talker's layers turn; their heads, the code predictor's heads, the
    encoders and the vocoder do not (a component without a KV cache is left whole by the engine)."""
    from mstar.models.registry import load_model
    model = load_model("qwen3-omni-tiny")
    for name, spec in model.components.items():
        module = model.build_component(name, torch.device("cpu"), torch.float32)
        n = quantize_linears(module) if spec.kv_cache else 0
        turned = {m for m, mod in module.named_modules() if isinstance(mod, Linear) and mod.weight.dtype == FP8}
        assert len(turned) == n
        assert all(m.startswith("layers.") or ".layers." in m for m in turned), (name, sorted(turned))
        assert not any("head" in m.rsplit(".", 1)[-1] for m in turned), (name, sorted(turned))
        if spec.kv_cache and name in ("thinker", "talker"):
            assert n > 0, name


def _served(quantization: str | None) -> tuple[list[int], list[dict[int, float]]]:
    """tiny-llama's greedy tokens for one prompt, and each position's top-5 logprobs."""
    tokens, top, _ = greedy_top5(EngineConfig(model="tiny-llama", quantization=quantization), [5, 9, 200, 7])
    return tokens, top


def test_a_served_fp8_model_stays_close_to_the_full_one():
    full_tokens, full_top = _served(None)
    fp8_tokens, fp8_top = _served("fp8")
    assert len(fp8_tokens) == len(full_tokens) == 12 and len(fp8_top) == 12
    # the first position sees the prompt alone in both: the same top tokens, with logprobs within 0.1
    first = full_top[0]
    assert set(fp8_top[0]) == set(first)
    assert max(abs(fp8_top[0][t] - lp) for t, lp in first.items()) < 0.1
    assert fp8_tokens[0] == full_tokens[0]
