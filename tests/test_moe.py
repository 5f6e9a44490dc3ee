"""The sparse MoE feed-forward against transformers' Qwen3-Omni blocks with
the same random weights: the thinker's (routed experts only) and the
talker's (plus a gated shared expert), in float32, on a batch of tokens
where some experts get many tokens and some none; through the torch
reference and through the Triton kernel (Triton's interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from mstar.kernels import moe as moe_kernels
from mstar.kernels.backend import HAVE_TRITON
from mstar.models.layers.moe import SparseMoe
from test_qwen3_omni_config import tiny


def _copy(ours: SparseMoe, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        ours.router.copy_(theirs.gate.weight)
        ours.gate_up.copy_(theirs.experts.gate_up_proj)
        ours.down.copy_(theirs.experts.down_proj)
        if ours.shared is not None:
            s = theirs.shared_expert
            ours.shared.gate_up.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared.down.weight.copy_(s.down_proj.weight)
            ours.shared_gate.weight.copy_(theirs.shared_expert_gate.weight)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_sparse_moe_matches_transformers(part: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    if kernel:
        if not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs triton with TRITON_INTERPRET=1 (conftest sets it without CUDA)")
        fused = moe_kernels.fused_moe_triton
        monkeypatch.setattr(moe_kernels, "use_triton", lambda x: True)
        monkeypatch.setattr(moe_kernels, "fused_moe_triton", lambda *a: calls.append(1) or fused(*a))
    torch.manual_seed(0)
    cfg = tiny()
    text = cfg.thinker_config.text_config if part == "thinker" else cfg.talker_config.text_config
    theirs = (hf.Qwen3OmniMoeThinkerTextSparseMoeBlock if part == "thinker"
              else hf.Qwen3OmniMoeTalkerTextSparseMoeBlock)(text).eval()
    for p in theirs.parameters():  # transformers leaves the stacked experts uninitialised
        torch.nn.init.normal_(p, std=0.2)
    ours = SparseMoe(text.hidden_size, text.moe_intermediate_size, text.num_experts, text.num_experts_per_tok,
                     text.norm_topk_prob,
                     getattr(text, "shared_expert_intermediate_size", 0) if part == "talker" else 0)
    _copy(ours, theirs)
    x = torch.randn(1, 37, text.hidden_size)
    with torch.no_grad():
        want = theirs(x)[0]
        got = ours(x[0])
    experts, weights = ours.route(x[0])
    assert experts.unique().numel() == text.num_experts  # every expert ran
    torch.testing.assert_close(weights.sum(-1), torch.ones(37))  # renormalised (norm_topk_prob)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == int(kernel)  # the kernel path ran, once
