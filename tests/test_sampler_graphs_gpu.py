"""Draws replayed from CUDA graphs (`sampler_graphs.py`) against the sampler
run eagerly on the same logits: equal tokens for every row, for greedy,
penalised, top-k, top-p and min-p rows, over a wide vocabulary (the wide
draw's kernels) and a narrow one, from fewer rows than the bucket holds and
from a bucket whose padding rows hold another batch's parameters. Needs CUDA
(the GPU machine: scripts/gpu_check.sh sampler)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("sampler graphs need a CUDA device", allow_module_level=True)

from mstar.engine.execution.sampler import SamplingTensors, sample  # noqa: E402
from mstar.engine.execution.graphs.sampler_graphs import SamplerGraphs  # noqa: E402
from mstar.types import SamplingParams  # noqa: E402

ORPHEUS = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
MIXED = [ORPHEUS, SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=50),
         SamplingParams(temperature=0.9, min_p=0.1, repetition_penalty=1.1), SamplingParams(temperature=1.0)]


def buffers(vocab: int, buckets: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Static logits of each bucket, as decode graphs keep them (bfloat16)."""
    g = torch.Generator(device="cuda").manual_seed(vocab)
    return {b: (torch.randn(b, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16) for b in buckets}


def rows(params: list[SamplingParams], n: int, step: int) -> SamplingTensors:
    chosen = [params[i % len(params)] for i in range(n)]
    return SamplingTensors.build(chosen, [1000 + 7 * i for i in range(n)], [step + i for i in range(n)], "cuda")


def seen_mask(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(n, vocab, device="cuda", generator=g) < 0.01


@pytest.mark.parametrize("vocab", [156940, 4096])
@pytest.mark.parametrize("params", [[ORPHEUS], MIXED, [SamplingParams(temperature=0.0)]],
                         ids=["orpheus", "mixed", "greedy"])
def test_a_replayed_draw_equals_the_eager_one(vocab, params):
    logits = buffers(vocab, (1, 8, 64, 128))
    graphs = SamplerGraphs(logits, torch.device("cuda"))
    for step, (bucket, n) in enumerate([(128, 128), (128, 100), (64, 64), (64, 37), (8, 5), (1, 1), (128, 77)]):
        st = rows(params, n, step * 3)
        seen = seen_mask(n, vocab, step)
        want = sample(logits[bucket][:n], st, seen)
        got = graphs.draw(bucket, st, seen)
        assert got.shape == (n,)
        assert torch.equal(got, want), f"bucket {bucket}, {n} rows: {(got != want).sum()} rows differ"


def test_a_windowed_replay_equals_the_eager_windowed_draw():
    """`--audio-logits-only`: the head leaves Llama's text ids at -inf, and
    graphs draw from Orpheus's own ids only, as the eager sampler does."""
    window = (128256, 156940)
    logits = buffers(156940, (8, 64, 128))
    for x in logits.values():
        x[:, :window[0]] = float("-inf")
    graphs = SamplerGraphs(logits, torch.device("cuda"), window)
    for step, (bucket, n) in enumerate([(128, 128), (128, 90), (64, 64), (8, 5)]):
        st = rows(MIXED, n, step)
        seen = seen_mask(n, 156940, step)
        want = sample(logits[bucket][:n], st, seen, window=window)
        got = graphs.draw(bucket, st, seen)
        assert torch.equal(got, want) and bool((got >= window[0]).all())


def test_graphs_are_kept_by_bucket_and_flags():
    logits = buffers(4096, (8, 64))
    graphs = SamplerGraphs(logits, torch.device("cuda"))
    graphs.capture(rows([ORPHEUS], 1, 0))
    assert graphs.captures == 2   # one a bucket
    for n in (3, 8, 50):
        st = rows([ORPHEUS], n, n)
        seen = seen_mask(n, 4096, n)
        b = min(b for b in logits if b >= n)
        assert torch.equal(graphs.draw(b, st, seen), sample(logits[b][:n], st, seen))
    assert graphs.captures == 2   # the default flags' graphs served those
    st = rows([SamplingParams(temperature=1.0, top_k=20)], 8, 0)
    assert torch.equal(graphs.draw(8, st, None), sample(logits[8], st))
    assert graphs.captures == 3   # new flags: a graph of their own
