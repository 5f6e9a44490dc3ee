"""code2wav's `stream` captured once in a CUDA graph at a batch bucket and
replayed frame by frame: rows join at different replays, the bucket's unused
rows point at the scratch slot, and each row's replayed outputs are `held`
zeros then the whole decode, as eager streaming is on CPU. Needs CUDA.

float32 with TF32 off in matmuls and cuDNN convolutions, so the graph and the
whole decode differ by summation order alone: 1e-5 absolute, as on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.usefixtures("exact_float32")

from mstar.engine.memory.state_slots import StatePool  # noqa: E402
from mstar.models.qwen3_omni.config import Code2WavConfig  # noqa: E402
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav  # noqa: E402
from mstar.types import StateRows  # noqa: E402

CFG = Code2WavConfig(codebook_size=64, num_quantizers=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, sliding_window=8, decoder_dim=64,
                     upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2), rope_theta=1e4, rms_norm_eps=1e-5)


def _random(cfg: Code2WavConfig) -> Code2Wav:
    """Random weights of the CPU tests' scales: a waveform of std ~0.2 that
    its codes and attention both move."""
    module = Code2Wav(cfg, device="cuda").eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            std = 0.9 / math.sqrt(p[0].numel()) if p.dim() > 1 and not name.startswith(
                ("code_embedding", "transformer")) else 0.08
            p.normal_(0.0, std, generator=g)
            if name.endswith("_scale"):
                p.fill_(1.0)
        module.conv_out.weight.mul_(0.1)
    return module


@torch.inference_mode()
def test_a_graph_replayed_frame_by_frame_streams_the_whole_decode() -> None:
    module = _random(CFG)
    pool = StatePool(module.state_spec(), 6, "cuda")
    bucket, n = 4, 30
    codes = torch.randint(0, CFG.codebook_size, (3, CFG.num_quantizers, n), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(1))
    start, slot = (0, 3, 7), (4, 1, 2)
    static_codes = torch.zeros(bucket, CFG.num_quantizers, 1, dtype=torch.long, device="cuda")
    static_slots = torch.full((bucket,), pool.scratch_slot, device="cuda")
    static_fresh = torch.ones(bucket, dtype=torch.bool, device="cuda")
    rows = StateRows(pool.tensors, static_slots)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up (Triton's compiles, cuDNN's choices) before capture
        for _ in range(3):
            module.stream(static_codes, rows, static_fresh)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = module.stream(static_codes, rows, static_fresh)
    out: list[list[torch.Tensor]] = [[] for _ in start]
    for replay in range(n + max(start)):
        static_slots.fill_(pool.scratch_slot)
        static_fresh.fill_(True)
        active = [r for r, s in enumerate(start) if s <= replay < s + n]
        for i, r in enumerate(reversed(active)):   # rows move between bucket positions
            static_codes[i] = codes[r, :, replay - start[r]:replay - start[r] + 1]
            static_slots[i] = slot[r]
            static_fresh[i] = replay == start[r]
        graph.replay()
        for i, r in enumerate(reversed(active)):
            out[r].append(static_out[i].clone())
    for r in range(len(start)):
        streamed = torch.cat(out[r])
        assert torch.equal(streamed[:module.held], torch.zeros_like(streamed[:module.held]))
        whole = module.decode(codes[r:r + 1])[0]
        assert whole.std() > 0.05
        torch.testing.assert_close(streamed[module.held:], whole, atol=1e-5, rtol=0)
