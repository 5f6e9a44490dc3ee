"""A mixture-of-experts router's choice: the router's logits [T, E] in
(any float dtype), each token's top-k experts [T, k] (int64, most likely
first) and their weights [T, k] out: the softmax over the experts in
float32, the k largest, renormalised to sum to 1 when the model asks, in the
activations' dtype.

The torch form is six launches a layer (a float copy, the softmax, top-k,
the sum, the division, the cast), and a frame of the talker routes twenty
layers, a token of the thinker forty-eight; the kernel is one launch, a
token's experts in registers (up to `MAX_EXPERTS`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton

MAX_EXPERTS = 1024


def route_top_k(logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    if use_triton(logits) and logits.shape[-1] <= MAX_EXPERTS:
        return route_top_k_triton(logits, k, renormalize, dtype)
    return route_top_k_reference(logits, k, renormalize, dtype)


def route_top_k_reference(logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(dtype)


def route_top_k_triton(logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS or not 0 < k <= num_experts:
        raise ValueError(f"route_top_k: {num_experts} experts (at most {MAX_EXPERTS}), top {k}")
    experts = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, k, dtype=dtype, device=logits.device)
    if tokens:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        block = block_size(num_experts)
        _route_kernel[(tokens,)](logits, logits.stride(0), experts, weights, num_experts, K=k,
                                 K_BLOCK=block_size(k), RENORMALIZE=renormalize, BLOCK=block,
                                 num_warps=min(num_warps(block), 4))
    return experts, weights


@jit
def _route_kernel(logits_ptr, stride, experts_ptr, weights_ptr, num_experts, K: tl.constexpr,
                  K_BLOCK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + token * stride + idx, mask=idx < num_experts, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    slots = tl.arange(0, K_BLOCK)
    chosen = tl.zeros((K_BLOCK,), dtype=tl.int64)
    chosen_p = tl.zeros((K_BLOCK,), dtype=tl.float32)
    left = tl.where(idx < num_experts, probs, -1.0)
    for i in tl.static_range(K):
        best = tl.argmax(left, axis=0)   # the lowest index among equal probabilities
        p = tl.max(left, axis=0)
        chosen = tl.where(slots == i, best.to(tl.int64), chosen)
        chosen_p = tl.where(slots == i, p, chosen_p)
        left = tl.where(idx == best, -2.0, left)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, axis=0)
    out = slots < K
    tl.store(experts_ptr + token * K + slots, chosen, mask=out)
    tl.store(weights_ptr + token * K + slots, chosen_p.to(weights_ptr.dtype.element_ty), mask=out)
