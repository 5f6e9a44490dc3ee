"""Orpheus on a GPU: the SNAC codec in float16 against float32, the codec's
CUDA-graph replay against eager at padded and exact buckets, and the whole
`speak` walk with graphs against `--enforce-eager`."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.graphs.mode_graphs import ModeGraphs
from mstar.models.base import RowShape
from mstar.models.orpheus.codec import WINDOW_TOKENS, OrpheusCodec
from mstar.models.orpheus.tokens import AUDIO_TOKEN_BASE, CODEBOOK_SIZE, FRAME_TOKENS
from mstar.models.snac import load_snac_decoder
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


def _codec(dtype: torch.dtype) -> OrpheusCodec:
    snac = load_snac_decoder(None, load_format="dummy", device="cuda", dtype=dtype)
    return OrpheusCodec(snac, snac.config.samples_per_coarse_frame).eval()


def _windows(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, CODEBOOK_SIZE, (rows, WINDOW_TOKENS), generator=g)
    return (AUDIO_TOKEN_BASE + codes + CODEBOOK_SIZE * (torch.arange(WINDOW_TOKENS) % FRAME_TOKENS)).cuda()


def test_float16_codec_is_within_a_tenth_of_a_percent_of_float32() -> None:
    tokens, seeds = _windows(16), torch.arange(16, device="cuda")
    ref = _codec(torch.float32).window(tokens, seeds=seeds)
    half = _codec(torch.float16).window(tokens, seeds=seeds)
    assert half.dtype == torch.float32 and half.shape == ref.shape == (16, 2048)
    rel = ((half - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel < 3e-3, f"relative RMS error {rel:.2e}"
    assert (half - ref).abs().max().item() < 1e-2


def test_cuda_codec_plays_what_the_cpu_modules_decode(exact_float32: None) -> None:
    """On CUDA a window runs fused residual units over the played frame's
    spans with the noise kernel; on the CPU the modules and the torch noise:
    the same samples in float32 (full windows and a stream's last ones),
    TF32 off on both sides of the comparison."""
    cpu_snac = load_snac_decoder(None, load_format="dummy", device="cpu", dtype=torch.float32)
    cpu = OrpheusCodec(cpu_snac, cpu_snac.config.samples_per_coarse_frame).eval()
    cuda = _codec(torch.float32)
    for length in (WINDOW_TOKENS, 21, 14):
        tokens, seeds = _windows(8, seed=length)[:, :length], torch.arange(8) * 13 - 40
        got = cuda.window(tokens, seeds=seeds.cuda()).cpu()
        want = cpu.window(tokens.cpu(), seeds=seeds)
        assert got.shape == want.shape and got.shape[1] > 0
        assert (got - want).abs().max().item() < 1e-4


def test_codec_graphs_replay_what_eager_computes() -> None:
    codec = _codec(torch.float16)
    # full windows and 3-frame last windows
    graphs = ModeGraphs("codec.window", codec.window, ((RowShape((WINDOW_TOKENS,), torch.long),),
                                                       (RowShape((21,), torch.long),)), (1, 4, 16),
                        torch.device("cuda"))
    assert graphs.seeded
    graphs.capture(show_progress=False)
    for n in (1, 3, 16):  # exact and padded buckets
        for length, samples in ((WINDOW_TOKENS, 2048), (21, 4096)):
            tokens, seeds = _windows(n, seed=n)[:, :length], torch.arange(100, 100 + n, device="cuda")
            out = graphs.run([tokens], seeds)
            assert out is not None and out.shape == (n, samples)
            eager = codec.window(tokens, seeds=seeds)
            assert (out - eager).abs().max().item() < 2e-3
    # what does not fit runs eagerly
    assert graphs.run([_windows(17)], torch.arange(17, device="cuda")) is None
    assert graphs.run([_windows(2)[:, :14]], torch.arange(2, device="cuda")) is None
    # the returned rows are copies: a later replay does not change them
    first = graphs.run([_windows(4, seed=1)], torch.arange(4, device="cuda"))
    kept = first.clone()
    graphs.run([_windows(4, seed=2)], torch.arange(4, device="cuda"))
    assert torch.equal(first, kept)


async def _speak_all(eager: bool) -> tuple[list[bytes], bool]:
    """Five seeded requests at once: their PCM, and whether the codec had graphs."""
    eng = Engine(EngineConfig(model="orpheus-tiny", devices=("cuda:0",), enforce_eager=eager,
                              cuda_graph_batch_sizes=(1, 2, 4, 8)))
    await eng.start()
    sp = SamplingParams(max_tokens=98, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)

    async def one(i: int) -> bytes:
        audio = b""
        req = GenerateRequest(f"s{i}", "orpheus-tiny", {"text": f"sentence number {i}", "voice": "tara"},
                              dataclasses.replace(sp, seed=i))
        async for chunk in eng.submit(req):
            assert chunk.error is None
            audio += chunk.audio or b""
        return audio

    try:
        audio = list(await asyncio.gather(*[one(i) for i in range(5)]))
        assert all(n == 0 for n in eng.workers[0].pages_in_use().values())
        return audio, bool(eng.workers[0].runners["codec"].mode_graphs)
    finally:
        await eng.shutdown()


async def test_speak_with_graphs_matches_eager() -> None:
    graphs, captured = await _speak_all(eager=False)
    assert captured, "the codec should replay graphs on CUDA"
    eager, captured = await _speak_all(eager=True)
    assert not captured
    for a, b in zip(graphs, eager):
        x = np.frombuffer(a, dtype="<i2").astype(np.int32)
        y = np.frombuffer(b, dtype="<i2").astype(np.int32)
        assert x.size > 0 and x.size % 2048 == 0 and x.size == y.size
        # float16 convolutions at a graph's padded batch vs eager's exact batch: a few PCM16 steps
        assert np.abs(x - y).max() <= 64
