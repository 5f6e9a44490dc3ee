"""Fused kernels for the bandwidth-bound parts of a decode step: Triton on
CUDA tensors, torch references everywhere else.

A layer that models/ and engine/ both import; it imports only torch, triton
and the mstar leaf modules.
"""

from mstar.kernels.activation import silu_and_mul
from mstar.kernels.moe import fused_moe
from mstar.kernels.norm import fused_add_rms_norm, rms_norm
from mstar.kernels.rope_kv import rope_and_store

__all__ = ["fused_add_rms_norm", "fused_moe", "rms_norm", "rope_and_store", "silu_and_mul"]
