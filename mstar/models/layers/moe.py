"""A sparse mixture-of-experts feed-forward (Qwen3-MoE's): hidden states
[T, H] in, [T, H] out. A router scores every expert per token (softmax in
float32), each token goes to its top-k experts (their weights renormalised
to sum to 1 when the model says so), and each expert is a SwiGLU; the
talker's variant adds a shared expert scaled by a sigmoid gate.

Routing runs in `mstar.kernels.router` (one launch on CUDA), the routed
experts in `mstar.kernels.moe` (a grouped-GEMM Triton kernel on CUDA, the
per-expert torch loop elsewhere), which reads the expert weights stacked as
they are kept: [E, 2I, H] gate then up, [E, H, I] down.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.moe import compile_variants, fused_moe
from mstar.kernels.router import route_top_k
from mstar.models.layers.linear import Linear, linear_padded
from mstar.models.layers.mlp import SwiGLU


class SparseMoe(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate: int = 0, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        kw = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(num_experts, hidden, **kw))
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **kw))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **kw))
        self.shared = SwiGLU(hidden, shared_intermediate, **kw) if shared_intermediate else None
        self.shared_gate = Linear(hidden, 1, **kw) if shared_intermediate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (x's dtype)."""
        return route_top_k(linear_padded(x, self.router, None), self.top_k, self.norm_topk_prob, x.dtype)

    def compile_kernels(self) -> None:
        """Compile the expert kernels for every step size before serving."""
        compile_variants(self.gate_up, self.down, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = fused_moe(x, self.gate_up, self.down, experts, weights)
        if self.shared is not None:
            assert self.shared_gate is not None
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out
