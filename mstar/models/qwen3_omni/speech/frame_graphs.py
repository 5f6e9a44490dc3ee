"""The code predictor's forwards as CUDA graphs: a frame is G - 1 small
forwards (5 layers over one or two tokens a row), each waiting on the draw
before it, so eagerly a frame is thousands of kernel launches and the
launches, not the GPU, set its time. Here each of those forwards is one
graph per batch bucket, over a static dense cache of the frame; the draws
stay eager between them (the runtime's sampler, per row), so the codes are
the eager path's.

Rows in: the talker's last hidden state and the first code's embedding
([B, H] each); out: the codes and their embeddings, as
`CodePredictor.complete` returns them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mstar.kernels.graph_capture import capture_buckets

Draw = Callable[[torch.Tensor, int], torch.Tensor]


class StaticFrameCache:
    """Attention over a frame's dense cache [layers, B, G, kv heads, D] in
    static buffers: a step writes its tokens at positions [start, start + n)
    and attends to [0, start + n), causally among its own."""

    def __init__(self, layers: int, rows: int, positions: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.k = torch.zeros(layers, rows, positions, kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.rows, self.start = rows, 0

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        b, s = self.rows, self.start
        q, k, v = (x.reshape(b, -1, *x.shape[1:]) for x in (q, k, v))  # [B, n, heads, D]
        n = q.shape[1]
        self.k[layer, :b, s:s + n] = k
        self.v[layer, :b, s:s + n] = v
        keys = self.k[layer, :b, :s + n].transpose(1, 2)
        values = self.v[layer, :b, :s + n].transpose(1, 2)
        # the step's own tokens attend causally; with one token that is all of the cache
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=n > 1 and s == 0,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, *q.shape[2:])


class FrameGraphs:
    """For each bucket: G - 1 graphs, graph j the forward that predicts code
    j + 1 (graph 0 reads the two input rows at positions 0 and 1, graph j
    the embedding of code j at position j + 1), over the bucket's static
    cache. Captured through the runtime's `capture_buckets` (one worker at a
    time, thread-local, largest bucket first): one call per forward j, each
    with a memory pool of its own."""

    def __init__(self, predictor: torch.nn.Module, buckets: Sequence[int]) -> None:
        cp = predictor
        cfg = cp.cfg
        weight = cp.norm.weight
        device, dtype = weight.device, weight.dtype
        self.cp, self.groups = cp, cfg.num_code_groups
        self.buckets = sorted(buckets)
        top = self.buckets[-1]
        self.first = torch.zeros(top, 2, cfg.hidden_size, device=device, dtype=dtype)
        self.next = torch.zeros(top, 1, cfg.hidden_size, device=device, dtype=dtype)
        self.caches = {b: StaticFrameCache(cfg.num_hidden_layers, b, cfg.num_code_groups, cfg.num_key_value_heads,
                                           cfg.head_dim, device, dtype) for b in self.buckets}
        by_step = [capture_buckets(device, self.buckets, lambda b: self.caches[b],
                                   lambda b, cache, j=j: self._forward(b, j, cache),
                                   f"capturing code predictor graphs ({j})", show_progress=False)
                   for j in range(self.groups - 1)]
        self.graphs = {b: [step[b] for step in by_step] for b in self.buckets}

    def _forward(self, b: int, j: int, cache: StaticFrameCache) -> torch.Tensor:
        x = self.first[:b] if j == 0 else self.next[:b]
        cache.start = 0 if j == 0 else j + 1
        h = self.cp._last(x, cache.start, cache)
        return self.cp.lm_head[j](h)

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def complete(self, last: torch.Tensor, first: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        rows = last.shape[0]
        b = next(size for size in self.buckets if size >= rows)
        self.first[:rows, 0] = last
        self.first[:rows, 1] = first
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for j, (graph, logits) in enumerate(self.graphs[b]):
            graph.replay()
            codes.append(draw(logits[:rows], j))
            embeds.append(self.cp.codec_embedding[j](codes[-1]))
            if j + 1 < len(self.graphs[b]):  # the last code is only embedded (the talker sums it)
                self.next[:rows, 0] = embeds[-1]
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)
