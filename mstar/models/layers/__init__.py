"""Shared torch blocks for model components: norms, rotary, projections, MLPs."""

from mstar.models.layers.linear import (Linear, MergedLinear, VocabHead, qkv_linear, quantize_linears,
                                        token_embedding)
from mstar.models.layers.mlp import SwiGLU
from mstar.models.layers.norm import CenteredRMSNorm, RMSNorm
from mstar.models.layers.rotary import RopeScaling, RotaryEmbedding

__all__ = ["CenteredRMSNorm", "Linear", "MergedLinear", "RMSNorm", "RopeScaling", "RotaryEmbedding", "SwiGLU",
           "VocabHead", "qkv_linear", "quantize_linears", "token_embedding"]
