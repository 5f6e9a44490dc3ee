"""Linear projections whose weights arrive from checkpoints in pieces.

`Linear` is a plain projection [T, in] -> [T, out] whose parameters are
allocated uninitialised (the loader fills them). `MergedLinear` stores several
checkpoint projections stacked along the output dimension as one weight (q/k/v,
gate/up), so a step runs one matmul instead of several; `shard_rows` tells the
loader where each checkpoint tensor goes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ weight.T + bias` with weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # uninitialised on purpose: every value is overwritten at load, and
        # initialising billions of parameters first would double load time
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input, stacked: output = cat(shards).

    `shards` names each piece and its output width, in output order.
    """

    def __init__(self, in_features: int, shards: Sequence[tuple[str, int]], bias: bool = False, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, sum(n for _, n in shards), bias, device=device, dtype=dtype)
        self.shard_names = tuple(name for name, _ in shards)
        self.shard_sizes = tuple(n for _, n in shards)
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, n in shards:
            self._offsets[name] = (start, start + n)
            start += n

    def shard_rows(self, shard: str) -> slice:
        """The output rows (of weight and bias) that hold `shard`."""
        start, end = self._offsets[shard]
        return slice(start, end)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output cut back into its shards (views, no copy)."""
        return tuple(y.split(self.shard_sizes, dim=-1))


def qkv_linear(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False, *,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MergedLinear:
    """The fused attention input projection: shards `q`, `k`, `v`."""
    shards = (("q", num_heads * head_dim), ("k", num_kv_heads * head_dim), ("v", num_kv_heads * head_dim))
    return MergedLinear(hidden, shards, bias, device=device, dtype=dtype)
