"""Qwen3-Omni's CUDA fast paths against their eager selves on the GPU: the
code predictor's frame as CUDA graphs (one per forward, draws eager between
them) gives the eager frame's logits step by step (both fed the same codes)
and, drawing greedily, its codes, for batches that fill a bucket and batches
that do not, frame after frame."""

from __future__ import annotations

import pytest
import torch

from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.speech.code_predictor import CodePredictor
from test_qwen3_omni_config import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_frame_graphs_give_the_eager_frames_logits_and_codes(rows: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = Qwen3OmniConfig.from_dict(tiny().to_dict()).talker.code_predictor
    torch.manual_seed(0)
    cp = CodePredictor(cfg, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        for name, p in cp.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    last, first = torch.randn(2, rows, cfg.hidden_size, device="cuda")

    def recording(logged: list[torch.Tensor], codes: torch.Tensor | None):
        def draw(logits: torch.Tensor, j: int) -> torch.Tensor:
            logged.append(logits.clone())
            return logits.argmax(-1) if codes is None else codes[:, j]
        return draw

    with torch.no_grad():
        eager_logits: list[torch.Tensor] = []
        codes, embeds = cp.complete(last, first, recording(eager_logits, None))
        cp.capture((1, 2, 4, 8))
        assert cp.graphs is not None
        for frame in range(2):  # a second frame over the cache the first left behind
            logged: list[torch.Tensor] = []
            forced, _ = cp.complete(last, first, recording(logged, codes))
            for j, (got, want) in enumerate(zip(logged, eager_logits)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"frame {frame} step {j}: {m}")
            got_codes, got_embeds = cp.complete(last, first, recording([], None))
            assert torch.equal(got_codes, codes)
            torch.testing.assert_close(got_embeds, embeds)
