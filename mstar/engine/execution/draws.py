"""The tokens a mode draws itself (`TokenBatch.draw`: a talker frame's code
predictor, inside the talker's step): logits [B, V] and the draw's index j
in, one token per row out, by the runtime's sampler under the step's
sampling key. `Draws` draws eagerly from one step's parameters;
`StaticDraws` holds the parameters in static buffers, so that the draws of
a captured step replay inside its CUDA graph, as the eager ones would draw.
"""

from __future__ import annotations

import torch

from mstar.engine.execution.sampler import NOT_ASKED, SamplingTensors, sample

# which of the sampler's paths a step's rows take (`SamplingTensors`' flags): a graph records one path
DRAW_KINDS = ("greedy", "plain", "filtered")


class Draws:
    """`draw(logits, j)` of one step: draw j of a row is its counter for the
    key plus j, so a fused mode draws what the steps it fuses would have."""

    def __init__(self, tensors: SamplingTensors, count: int) -> None:
        self.tensors = tensors
        self.count = count

    @property
    def kind(self) -> str | None:
        """The sampler's path for these rows; None where a graph cannot take
        it (a repetition penalty: in-mode draws keep no seen tokens)."""
        st = self.tensors
        if st.any_penalty:
            return None
        return "greedy" if st.all_greedy else "filtered" if st.any_filter else "plain"

    def __call__(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        if not 0 <= j < self.count:
            raise IndexError(f"draw {j} of a mode that declares {self.count} per step")
        return sample(logits, self.tensors, offset=j)


class StaticDraws:
    """A graph's sampling parameters for up to `rows` rows: `load` copies a
    step's into them (padding rows draw greedily), `bound(b, kind)` is the
    `draw` a graph of bucket b captures."""

    def __init__(self, rows: int, count: int, device: torch.device) -> None:
        self.count = count
        zeros = {"device": device}
        self.temperature = torch.zeros(rows, dtype=torch.float32, **zeros)
        self.top_k = torch.zeros(rows, dtype=torch.int64, **zeros)
        self.top_p = torch.ones(rows, dtype=torch.float32, **zeros)
        self.min_p = torch.zeros(rows, dtype=torch.float32, **zeros)
        self.seeds = torch.zeros(rows, dtype=torch.int64, **zeros)
        self.counters = torch.zeros(rows, dtype=torch.int64, **zeros)
        self._no_logprobs = torch.full((rows,), NOT_ASKED, dtype=torch.int64)  # on the host, as built steps hold it

    def load(self, draws: Draws, bucket: int) -> None:
        st, n = draws.tensors, draws.tensors.temperature.shape[0]
        for static, value, pad in ((self.temperature, st.temperature, 0.0), (self.top_k, st.top_k, 0),
                                   (self.top_p, st.top_p, 1.0), (self.min_p, st.min_p, 0.0),
                                   (self.seeds, st.seeds, 0), (self.counters, st.counters, 0)):
            static[:n].copy_(value, non_blocking=True)
            static[n:bucket].fill_(pad)

    def bound(self, b: int, kind: str) -> Draws:
        st = SamplingTensors(
            temperature=self.temperature[:b], top_k=self.top_k[:b], top_p=self.top_p[:b], min_p=self.min_p[:b],
            repetition_penalty=torch.ones_like(self.temperature[:b]), seeds=self.seeds[:b],
            counters=self.counters[:b], logprobs=self._no_logprobs[:b],
            all_greedy=kind == "greedy", any_penalty=False, any_filter=kind == "filtered", any_logprobs=False)
        return Draws(st, self.count)
