"""Linear projections whose weights arrive from checkpoints in pieces.

`Linear` is a plain projection [T, in] -> [T, out] whose parameters are
allocated uninitialised (the loader fills them). `MergedLinear` stores several
checkpoint projections stacked along the output dimension as one weight (q/k/v,
gate/up), so a step runs one matmul instead of several; `shard_rows` tells the
loader where each checkpoint tensor goes. `VocabHead` is an LM head whose
rows are padded for the matmul. `quantize_linears` turns projections to fp8
(`fp8.py`).

Outside CUDA graphs, a projection of more than `SMALL_ROWS` rows on CUDA runs
at `padded_rows` rows (the extra ones computed and dropped): cuBLAS spends
milliseconds of host time choosing a kernel the first time it sees a shape,
and an eager prefill's token count is new at almost every step. A projection
of one row on CUDA takes the few-row kernel (`kernels/projection/gemv.py`)
instead, with float8 weights too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.projection import gemv
from mstar.models.layers.fp8 import FP8, can_quantize, fp8_linear, quantize_weight

SMALL_ROWS = 16  # up to here every count is its own shape: few, and seen at once


def padded_rows(n: int) -> int:
    """`n` rounded up to one of few sizes: to 32 rows up to 512, 128 up to
    2048, 512 beyond (at most 32 rows or 1/4 more work)."""
    if n <= SMALL_ROWS:
        return n
    step = 32 if n <= 512 else 128 if n <= 2048 else 512
    return -(-n // step) * step


def gemm_rows(x: torch.Tensor) -> int:
    """The rows a projection of x [..., K] runs at: `padded_rows` of its rows
    for a CUDA tensor outside a graph capture (whose shapes are few already),
    else its own rows."""
    m = x.shape[:-1].numel()
    return padded_rows(m) if x.is_cuda and not torch.cuda.is_current_stream_capturing() else m


def linear_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, a 2-D x's rows padded to `gemm_rows`."""
    m = x.shape[0]
    padded = gemm_rows(x) if x.dim() == 2 else m
    if padded == m:
        return F.linear(x, weight, bias)
    wide = x.new_empty(padded, x.shape[1])  # rows past m are left as they are: each output row reads its own row
    wide[:m].copy_(x)
    return F.linear(wide, weight, bias)[:m]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a float weight: the few-row kernel where
    it applies, else `linear_padded`."""
    if bias is None and gemv.applies(x, weight):
        return gemv.linear(x, weight)
    return linear_padded(x, weight, bias)


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
        if self.weight.dtype == FP8:   # `quantize_linears`
            if self.bias is None and gemv.applies(x, self.weight):
                return gemv.linear(x, self.weight, weight_scale=self.weight_scale)
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, gemm_rows(x))
        return project(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: nn.Module) -> int:
    """The projections of `module`'s decoder layers (every `Linear` and
    `MergedLinear` under a child named `layers`) whose shape an fp8 GEMM
    takes, to fp8 weights in place (`fp8.py`); heads, embeddings, encoders'
    and vocoders' projections stay as they are. Returns how many turned."""
    linears = [m for name, m in module.named_modules()
               if (name.startswith("layers.") or ".layers." in name) and isinstance(m, Linear) and can_quantize(m)]
    for linear in linears:
        quantize_weight(linear)
    return len(linears)


class VocabHead(nn.Module):
    """A language model's head, [T, hidden] -> [T, vocab], its weight [vocab,
    hidden] the first rows of a zero-padded [vocab rounded up to `ALIGN`,
    hidden] matrix that the matmul takes whole. With an odd vocabulary
    (Orpheus's 156,940) each output row is not 16-byte aligned, and cuBLAS
    falls back to an older kernel: on an H200 1.7 ms at 400 rows, where the
    GEMM's arithmetic takes about 0.6."""

    ALIGN = 64

    def __init__(self, in_features: int, vocab: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, vocab
        rows = -(-vocab // self.ALIGN) * self.ALIGN
        padded = torch.empty(rows, in_features, device=device, dtype=dtype)
        padded[vocab:].zero_()
        self.register_buffer("padded", padded, persistent=False)
        # a view of the padded matrix: what the loader fills, and a tied embedding shares
        self.weight = nn.Parameter(padded[:vocab], requires_grad=False)
        self._window: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.window is None:
            return project(x, self.padded, None)[..., : self.out_features]
        # only the window's rows multiply; the other ids' logits are -inf, so every reader of the logits sees
        # the distribution the window leaves (the fill is one write, a fraction of the rows' matmul)
        first, end = self._window[0], -(-self._window[1] // self.ALIGN) * self.ALIGN  # whole padded rows
        out = x.new_empty(*x.shape[:-1], self.padded.shape[0])
        out[..., :first].fill_(float("-inf"))
        out[..., end:].fill_(float("-inf"))
        out[..., first:end] = project(x, self.padded[first:end], None)
        return out[..., : self.out_features]

    @property
    def window(self) -> tuple[int, int] | None:
        """The ids [first, end) whose logits are computed; None: all."""
        return self._window

    def restrict(self, first: int, end: int) -> None:
        """Compute the logits of ids [first, end) only, the others -inf.
        Both ends multiples of ALIGN (`end` may be the vocabulary's end), so
        that the rows' matmul covers whole aligned rows and nothing else."""
        if first % self.ALIGN or (end % self.ALIGN and end != self.out_features) \
                or not 0 <= first < end <= self.out_features:
            raise ValueError(f"a head of {self.out_features} ids restricted to [{first}, {end}): the window must "
                             f"lie inside the vocabulary, start at a multiple of {self.ALIGN} and end at one or at "
                             f"the vocabulary's end")
        self._window = (first, end)

    def extra_repr(self) -> str:
        window = f", ids {self._window[0]}..{self._window[1] - 1} only" if self._window else ""
        return f"{self.in_features} -> {self.out_features} (rows padded to {self.padded.shape[0]}){window}"


def token_embedding(head: VocabHead, tied: bool, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Embedding:
    """A language model's input embedding beside its `head`: sharing the
    head's weight when `tied`, else a weight of its own, allocated empty on
    `device` (the loader fills it; nn.Embedding would initialise it first)."""
    embedding = nn.Embedding(head.out_features, head.in_features, device="meta", dtype=dtype)
    embedding.weight = head.weight if tied else nn.Parameter(
        torch.empty(head.out_features, head.in_features, device=device, dtype=dtype), requires_grad=False)
    return embedding


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
