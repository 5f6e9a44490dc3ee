"""A gated delta-net layer (Qwen3.5's linear attention): packed hidden states
[T, H] of a step's rows in, [T, H] out, each row reading and updating its
slot of per-row state in place (`TokenBatch.state`: this layer's entry of
`conv` [C, K - 1], the causal convolution's last inputs, and of `rec`
[Hv, Dk, Dv], the recurrent state, float32).

Per token: q, k, v from a depthwise causal convolution (width K, SiLU) over
one projection; q and k L2-normalised per head and shared by groups of value
heads; a decay g = -exp(A) * softplus(a + dt_bias) and a write strength
beta = sigmoid(b); then the delta rule on the state S:
S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q / sqrt(Dk);
the output RMS-normalised per head and gated by SiLU(z).

The math is in `mstar.kernels.delta_rule` (torch references; decode rows of
one token each as one batched update).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.delta_rule import causal_conv_rows, delta_rule_rows
from mstar.kernels.norm import gated_rms_norm
from mstar.models.layers import Linear
from mstar.models.qwen3_5.config import Qwen35Config
from mstar.types import StateRows

Device = torch.device | str | None


class _Conv(nn.Module):
    """The depthwise convolution's weight, [C, 1, K] as checkpoints store it."""

    def __init__(self, channels: int, width: int, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, device=device, dtype=dtype), requires_grad=False)


class _GatedNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Config, index: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        """`index`: this layer's entry in the rows' state (its place among the delta-net layers)."""
        super().__init__()
        self.index = index
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.split = (key, key, value)
        h = cfg.hidden_size
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one projection: one GEMM a step
        self.merged_rows = {"in_proj": (("qkv", cfg.conv_dim), ("z", value), ("b", self.v_heads),
                                        ("a", self.v_heads))}
        self.in_proj = Linear(h, cfg.conv_dim + value + 2 * self.v_heads, False, device=device, dtype=dtype)
        self.conv1d = _Conv(cfg.conv_dim, cfg.linear_conv_kernel_dim, device, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads, device=device, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.v_heads, device=device, dtype=dtype), requires_grad=False)
        self.norm = _GatedNorm(self.v_dim, cfg.rms_norm_eps, device, dtype)
        self.out_proj = Linear(value, h, False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: StateRows, query_start: torch.Tensor) -> torch.Tensor:
        """`query_start` [B + 1] on the host: row i's tokens are x[qs[i]:qs[i + 1]]."""
        t = x.shape[0]
        conv = state.tensors["conv"][:, self.index]
        rec = state.tensors["rec"][:, self.index]
        qkv, z, b, a = self.in_proj(x).split([rows for _, rows in self.merged_rows["in_proj"]], dim=-1)
        mixed = causal_conv_rows(qkv, self.conv1d.weight, conv, state.slots, query_start, state.host)
        q, k, v = torch.split(mixed, self.split, dim=-1)
        out = delta_rule_rows(q.reshape(t, self.k_heads, self.k_dim), k.reshape(t, self.k_heads, self.k_dim),
                              v.reshape(t, self.v_heads, self.v_dim), a, b, self.A_log, self.dt_bias, rec,
                              state.slots, query_start, state.host)
        out = gated_rms_norm(out, z.reshape(t, self.v_heads, self.v_dim), self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(t, self.v_heads * self.v_dim))

    def compile_kernels(self) -> None:
        """Before serving (the engine calls it on every module that has it):
        on CUDA, what compiles or tunes itself on first use (fla-core's
        chunked kernel autotunes for seconds; the layers share shapes, so
        the first layer pays) runs once through `warm` instead of holding a
        first request. Nothing compiles on the CPU."""
        if self.norm.weight.device.type == "cuda":
            self.warm()

    def warm(self) -> None:
        """A prompt row and a decode row through this layer's delta rule, on
        made-up inputs and a state of its own."""
        # the norm's weight keeps the activations' dtype where fp8 quantization has turned in_proj to float8
        dev, dtype = self.norm.weight.device, self.norm.weight.dtype
        lengths = (70, 1)   # past one 64-token chunk, and a decode row beside it
        t = sum(lengths)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k = (torch.randn(t, self.k_heads, self.k_dim, device=dev, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(t, self.v_heads, self.v_dim, device=dev, generator=gen).to(dtype)
        a, b = (torch.randn(t, self.v_heads, device=dev, generator=gen).to(dtype) for _ in range(2))
        state = torch.zeros(len(lengths), self.v_heads, self.k_dim, self.v_dim, device=dev)
        delta_rule_rows(q, k, v, a, b, self.A_log, self.dt_bias, state, torch.arange(len(lengths), device=dev),
                        torch.tensor([0, lengths[0], t]))
