"""CUDA graphs of a decode step's draw: a decode graph bucket's logits, the
rows' sampling parameters and seen tokens in, one token per row out.

The sampler launches its kernels one by one from Python: about seventy for a
wide vocabulary's draw (`kernels/sampling/wide_draw.py`), a dozen for the
torch form. On an H200 launching them took longer than running them (at 256
rows of Orpheus's 157k vocabulary, 1.8 ms eager against 0.7 ms from a graph,
`scripts/bench_sampler.py`), and a served step waited on its host. Replayed
from a graph, a draw is a few copies into static buffers and one launch.

A draw's kernels depend on flags the host knows of its rows (all greedy, any
penalty, any filter, any top-k, any top-p: `SamplingTensors`), so a graph is
kept per (bucket, flags), captured on the first draw that needs it (the
model's default flags are captured with the decode graphs), all sharing one
memory pool. Padding rows of a bucket draw from stale parameters; their tokens
are cut off. Draws with banned ids (a `min_tokens` not reached) or an offset
stay eager, as do flags whose capture found no memory.

A graph draws a bucket's rows, so from 57 to 63 rows (bucket 64) it takes the
wide vocabulary's draw where the eager sampler would sort (`draw.WIDE_MIN_ROWS`):
the two draw the same token but where a token's mass before it lies within
float32 roundings of top-p (`wide_draw.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
from torch import Tensor

from mstar.engine.execution.sampler import SamplingTensors, sample
from mstar.kernels.graph_capture import capture_buckets

log = structlog.get_logger("mstar.sampler_graphs")

Flags = tuple[bool, bool, bool, bool, bool]  # all greedy, any penalty, any filter, any top-k, any top-p


def flags_of(st: SamplingTensors) -> Flags:
    return (st.all_greedy, st.any_penalty, st.any_filter, st.any_top_k, st.any_top_p)


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor   # [bucket] int64, what a replay writes


class SamplerGraphs:
    def __init__(self, logits: dict[int, Tensor], device: torch.device,
                 window: tuple[int, int] | None = None) -> None:
        """`logits`: each decode graph bucket's static logits buffer [b, V];
        `window`: the ids the head computes (`sampler.sample`), if not all."""
        self.logits = logits
        self.device = device
        self.window = window
        top, vocab = max(logits), next(iter(logits.values())).shape[1]
        f32, i64 = torch.float32, torch.int64
        self._floats = torch.zeros(4, top, dtype=f32, device=device)  # temperature, top-p, min-p, penalty
        self._ints = torch.zeros(3, top, dtype=i64, device=device)    # top-k, seed, counter
        self._seen: Tensor | None = None   # [top, V] bool, made with the first penalised graph
        self._vocab = vocab
        self._graphs: dict[tuple[int, Flags], _Graph] = {}
        self._pool: tuple | None = None
        self._stream = torch.cuda.Stream(device)   # every capture's: the pool's freed blocks are kept per stream
        self._failed: set[tuple[int, Flags]] = set()
        self.captures = 0

    def draw(self, bucket: int, st: SamplingTensors, seen: Tensor | None) -> Tensor:
        """The tokens [n] of the first n rows of `bucket`'s logits (n: the
        rows of `st`), as `sampler.sample` draws them."""
        n = st.temperature.shape[0]
        key = (bucket, flags_of(st))
        if st.any_penalty and seen is None:
            raise ValueError("a row has a repetition penalty but no `seen` mask was given")
        graph = self._graphs.get(key)
        if graph is None and key not in self._failed:
            try:
                graph = self._graphs[key] = self._capture(*key)
            except torch.OutOfMemoryError:
                # these flags draw eagerly from now on; the step goes on
                log.warning("no memory to capture a sampler graph; drawing eagerly", bucket=bucket, flags=key[1])
                self._failed.add(key)
        if graph is None:
            return sample(self.logits[bucket][:n], st, seen, window=self.window)
        self._stage(n, st, seen if st.any_penalty else None)
        graph.graph.replay()
        # a copy: the next replay rewrites the static tokens while these may still be read
        return graph.tokens[:n].clone()

    def capture(self, st: SamplingTensors) -> None:
        """Capture every bucket's graph for the flags of `st` (a model's
        default sampling), before serving."""
        for b in sorted(self.logits, reverse=True):
            key = (b, flags_of(st))
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)

    def _stage(self, n: int, st: SamplingTensors, seen: Tensor | None) -> None:
        for row, t in enumerate((st.temperature, st.top_p, st.min_p, st.repetition_penalty)):
            self._floats[row, :n].copy_(t)
        for row, t in enumerate((st.top_k, st.seeds, st.counters)):
            self._ints[row, :n].copy_(t)
        if seen is not None:
            self._seen_buffer()[:n].copy_(seen)

    def _seen_buffer(self) -> Tensor:
        if self._seen is None:
            self._seen = torch.zeros(self._floats.shape[1], self._vocab, dtype=torch.bool, device=self.device)
        return self._seen

    def _capture(self, bucket: int, flags: Flags) -> _Graph:
        all_greedy, any_penalty, any_filter, any_top_k, any_top_p = flags
        b = bucket
        st = SamplingTensors(
            temperature=self._floats[0, :b], top_k=self._ints[0, :b], top_p=self._floats[1, :b],
            min_p=self._floats[2, :b], repetition_penalty=self._floats[3, :b], seeds=self._ints[1, :b],
            counters=self._ints[2, :b], logprobs=torch.zeros(0, dtype=torch.int64), all_greedy=all_greedy,
            any_penalty=any_penalty, any_filter=any_filter, any_logprobs=False, any_top_k=any_top_k,
            any_top_p=any_top_p)
        seen = self._seen_buffer()[:b] if any_penalty else None
        logits = self.logits[b]
        graphs = capture_buckets(self.device, [b], lambda _b: None,
                                 lambda _b, _p: sample(logits, st, seen, window=self.window),
                                 "capturing sampler graphs", show_progress=False, pool=self._pool,
                                 stream=self._stream)
        graph, tokens = graphs[b]
        self._pool = graph.pool()
        self.captures += 1
        return _Graph(graph, tokens)
