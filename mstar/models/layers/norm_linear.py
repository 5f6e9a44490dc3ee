"""A decoder layer's norm and the projection after it, as one step: hidden
states and the residual stream [T, H] in, (the projection of the normed
stream, the stream) out; with `silu` the projection is a merged gate/up and
the output silu(gate) * up.

At one row on CUDA (`gemv.MAX_ROWS`) both run in one kernel
(`kernels/projection/`), which saves the norm's launch and its round trip
through memory, and the activation's; otherwise the norm, the projection and
the activation run as the modules do.
"""

from __future__ import annotations

import torch

from mstar.kernels.projection import gemv
from mstar.kernels.activation import silu_and_mul
from mstar.models.layers.linear import Linear
from mstar.models.layers.norm import CenteredRMSNorm, RMSNorm


def norm_project(norm: RMSNorm | CenteredRMSNorm, linear: Linear, h: torch.Tensor, residual: torch.Tensor | None,
                 *, silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.stream(h, residual)` and then `linear` (and `silu_and_mul`) on
    the normed value; residual None: h is the stream itself."""
    if linear.bias is None and gemv.applies(h, linear.weight):
        return gemv.norm_linear(h, residual, norm.weight, norm.eps, linear.weight,
                                centered=isinstance(norm, CenteredRMSNorm), silu=silu,
                                weight_scale=getattr(linear, "weight_scale", None))
    x, stream = norm.stream(h, residual)
    y = linear(x)
    return (silu_and_mul(y) if silu else y), stream
