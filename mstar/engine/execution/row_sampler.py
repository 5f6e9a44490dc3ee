"""Logits in, tokens and their logprobs out: for the rows of a KV item step
(each row's own params, seen ids and banned ids) and for a decode group's
rows (the group's sampling tensors, a graph of the draw where one fits).

The clock of a step's device time lives here too: both kinds of step count
their forwards on it, and an item step's draw is where it waits for its
kernels (a group's draw does not wait).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from mstar.engine.execution.sampler import SamplingTensors, banned_table, sample, token_logprobs
from mstar.engine.execution.graphs.sampler_graphs import SamplerGraphs
from mstar.engine.worker.kv_rows import KVRow, count_outputs, output_counts, seen_masks
from mstar.engine.worker.rows import PartitionRun


class DeviceClock:
    """The device time of one step (`seconds`), which a `StepReport` tells
    apart from the step's host work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self._cuda = device.type == "cuda"

    def reset(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, adding its run time to `seconds` on the CPU, where compute is
        synchronous. On CUDA calls only launch work; `wait` measures there."""
        if self._cuda:
            return fn

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out
        return call

    def wait(self) -> None:
        """On CUDA: wait for the step's kernels, counting the time as device
        time (what is left of the step is host work)."""
        if self._cuda:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            self.seconds += time.perf_counter() - t0


class RowSampler:
    """`vocab_window`: the ids a restricted head's logits cover (`VocabHead.restrict`);
    `graphs`: graphs of the decode graphs' draws, where captured."""

    def __init__(self, clock: DeviceClock, vocab_window: tuple[int, int] | None,
                 graphs: SamplerGraphs | None = None) -> None:
        self.clock = clock
        self.vocab_window = vocab_window
        self.graphs = graphs

    def rows(self, logits: torch.Tensor, parts: list[PartitionRun], kv: list[KVRow],
             inputs: list[torch.Tensor], banned: list[tuple[int, ...]], wait: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' tokens, and the packed logprobs of those that asked (on
        the host; with `wait` False nothing waits, and they stay on the
        device); `banned`: each row's ids it may not draw."""
        params = [p.sampling for p in parts]
        st = SamplingTensors.build(params, [p.seed for p in parts], [r.generated for r in kv], logits.device)
        seen = outputs = None
        if st.any_penalty:
            seen = seen_masks(kv, [toks if p.sampling.repetition_penalty != 1.0 else None
                                   for p, toks in zip(parts, inputs)], logits.shape[-1], logits.device)
        if st.any_output_penalty:
            outputs = output_counts(kv, logits.shape[-1], logits.device)
        with torch.profiler.record_function("mstar.sample"):
            tokens = self.clock.timed(sample)(logits, st, seen, banned_table(banned, logits.device),
                                              window=self.vocab_window, outputs=outputs)
            logprobs = self.clock.timed(token_logprobs)(logits, tokens, st)
        if outputs is not None:
            count_outputs(kv, [p.penalises_outputs for p in params], outputs, tokens)
        if not wait:
            return tokens, logprobs
        self.clock.wait()
        return tokens, None if logprobs is None else logprobs.cpu()

    def group(self, logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor | None,
              banned: torch.Tensor | None, bucket: int | None = None, outputs: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A group step's tokens sampled from its logits (a decode graph `bucket`'s: by a graph of the
        draw, unless ids are banned or a row penalises its outputs), and their logprobs."""
        # no wait: the worker reads these tokens after launching the next step. A graph's logits are
        # its static output: read here, in stream order, before the next replay rewrites them
        graphs = self.graphs if bucket is not None and banned is None and not st.any_output_penalty else None
        tokens = (graphs.draw(bucket, st, seen) if graphs
                  else self.clock.timed(sample)(logits, st, seen, banned, window=self.vocab_window,
                                                outputs=outputs))
        return tokens, self.clock.timed(token_logprobs)(logits, tokens, st)
