"""What the toys' tests run their references with: attention over a dense
per-layer K/V cache, one request at a time, and one draw of the runtime's
sampler for one row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.engine.execution.sampler import SamplingTensors, sample
from mstar.types import SamplingParams
from toys.audio_decoder import HEADS, KV_HEADS, LAYERS


class DenseAttention:
    """One request's attention over a dense per-layer K/V cache."""

    def __init__(self) -> None:
        self.k: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                rotary: object = None) -> torch.Tensor:
        assert rotary is None  # the toy rotates q and k itself
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys = torch.cat(self.k[layer]).repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = torch.cat(self.v[layer]).repeat_interleave(HEADS // KV_HEADS, dim=1)
        n, total = q.shape[0], keys.shape[0]
        mask = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=scale)
        return out.transpose(0, 1)


def draw(logits: torch.Tensor, params: SamplingParams, seed: int, counter: int) -> int:
    st = SamplingTensors.build([params], [seed], [counter], logits.device)
    return int(sample(logits.float().reshape(1, -1), st, None)[0])
