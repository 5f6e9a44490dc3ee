"""The repetition penalty as Hugging Face applies it: a step's logits [B, V]
(any float dtype), each row's seen tokens [B, V] (bool) and penalty [B] in,
float32 logits out, where a seen token's positive logit is divided by the
row's penalty and a negative one multiplied.

The torch form is a float copy, two products, a comparison and two selects:
about six passes over B x V values (at 400 rows of a 157k vocabulary, ~2 GB
of memory traffic a step). The kernel reads the logits and the mask once
and writes the float32 logits once; its division rounds as torch's. On the
CPU the same values are computed at the seen tokens only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import jit, tl, use_triton

BLOCK = 4096


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    if use_triton(logits):
        return repetition_penalty_triton(logits, seen, penalty)
    return repetition_penalty_reference(logits, seen, penalty)


def repetition_penalty_reference(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    if logits.device.type == "cpu":
        return _seen_only(logits, seen, penalty)
    x = logits.float()
    pen = penalty.float()[:, None]
    return torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)


def _seen_only(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """The same values, computed at the seen tokens only (a few hundred of a
    row's ids, where the whole form makes five passes over every id): on the
    CPU, where no CUDA graph captures it (`nonzero` waits for its count)."""
    x = logits.float()
    if x is logits:
        x = x.clone()
    rows, cols = seen.nonzero(as_tuple=True)
    v, pen = x[rows, cols], penalty.float()[rows]
    x[rows, cols] = torch.where(v > 0, v / pen, v * pen)
    return x


def repetition_penalty_triton(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    rows, vocab = logits.shape
    if seen.shape != logits.shape or seen.dtype != torch.bool or penalty.shape != (rows,):
        raise ValueError(f"repetition_penalty takes logits [B, V], seen [B, V] bool and penalty [B], got "
                         f"{tuple(logits.shape)}, {tuple(seen.shape)} {seen.dtype} and {tuple(penalty.shape)}")
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if out.numel():
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        seen = seen.contiguous()
        grid = (rows, (vocab + BLOCK - 1) // BLOCK)
        # a bool tensor's bytes as uint8 (the same storage): what the kernel loads
        _penalty_kernel[grid](logits, logits.stride(0), seen.view(torch.uint8), penalty.float().contiguous(), out,
                              vocab, BLOCK=BLOCK, num_warps=8)
    return out


# the logits' row stride is the head's padded width under a decode graph and the vocabulary in an eager
# step, and a group's rows start anywhere in its logits and seen flags (rows of 156,940 bytes are not
# 16-byte aligned): specialised on those, a burst of a new shape waits for a compile
@jit(per_row=("penalty_ptr", "logits_ptr", "seen_ptr"), any_value=("stride",))
def _penalty_kernel(logits_ptr, stride, seen_ptr, penalty_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    seen = tl.load(seen_ptr + row * vocab + cols, mask=mask, other=0)
    p = tl.load(penalty_ptr + row)
    y = tl.where(x > 0.0, tl.math.div_rn(x, p), x * p)
    tl.store(out_ptr + row * vocab + cols, tl.where(seen != 0, y, x), mask=mask)
